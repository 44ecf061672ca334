"""Torch-side code of the lion entry: the optimizer itself."""

from __future__ import annotations

import torch

from gradscale.optimizers._foreach import ForeachOptimizer


class Lion(ForeachOptimizer):
    """Lion (Chen et al. 2023, arXiv 2302.06675), decoupled weight decay:

        theta = theta*(1 - lr*wd) - lr * sign(b1*m + (1-b1)*g);  then  m = b2*m + (1-b2)*g

    The sign makes every update +-lr whatever the gradient's scale (until g underflows to 0).
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group, params, grads in self._groups_with_grads():
            beta1, beta2 = group["betas"]
            m = [self._exp_avg(p) for p in params]
            direction = torch._foreach_sign(torch._foreach_lerp(m, grads, 1 - beta1))
            self._decay_and_update(params, direction, group, alpha=-group["lr"])
            torch._foreach_lerp_(m, grads, 1 - beta2)


    def _exp_avg(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum, zeros on the first step only (setdefault would allocate a tensor on every step)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
        return state["exp_avg"]
