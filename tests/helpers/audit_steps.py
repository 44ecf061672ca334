"""Steps a user might write, for the audit's verdicts: a legitimate objective other than the token mean, bugs the
old batch and layouts hid, and signatures that are no weighting bug (clipping, bf16, zeroed gradients)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradscale.audit.zoo import accumulate, global_token_mean, global_tokens, grad_norm, seq_mean_global, token_loss_sum


def seq_mean(model, micro_batches, world):
    """Correct for --objective seq-mean-token-mean (a different objective from the token mean)."""
    return seq_mean_global(model, micro_batches, world)


def last_rank_doubled(model, micro_batches, world):
    """A bug only the last rank has (its loss counted twice): hidden wherever that rank trains nothing."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    factor = 2.0 if world.rank == world.size - 1 and world.size > 1 else 1.0
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size * factor / tokens)
    return grad_norm(model)


def clipped_before_reduce(model, micro_batches, world):
    """Each rank clips its own gradient at max_norm 1 before the reduction (and hands over the clipped one)."""
    tokens = global_tokens(micro_batches)
    for mb in micro_batches:
        (token_loss_sum(model, mb) * world.size / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world.size
    return grad_norm(model)


def zeroed_per_micro_batch(model, micro_batches, world):
    """Gradients zeroed before each micro-batch's backward: only the last micro-batch's survive."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)

    def loss_of(k, mb):
        model.zero_grad(set_to_none=False)  # the bug
        return token_loss_sum(net, mb) * world.size / tokens
    accumulate(net, micro_batches, loss_of)
    return grad_norm(model)


def bf16_reduction(model, micro_batches, world):
    """The fix's arithmetic, with the gradient rounded to bf16 before it is handed over (a bf16 step)."""
    norm = global_token_mean(model, micro_batches, world)
    for p in model.parameters():
        p.grad = p.grad.bfloat16().float()
    return norm
