"""Adafactor (torch.optim.Adafactor): a factored second moment, no first moment, update clipping.

Per matrix, v_hat = row_var (x) col_var / max(mean(row_var), eps1), update = g / sqrt(max(v_hat, eps1^2)),
divided by max(1, RMS(update) / d), step size max(eps2, RMS(param)) * min(lr, 1 / sqrt(t)). Under g -> c*g
every variance scales by c^2 and the update is invariant, until one of the two places eps1 enters binds:
the per-coordinate floor eps1^2 (like AdamW's eps, at c * sqrt(v) < eps1) and the per-matrix floor on
mean(row_var) (at c^2 * mean(row_var) < eps1). They scale differently (eps1 / c and eps1 / c^2), so no
single eps gives the run at c back at c = 1: no twin.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradscale.checks import check, finite_positive
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule, parameters


@dataclass
class AdafactorConfig(OptimizerConfig):
    name: str = "adafactor"
    lr: float = 1e-2  # caps the relative step size rho_t = min(lr, 1 / sqrt(t))
    beta2_decay: float = -0.8  # 1 - beta2_t = t ** beta2_decay
    eps1: float | None = None  # inside the factored moment; null: the dtype's machine epsilon (1.19e-7 in fp32)
    eps2: float = 1e-3  # floor of the parameter RMS the step is scaled by
    d: float = 1.0  # update clipping: the update's RMS is cut to d

    def check(self) -> None:
        OptimizerConfig.check(self)
        check(self.beta2_decay <= 0, "optimizer.beta2_decay", self.beta2_decay, "must be <= 0")
        if self.eps1 is not None:
            finite_positive("optimizer.eps1", self.eps1)
        finite_positive("optimizer.eps2", self.eps2)
        check(self.d >= 1, "optimizer.d", self.d, "must be >= 1")


def build(cfg: AdafactorConfig, named_params):
    import torch

    # foreach=True: one arithmetic on every machine (the default picks by device), as for AdamW
    return torch.optim.Adafactor(parameters(named_params), lr=cfg.lr, beta2_decay=cfg.beta2_decay,
                                 eps=(cfg.eps1, cfg.eps2), d=cfg.d, weight_decay=cfg.weight_decay, foreach=True)


ENTRY = OptimizerEntry(
    name="adafactor", label="Adafactor", config=AdafactorConfig, build=build, adam_state=None,
    scale_rule=ScaleRule("eps", eps_key="eps1"),
    summary="torch.optim.Adafactor: factored second moment, invariant to c until eps1 binds",
)
