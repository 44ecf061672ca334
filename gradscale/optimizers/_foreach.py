"""Torch-side code the hand-written optimizers (Adam-atan2, Lion) share."""

from __future__ import annotations

import torch


class ForeachOptimizer(torch.optim.Optimizer):
    """What the contrasts share: per param group, the parameters that have a gradient, as lists for
    foreach ops, and the decoupled weight decay before the update."""

    def _groups_with_grads(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                yield group, params, [p.grad for p in params]

    @staticmethod
    def _decay_and_update(params, update, group, alpha: float) -> None:
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, update, alpha=alpha)
