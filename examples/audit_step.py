"""A training step as `gradscale-audit` takes it (docs/audit.md):

    gradscale-audit examples.audit_step:step          # flagged: gradients 1/K with accumulation
    gradscale-audit examples.audit_step:fixed_step    # passes
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def step(model, micro_batches, world):
    net = DistributedDataParallel(model)  # averages the gradients over the ranks
    tokens = torch.tensor(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches))
    dist.all_reduce(tokens)  # the global trained-token count
    for mb in micro_batches:
        logits = net(input_ids=mb["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum")
        # the bug: / K "for accumulation", though the global count already covers every micro-batch
        (loss * world.size / tokens / world.accumulation).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()  # the logged grad norm


def fixed_step(model, micro_batches, world):
    net = DistributedDataParallel(model)
    tokens = torch.tensor(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches))
    dist.all_reduce(tokens)
    for mb in micro_batches:
        logits = net(input_ids=mb["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), mb["labels"][:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum")
        (loss * world.size / tokens).backward()  # times N: DDP divides by N
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
