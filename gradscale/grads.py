"""The gradient pipeline between backward() and optimizer.step(): a normalization recipe, the scale, clipping.

Every rank r sums token cross-entropy over its trained tokens (each sequence weighted by the
recipe's loss weight, 1 for the global-token recipes) and calls backward. Then:

    num_tokens = sum_r T_r                         global count of trained tokens (all-reduce SUM)
    grad       = (1/N) * sum_r G_r                 DDP / FSDP all-reduce with AVERAGE over N ranks
    grad      *= (N if fix else 1) / num_tokens    the world-size fix (torchtune PR 2172)
    grad      *= scale                             the studied factor c
    grad_norm  = ||grad||_2                        logged: what the optimizer is given, pre-clip
    grad      *= min(1, max_norm / (grad_norm + 1e-6))   optional clipping (torch's rule); the factor is logged

With fix=True the optimizer sees the gradient of the global token-mean loss, g; with fix=False it
sees g / N. The effective multiplier is c_eff = scale * (1 if fix else 1/N) (Recipe.c_eff).

Emulating N ranks in one process costs nothing: the sum of per-rank sums is the sum over the
global batch, so one backward over the global batch and the factor 1/N give the averaged gradient.

The recipes (`normalization=`) and what each does: gradscale/recipes.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gradscale.data import IGNORE_INDEX
from gradscale.parallel import Ranks, local
from gradscale.recipes import Recipe, recipe


@dataclass(frozen=True)
class GradPipeline:
    """recipe: the normalization in effect (`fix` is resolved into it with the config: hydra_glue.to_object)."""

    world_size: int
    scale: float
    recipe: str = "global_tokens"
    clip_grad_norm: float | None = None
    grad_accum: int = 1

    def __post_init__(self) -> None:
        recipe(self.recipe, "recipe")  # an unknown name fails here, never trains at some default factor

    @property
    def rule(self) -> Recipe:
        return recipe(self.recipe)

    def sequence_weights(self, targets: torch.Tensor) -> torch.Tensor:
        """Loss weight of each sequence of the global batch, applied before backward.

        Rank r owns block r of the batch and its micro-batch k is block k of that (as in Ranks)."""
        counts = (targets != IGNORE_INDEX).sum(1).double()
        mean_over = self.rule.mean_over
        if mean_over is None:
            return torch.ones_like(counts, dtype=torch.float32)
        blocks = self.world_size * (self.grad_accum if mean_over == "microbatch" else 1)
        per_block = torch.stack([c.sum() for c in counts.chunk(blocks)]).clamp_min(1)
        weights = 1.0 / per_block
        if mean_over == "microbatch":
            weights = weights / self.grad_accum
        return weights.repeat_interleave(len(targets) // blocks).float()

    def factor(self, num_tokens: int, ranks_averaged: bool = False) -> float:
        """Multiplier from the weighted, summed gradients to what the optimizer sees.

        ranks_averaged: a real engine (DDP / FSDP) has already divided by N; emulation has not."""
        rank_average = 1.0 if ranks_averaged else 1.0 / self.world_size
        return rank_average * self.rule.factor(self.world_size, num_tokens) * self.scale

    @property
    def c_eff(self) -> float:
        """The gradient the optimizer sees is c_eff times the token-mean gradient (global recipes)."""
        return self.rule.c_eff(self.scale, self.world_size)

    @torch.no_grad()
    def apply(
        self, params: list[torch.Tensor], num_tokens: int, ranks: Ranks | None = None, measure: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Normalize, scale and (optionally) clip the gradients in place.

        Returns the pre-clip grad norm and the clip coefficient the gradients were multiplied by (1: not
        clipped), as 0-d tensors (no host sync); the coefficient is None without clipping. Without clipping
        the norm is computed only when `measure` (a logged step): None otherwise.
        """
        ranks = ranks or Ranks(world_size=self.world_size)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, self.factor(num_tokens, ranks_averaged=ranks.real))
        if self.clip_grad_norm is None:
            return (total_norm(grads, ranks) if measure else None), None
        norm = total_norm(grads, ranks)
        # torch.nn.utils.clip_grad_norm_'s rule, without its host sync: users' loops clip this way, 1e-6 and all
        coef = torch.clamp(self.clip_grad_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm, coef


def total_norm(tensors: list[torch.Tensor], ranks: Ranks | None = None) -> torch.Tensor:
    """L2 norm over all tensors; over all shards when FSDP2 shards them."""
    if not tensors:
        return torch.zeros(())
    shards = [local(t) for t in tensors]
    square_sum = torch.stack(torch._foreach_norm(shards)).square().sum()
    if ranks is not None:
        square_sum = ranks.sum_if_sharded(square_sum)
    return square_sum.sqrt()


def count_trained_tokens(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def global_token_count(local_targets: torch.Tensor, ranks: Ranks) -> int:
    """Trained tokens over all ranks: counted on the host, then all-reduced SUM (on the collective device)."""
    return int(ranks.sum(torch.tensor(count_trained_tokens(local_targets))))


# Rows of logits per block of the token cross-entropy: at most this many fp32 elements at once (16 MiB).
CROSS_ENTROPY_BLOCK = 2**22


class _BlockwiseCrossEntropy(torch.autograd.Function):
    """Token cross-entropy a block of rows at a time, with F.cross_entropy's own kernels (log_softmax, then
    nll_loss; in the backward nll_loss_backward, then _log_softmax_backward_data), so the same bits as
    `cross_entropy(logits.float(), ...)`: each row's softmax is computed on its own either way. What it saves
    is memory: no [tokens, vocabulary] fp32 copy of the logits, log-probabilities, nll gradient or log-softmax
    gradient (400 MB each at SmolLM2's 16 x 128 tokens), only three block-sized buffers, reused block after
    block (fresh large blocks are page-faulted in on the CPU); the backward recomputes a block's
    log-probabilities from the saved logits. Where all rows fit one block (the tiny model) the log-probabilities
    are kept from the forward instead, as F.cross_entropy keeps them: recomputing them cost the tiny model's
    step 9 ms of its 69 (docs/performance.md)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = torch.empty(len(targets), dtype=torch.float32, device=logits.device)
        buffers = _BlockBuffers(logits)
        for rows in buffers.blocks:
            log_probs = buffers.log_probs(logits, rows)
            losses[rows] = torch.nn.functional.nll_loss(log_probs, targets[rows], ignore_index=IGNORE_INDEX,
                                                        reduction="none")
        ctx.save_for_backward(logits, targets, log_probs if len(buffers.blocks) == 1 else None)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, targets, kept = ctx.saved_tensors
        grad = torch.empty_like(logits)
        buffers = _BlockBuffers(logits)
        no_weight = torch.ones((), device=logits.device)
        for rows in buffers.blocks:
            log_probs = kept if kept is not None else buffers.log_probs(logits, rows)
            n = len(log_probs)
            grad_log_probs = torch.ops.aten.nll_loss_backward.grad_input(
                grad_losses[rows], log_probs, targets[rows], None, 0, IGNORE_INDEX, no_weight,
                grad_input=buffers.grad[:n])
            in_place = grad.dtype == torch.float32  # fp32 logits: the gradient is written where it goes
            out = grad[rows] if in_place else buffers.logits[:n]
            torch.ops.aten._log_softmax_backward_data.out(grad_log_probs, log_probs, -1, torch.float32, out=out)
            if not in_place:
                grad[rows] = out
        return grad, None


class _BlockBuffers:
    """The fp32 buffers of _BlockwiseCrossEntropy: CROSS_ENTROPY_BLOCK elements each, whole rows, each made
    when first used (fp32 logits need no copy buffer)."""

    def __init__(self, logits: torch.Tensor):
        self.rows = max(1, min(len(logits), CROSS_ENTROPY_BLOCK // logits.shape[1]))
        self.blocks = [slice(start, start + self.rows) for start in range(0, len(logits), self.rows)]
        self.shape, self.device = (self.rows, logits.shape[1]), logits.device

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    logits = functools.cached_property(_buffer)
    log_probs_out = functools.cached_property(_buffer)
    grad = functools.cached_property(_buffer)

    def log_probs(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        block = logits[rows]
        n = len(block)
        if block.dtype != torch.float32:  # fp32 logits need no copy to be read as fp32
            block = self.logits[:n].copy_(block)
        return torch.log_softmax(block, -1, out=self.log_probs_out[:n])


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy in fp32, [batch, seq]; 0 where the target is not trained. The bits of
    `F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")` and of its
    gradient, in a fraction of the memory (_BlockwiseCrossEntropy)."""
    return _BlockwiseCrossEntropy.apply(logits.flatten(0, 1), targets.flatten()).view(targets.shape)


def sequence_loss_sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums (not means) of token cross-entropy over trained tokens, in fp32."""
    return token_losses(logits, targets).sum(1)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return sequence_loss_sums(logits, targets).sum()
