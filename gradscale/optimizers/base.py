"""What an optimizer entry is (gradscale/optimizers/__init__.py has the registry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from gradscale.checks import check, finite_positive

SCALE_RULES = ("linear", "eps", "invariant")
ADAM_STATES = ("all", "part", None)


@dataclass(frozen=True)
class ScaleRule:
    """What multiplying every gradient by c does to the run (docs/design.md, the physics):

    linear     the step is c times as large: SGD(lr, c) == SGD(lr * c, 1) without weight decay
    eps        invariant except where an eps competes with the gradient's scale: AdamW(c, eps) == AdamW(1, eps / c)
    invariant  the same run at every c until the gradient under- or overflows (a sign, an atan2)

    eps_key: the config key of the per-coordinate eps that sqrt(v_hat) is compared with (the breakdown band).
    twin: (key, power) pairs: the run at c equals the run at c = 1 with each key multiplied by c**power;
    empty when no such run exists (two eps that scale differently).
    twin_needs_no_weight_decay: the twin holds only at weight_decay = 0 (SGD's coupled decay)."""

    kind: str
    eps_key: str | None = None
    twin: tuple[tuple[str, int], ...] = ()
    twin_needs_no_weight_decay: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SCALE_RULES:
            raise ValueError(f"ScaleRule.kind={self.kind!r}: one of {', '.join(SCALE_RULES)}")


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer, in one place. label: its name in tables and rules ("AdamW").

    config: its section's dataclass (Hydra's schema/optimizer/NAME; gradscale/conf/optimizer/NAME.yaml fills it in).
    build: (its config section, [(name, trainable parameter)]) -> a torch optimizer; imports torch itself.
    adam_state: where its state holds Adam's moments (exp_avg, exp_avg_sq, under param groups with betas and
      eps): "all" (every trained parameter), "part" (a hybrid's Adam groups), None. The adam/* metrics, the
      sqrt(v_hat) histograms and the advisor read them; a whole-model prediction needs "all".
    refuse: a rule against the rest of the run's config: (key, value, why) when the pairing cannot run."""

    name: str
    label: str
    config: type
    build: Callable[[Any, list[tuple[str, Any]]], Any]
    scale_rule: ScaleRule
    adam_state: str | None
    summary: str
    refuse: Callable[[Any], tuple[str, Any, str] | None] | None = None

    def __post_init__(self) -> None:
        if self.adam_state not in ADAM_STATES:
            raise ValueError(f"{self.name}: adam_state={self.adam_state!r}, one of {ADAM_STATES}")


@dataclass
class OptimizerConfig:
    """What every optimizer section has; the name is checked against the registry by config.validate."""

    name: str = MISSING
    lr: float = MISSING
    weight_decay: float = 0.0

    def check(self) -> None:
        finite_positive("optimizer.lr", self.lr)
        check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "must be >= 0")


def parameters(named_params) -> list:
    return [p for _, p in named_params]
