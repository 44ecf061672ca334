"""Lion (Chen et al. 2023): the sign of an interpolated momentum; no eps."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradscale.checks import check_betas
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule, parameters


@dataclass
class LionConfig(OptimizerConfig):
    name: str = "lion"
    lr: float = 3e-4  # sign updates have RMS 1: the paper's advice is 3-10x below AdamW's lr
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])

    def check(self) -> None:
        OptimizerConfig.check(self)
        check_betas(self.betas)


def build(cfg: LionConfig, named_params):
    from gradscale.optimizers._lion import Lion

    return Lion(parameters(named_params), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


ENTRY = OptimizerEntry(
    name="lion", label="Lion", config=LionConfig, build=build, adam_state=None, scale_rule=ScaleRule("invariant"),
    summary="Lion (hand-written): every update is +-lr, invariant to c until g underflows",
)
