"""Torch-side code of the adam_atan2 entry: the optimizer itself."""

from __future__ import annotations

import math

import torch

from gradscale.optimizers._foreach import ForeachOptimizer


class AdamAtan2(ForeachOptimizer):
    """Adam-atan2 (Everett et al. 2024, arXiv 2407.05872), decoupled weight decay:

        m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  m_hat, v_hat bias-corrected
        theta = theta*(1 - lr*wd) - lr * a * atan2(m_hat, b * sqrt(v_hat))

    atan2(c*x, c*y) == atan2(x, y): no eps, so the update is invariant to the gradient's scale until
    g^2 under- or overflows (docs/design.md, physics 7). atan2(0, 0) = 0 on coordinates never given a gradient.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), a: float = 4 / math.pi, b: float = 1.0,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), a=a, b=b, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group, params, grads in self._groups_with_grads():
            beta1, beta2 = group["betas"]
            m, v, steps = self._state(params)
            torch._foreach_lerp_(m, grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
            # each parameter's own count (as torch's AdamW): one whose gradients start later is corrected by its own
            m_hat = torch._foreach_div(m, [1 - beta1**step for step in steps])
            denom = torch._foreach_sqrt(torch._foreach_div(v, [1 - beta2**step for step in steps]))
            torch._foreach_mul_(denom, group["b"])
            update = [torch.atan2(x, y) for x, y in zip(m_hat, denom)]  # no foreach atan2 in torch
            self._decay_and_update(params, update, group, alpha=-group["lr"] * group["a"])

    def _state(self, params):
        """(exp_avg list, exp_avg_sq list, each one's step count after this update), stepping every count."""
        m, v = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            m.append(state["exp_avg"])
            v.append(state["exp_avg_sq"])
        return m, v, [self.state[p]["step"] for p in params]
