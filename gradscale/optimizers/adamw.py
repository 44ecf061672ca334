"""AdamW: invariant to the gradient's scale while eps / c << sqrt(v_hat)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscale.checks import check_betas, finite_positive
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule, parameters


@dataclass
class AdamWConfig(OptimizerConfig):
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8

    def check(self) -> None:
        OptimizerConfig.check(self)
        check_betas(self.betas)
        # eps = 0 is 0/0 on coordinates that never get a gradient (unused embedding rows)
        finite_positive("optimizer.eps", self.eps)


def build(cfg: AdamWConfig, named_params):
    import torch

    # foreach=True everywhere: the fused and for-loop kernels round differently, and equal
    # arithmetic on every machine is what makes AdamW(c, eps) == AdamW(1, eps/c) testable.
    return torch.optim.AdamW(parameters(named_params), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=True)


ENTRY = OptimizerEntry(
    name="adamw", label="AdamW", config=AdamWConfig, build=build, adam_state="all",
    scale_rule=ScaleRule("eps", eps_key="eps", twin=(("eps", -1),)),
    summary="torch.optim.AdamW: invariant to c while eps / c << sqrt(v_hat)",
)
