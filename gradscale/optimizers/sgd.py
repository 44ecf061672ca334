"""SGD with momentum: linear in the gradient, so it feels every factor c."""

from __future__ import annotations

from dataclasses import dataclass

from gradscale.checks import check
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule, parameters


@dataclass
class SGDConfig(OptimizerConfig):
    name: str = "sgd"
    lr: float = 0.03
    momentum: float = 0.9
    nesterov: bool = False

    def check(self) -> None:
        OptimizerConfig.check(self)
        check(0 <= self.momentum < 1, "optimizer.momentum", self.momentum, "must be in [0, 1)")
        check(not self.nesterov or self.momentum > 0, "optimizer.nesterov", self.nesterov, "needs momentum > 0")


def build(cfg: SGDConfig, named_params):
    import torch

    return torch.optim.SGD(parameters(named_params), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           weight_decay=cfg.weight_decay)


ENTRY = OptimizerEntry(
    name="sgd", label="SGD", config=SGDConfig, build=build, adam_state=None,
    scale_rule=ScaleRule("linear", twin=(("lr", 1),), twin_needs_no_weight_decay=True),
    summary="torch.optim.SGD: the step is linear in c (SGD(lr, c) == SGD(lr * c, 1) without decay)",
)
