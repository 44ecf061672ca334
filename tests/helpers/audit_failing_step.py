"""A step that raises on rank 1 only, after rank 0 has done its share: for the audit's failure path."""

import torch.distributed as dist

from gradscale.audit.zoo import global_token_mean


def step(model, micro_batches, world):
    norm = global_token_mean(model, micro_batches, world)  # every rank reduces; rank 0 then saves its gradient
    if world.rank == 1:
        raise ZeroDivisionError("rank 1's logging divided by its empty micro-batch")
    dist.barrier()  # rank 0 waits here for a peer that is gone
    return norm
