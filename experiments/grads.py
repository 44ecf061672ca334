"""The gradient pipeline between backward() and optimizer.step().

Every rank r sums token cross-entropy over its trained tokens and calls backward, so its gradient
is G_r = sum over its tokens of d(loss_token)/d(theta). Then:

    num_tokens = sum_r T_r                         global count of trained tokens (all-reduce SUM)
    grad       = (1/N) * sum_r G_r                 DDP / FSDP all-reduce with AVERAGE over N ranks
    grad      *= (N if fix else 1) / num_tokens    the world-size fix (torchtune PR 2172)
    grad      *= scale                             the studied factor c
    grad_norm  = ||grad||_2                        logged: what the optimizer is given, pre-clip
    grad      *= min(1, max_norm / grad_norm)      optional clipping

With fix=True the optimizer sees the gradient of the global token-mean loss, g; with fix=False it
sees g / N. The effective multiplier is c_eff = scale * (1 if fix else 1/N).

Emulating N ranks in one process costs nothing: the sum of per-rank sums is the sum over the
global batch, so one backward over the global batch and the factor 1/N give the averaged gradient.
The three factors are applied as one multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradPipeline:
    world_size: int
    fix: bool
    scale: float
    clip_grad_norm: float | None = None

    def factor(self, num_tokens: int) -> float:
        """Multiplier from summed per-token gradients (over the global batch) to what the optimizer sees."""
        rank_average = 1.0 / self.world_size
        normalization = (self.world_size if self.fix else 1) / num_tokens
        return rank_average * normalization * self.scale

    @property
    def effective_scale(self) -> float:
        """c_eff: the gradient the optimizer sees is c_eff times the token-mean gradient."""
        return self.scale * (1.0 if self.fix else 1.0 / self.world_size)

    @torch.no_grad()
    def apply(self, params: list[torch.Tensor], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize, scale and (optionally) clip the summed gradients in place.

        Returns the pre-clip grad norm and whether clipping acted, as 0-d tensors (no host sync).
        """
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, self.factor(num_tokens))
        norm = total_norm(grads)
        if self.clip_grad_norm is None:
            return norm, torch.zeros((), dtype=torch.bool, device=norm.device)
        # same rule as torch.nn.utils.clip_grad_norm_, without its host sync
        coef = torch.clamp(self.clip_grad_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm, norm > self.clip_grad_norm


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


def count_trained_tokens(targets: torch.Tensor, ignore_index: int = -100) -> int:
    return int((targets != ignore_index).sum())


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum (not mean) of token cross-entropy over trained tokens; fp32 whatever the autocast dtype."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
