"""Adam-atan2 (Everett et al. 2024): atan2 replaces the division by sqrt(v_hat) + eps; no eps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gradscale.checks import check_betas, finite_positive
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule, parameters


@dataclass
class AdamAtan2Config(OptimizerConfig):
    name: str = "adam_atan2"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    a: float = 4 / math.pi  # update = a * atan2(m_hat, b * sqrt(v_hat))
    b: float = 1.0

    def check(self) -> None:
        OptimizerConfig.check(self)
        check_betas(self.betas)
        finite_positive("optimizer.a", self.a)
        finite_positive("optimizer.b", self.b)


def build(cfg: AdamAtan2Config, named_params):
    from gradscale.optimizers._adam_atan2 import AdamAtan2

    return AdamAtan2(parameters(named_params), lr=cfg.lr, betas=cfg.betas, a=cfg.a, b=cfg.b,
                     weight_decay=cfg.weight_decay)


# adam_state=None: it has Adam's moments but no eps, so no eps-dominated share or band to read from them
ENTRY = OptimizerEntry(
    name="adam_atan2", label="Adam-atan2", config=AdamAtan2Config, build=build, adam_state=None,
    scale_rule=ScaleRule("invariant"),
    summary="Adam-atan2 (hand-written): no eps, invariant to c until g^2 under- or overflows",
)
