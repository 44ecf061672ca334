"""The optimizers a run can use: one module per optimizer in this package, each ending with its ENTRY
(gradscale.optimizers.base.OptimizerEntry: its config, its builder, its scale rule, whether its state
holds Adam's moments, one line for --help).

Adding an optimizer is one module here (with, where it needs one, its torch-side implementation in a module
whose name starts with an underscore, imported by its builder) and one gradscale/conf/optimizer/NAME.yaml: validation,
the Hydra store, --help, the trainer's Adam statistics, the advisor and the analysis' equivalences read the
entry. No torch here: validation reads this registry and answers in about a second; a builder imports torch
when a run starts.
"""

from __future__ import annotations

import importlib
import pkgutil

from gradscale.checks import one_of
from gradscale.optimizers.base import OptimizerConfig, OptimizerEntry, ScaleRule

__all__ = ["OPTIMIZERS", "OptimizerConfig", "OptimizerEntry", "ScaleRule", "entry", "advisable", "build_optimizer"]


def _discover() -> dict[str, OptimizerEntry]:
    entries: dict[str, OptimizerEntry] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base" or info.name.startswith("_"):  # base: what an entry is; _name: torch-side code
            continue
        module_entry = importlib.import_module(f"{__name__}.{info.name}").ENTRY
        if module_entry.name != info.name:
            raise ValueError(f"gradscale/optimizers/{info.name}.py: its ENTRY is named {module_entry.name!r}")
        entries[module_entry.name] = module_entry
    return dict(sorted(entries.items()))


OPTIMIZERS: dict[str, OptimizerEntry] = _discover()


def entry(name: str, key: str = "optimizer.name") -> OptimizerEntry:
    """The registry's entry; an unknown name is a ConfigError naming the key and the known names."""
    one_of(key, name, OPTIMIZERS)
    return OPTIMIZERS[name]


def advisable(whole_model: bool = False) -> tuple[str, ...]:
    """The optimizers whose update the advisor predicts: Adam's moments compared with an eps (AdamW, and the
    Adam part of a hybrid). The others have no eps to cut their update (or no Adam state to read).
    whole_model: only those whose every trained parameter has Adam state, where the prediction is the whole
    model's update (a hybrid's other part is not in its histograms)."""
    return tuple(name for name, e in OPTIMIZERS.items()
                 if e.adam_state and e.scale_rule.eps_key and (e.adam_state == "all" or not whole_model))


def build_optimizer(cfg, named_params):
    """The optimizer of cfg.name over [(name, trainable parameter)], in the model's parameter order."""
    return entry(cfg.name).build(cfg, list(named_params))
