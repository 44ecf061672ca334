"""Hydra glue: the structured configs and the registries' schemas in Hydra's ConfigStore, the resolvers,
composing a config for Python callers, refusing unknown keys, and the validated config as dataclasses.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from gradscale.checks import ConfigError
from gradscale.config import Config, DataConfig, FinetuneConfig, ModelConfig, NormalizationConfig
from gradscale.console import CONF_DIR
from gradscale.optimizers import OPTIMIZERS
from gradscale.recipes import normalization_in_effect


def times(value: int, factor: float) -> int:
    product = value * factor
    if product != int(product) or product < 1:
        raise ConfigError(f"error: {value} x {factor} = {product:g} is not a whole dimension >= 1")
    return int(product)


def register_configs() -> None:
    # run.log on rank 0 (and when emulated), run.rank1.log ... on the other torchrun ranks
    OmegaConf.register_new_resolver(
        "rank_suffix", lambda: "" if os.environ.get("RANK", "0") == "0" else f".rank{os.environ['RANK']}", replace=True
    )
    # ${times:${model.hidden_size},2.75}: a dimension that scales with another (presets over model width)
    OmegaConf.register_new_resolver("times", times, replace=True)
    from gradscale.console import register_resolvers

    register_resolvers()  # --help's generated parts, the job tag on a sweep's console lines
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    # schemas live apart from the user's choices, so `optimizer=...` lists only real options
    for optimizer in OPTIMIZERS.values():
        cs.store(group="schema/optimizer", name=optimizer.name, node=optimizer.config)
    cs.store(group="schema/finetune", name="finetune", node=FinetuneConfig)
    cs.store(group="schema/model", name="llama", node=ModelConfig)
    cs.store(group="schema/data", name="data", node=DataConfig)
    cs.store(group="schema/normalization", name="normalization", node=NormalizationConfig)


def unknown_key_problem(cfg: DictConfig, key: str) -> str | None:
    """Why a dotted `key` names no key of the composed config (with the closest one), or None."""
    node: Any = cfg
    for depth, part in enumerate(key.split(".")):
        if not isinstance(node, DictConfig) or part not in node:
            where = key.rsplit(".", 1)[0] if depth else ""
            keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
            close = difflib.get_close_matches(part, keys, n=1, cutoff=0.6)
            hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
            return f"error: {key} is not a config key{hint} (docs/configuration.md lists every key)"
        node = node[part]
    return None


def refuse_unknown_keys() -> None:
    """Hydra lets `+key=value` add any key, so a typo such as `+stpes=10` would run with it ignored, and
    answers one without `+` in five lines. Every override of a config key must name a key of the composed
    config, and a value of the key's type: otherwise one line, exit 2, before any folder exists. (Hooks
    Hydra's override step: Hydra 1.3 has no callback between composing and applying overrides.)"""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    apply = ConfigLoaderImpl._apply_overrides_to_config
    if getattr(apply, "refuses_unknown_keys", False):
        return

    def checked(overrides, cfg: DictConfig) -> None:
        from hydra.errors import ConfigCompositionException
        from omegaconf.errors import ValidationError

        for override in overrides:
            if override.is_hydra_override() or override.is_delete() or override.package is not None:
                continue
            problem = unknown_key_problem(cfg, override.key_or_group)
            if problem:
                print(problem, file=sys.stderr, flush=True)
                sys.exit(2)
        try:
            apply(overrides, cfg)
        except ConfigCompositionException as e:  # a value of the wrong type (fix=maybe, steps=abc): one line, exit 2
            if not isinstance(e.__cause__, ValidationError):
                raise
            which = str(e).removeprefix("Error merging override ").strip()
            print(f"error: {which} is not allowed: {str(e.__cause__).splitlines()[0]}", file=sys.stderr, flush=True)
            sys.exit(2)

    checked.refuses_unknown_keys = True
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(checked)


def unknown_option_problem(overrides: list[str]) -> str | None:
    """One line for a config-group option that does not exist (`optimizer=adam`, `model=sgd,bogus` in a sweep),
    where Hydra answers in 13 lines; None when every plain option names a file of its group. Sweep functions
    (`choice(...)`, globs) are left to Hydra."""
    import re

    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        folder = os.path.join(CONF_DIR, key)
        if not sep or key.startswith("hydra") or not os.path.isdir(folder) or not re.fullmatch(r"[\w.\-,]+", value):
            continue
        options = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
        unknown = [v for v in value.split(",") if v not in options]
        if unknown:
            return f"error: {key}={unknown[0]} is not allowed: one of {', '.join(options)}"
    return None


def compose_checked(overrides: list[str]) -> DictConfig:
    """compose, with a group option that does not exist or an override Hydra refuses as a one-line ConfigError
    (Hydra says either in many lines): for the commands that compose in Python (gradscale.pretrain,
    gradscale.advise)."""
    from hydra.errors import HydraException

    if problem := unknown_option_problem(overrides):
        raise ConfigError(problem)
    try:
        return compose(overrides)
    except HydraException as e:  # an override of a key the config does not have, a broken override
        cause = f": {str(e.__cause__).splitlines()[0]}" if e.__cause__ else ""
        raise ConfigError(f"error: {' '.join(str(e).split())}{cause}") from None


def to_object(cfg: DictConfig) -> Config:
    """The validated job config (as the task function gets it: no hydra node) as dataclass instances, with
    `fix` resolved into the normalization in effect: the one place it is (normalization_in_effect)."""
    run_cfg: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_cfg.normalization.name = normalization_in_effect(run_cfg.fix, run_cfg.normalization.name)
    return run_cfg




def compose(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The composed DictConfig for these overrides, as the command line builds it (the hydra node, launcher
    and sweeper included only when asked): for Python callers (tests, the benchmark, the parity oracle)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)
