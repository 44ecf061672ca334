"""Sweep folders (or single run folders) -> pandas tables. Reads only the files runs write.

runs table: one row per run, its config flattened into columns, and what summary.json says (among it the
  normalization in effect and c_eff, as the run trained with them)
curves table: long form (run, step, metric, value), from metrics.jsonl
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from gradscale.optimizers import entry as optimizer_entry
from gradscale.recipes import c_eff, normalization_in_effect
from gradscale.runs import job_dirs, job_overrides, short_number

log = logging.getLogger(__name__)

RUN_COLUMNS = ("run", "optimizer", "finetune", "model", "lr", "eps", "weight_decay", "scale", "fix", "world_size",
               "clip", "precision", "bf16_matmul", "normalization", "seed", "steps", "status", "final_loss",
               "best_eval_loss", "diverged_at_step", "steps_done", "clipped_steps", "path", "c_eff")


def run_dirs(paths: list[str | Path]) -> list[Path]:
    """Every run folder (one with .hydra/config.yaml) at or below the given paths, in job order."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"error: {path} does not exist")
        if (path / ".hydra" / "config.yaml").exists():
            found.append(path)
        else:  # every sweep folder below, each in job order
            for sweep_dir in sorted({c.parent.parent.parent for c in path.rglob(".hydra/config.yaml")}):
                found.extend(job_dirs(sweep_dir))
    if not found:
        raise FileNotFoundError(f"error: no run folders (with .hydra/config.yaml) under {', '.join(map(str, paths))}")
    return found


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file, or of its gzip beside it (PATH.gz: how a kept study stores its large Adam
    statistics); a torn last line (a run killed mid-write) is skipped."""
    packed = path.with_name(path.name + ".gz")
    if path.exists():
        lines = path.read_text().splitlines()
    elif packed.exists():
        lines = gzip.decompress(packed.read_bytes()).decode().splitlines()
    else:
        return []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
            log.warning("%s: skipped a torn last line", path)
    return records


def _eps(optimizer_cfg) -> float:
    """The eps that the optimizer's scale rule compares sqrt(v_hat) with (NaN: none, as for SGD or Lion)."""
    key = optimizer_entry(optimizer_cfg.name).scale_rule.eps_key
    value = optimizer_cfg.get(key) if key else None
    return float(value) if value is not None else float("nan")


def _run_row(run_dir: Path, name: str) -> dict:
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {"status": "interrupted"}
    opt = cfg.optimizer
    world_size = int(summary.get("world_size", cfg.world_size))
    # what the run trained with; a folder from a run that never started falls back on the config's rule
    normalization = summary.get("normalization") or normalization_in_effect(
        bool(cfg.fix), OmegaConf.select(cfg, "normalization.name", default="global_tokens"))
    multiplier = summary.get("c_eff", summary.get("effective_scale"))  # effective_scale: before the rename
    return {
        "run": name,
        "optimizer": opt.name,
        "finetune": OmegaConf.select(cfg, "finetune.name", default="full"),
        "model": model_label(cfg.model),
        "lr": float(opt.lr),
        "eps": _eps(opt),
        "weight_decay": float(opt.weight_decay),
        "scale": float(cfg.scale),
        "fix": bool(cfg.fix),
        "world_size": world_size,
        "clip": cfg.clip_grad_norm,
        "precision": cfg.precision,
        # as configured, not as resolved (summary.json): "auto" picks kernels per CPU and a study's seed band may
        # span CPUs; a run from before the setting counts as its default
        "bf16_matmul": OmegaConf.select(cfg, "bf16_matmul", default="auto"),
        "normalization": normalization,
        "c_eff": float(multiplier) if multiplier is not None else c_eff(float(cfg.scale), normalization, world_size),
        "seed": int(cfg.seed),
        "steps": int(cfg.steps),
        "status": summary["status"],
        "final_loss": summary.get("final_loss"),
        "best_eval_loss": summary.get("best_eval_loss"),
        "diverged_at_step": summary.get("diverged_at_step"),
        "steps_done": summary.get("steps_done"),
        "clipped_steps": summary.get("clipped_steps"),
        "path": str(run_dir),
    }


def run_names(dirs: list[Path]) -> list[str]:
    """A short unique name per run: its folder's name without the overrides every job of its sweep shares
    (`experiment=scale_sweep`, `smoke=on`), prefixed by the sweep folder when several sweeps are loaded."""
    by_sweep: dict[Path, list[Path]] = {}
    for d in dirs:
        by_sweep.setdefault(d.parent, []).append(d)
    shared = {parent: set.intersection(*(set(job_overrides(d)) for d in jobs)) if len(jobs) > 1 else set()
              for parent, jobs in by_sweep.items()}
    names = []
    for d in dirs:
        number, _, overrides = d.name.partition("_")
        for override in shared[d.parent]:  # whole overrides only: a value may hold commas itself
            if overrides == override:
                overrides = ""
            elif overrides.startswith(override + ","):
                overrides = overrides[len(override) + 1:]
            elif overrides.endswith("," + override):
                overrides = overrides[: -len(override) - 1]
            else:
                overrides = overrides.replace("," + override + ",", ",")
        if not number.isdigit():  # a single run's folder, named by its user
            name = d.name
        else:
            name = f"{number}_{overrides}" if overrides else number
        names.append(f"{d.parent.name}/{name}" if len(by_sweep) > 1 else name)
    return names


def logged_group(run_dir: Path, config: dict) -> str | None:
    """The W&B group gradscale.run gave this run: wandb.group (in a sweep, the sweeper names it:
    gradscale.sweep.wandb_group), else, for a sweep run before that, the sweep folder's name; None: a single
    run. config: the run's .hydra/config.yaml as a dict."""
    if config["wandb"].get("group"):
        return str(config["wandb"]["group"])
    hydra = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra, resolve=False)
    if hydra.get("mode") != "MULTIRUN":
        return None
    sweep_dir = str(hydra["sweep"]["dir"])
    # an unresolved ${now:...} was resolved once, at launch, into the folder the job sits in
    return run_dir.parent.name if "${" in sweep_dir else Path(sweep_dir).name


def model_label(model_cfg) -> str:
    """Which weights a run started from: the model's name, and for the tiny model whether its base was
    pretrained or random (a user's model.path is named by its folder)."""
    if OmegaConf.select(model_cfg, "path"):
        return Path(model_cfg.path).name
    if OmegaConf.select(model_cfg, "gguf_file"):
        return str(model_cfg.name)
    return f"{model_cfg.name} ({OmegaConf.select(model_cfg, 'init', default='random')} init)"


def load(paths: list[str | Path] | str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, curves) for the sweeps or runs at `paths`."""
    dirs = run_dirs([paths] if isinstance(paths, (str, Path)) else list(paths))
    names = run_names(dirs)
    rows, curves = [], []
    for d, name in zip(dirs, names):
        rows.append(_run_row(d, name))
        for record in read_jsonl(d / "metrics.jsonl"):
            step = record.get("step")
            for metric, value in record.items():
                if metric != "step":
                    curves.append((name, step, metric, float(value)))  # "nan"/"inf" strings parse too
    runs = pd.DataFrame(rows, columns=list(RUN_COLUMNS))
    runs["setup"] = setup_labels(runs)
    return runs, pd.DataFrame(curves, columns=["run", "step", "metric", "value"])


# Settings that make a run a different setup of its optimizer (a panel or a line of its own in the figures).
SETUP_KEYS = ("model", "finetune", "eps", "clip", "precision", "bf16_matmul")


def setup_labels(runs: pd.DataFrame) -> pd.Series:
    """The optimizer's name, plus each of SETUP_KEYS that takes several values among that optimizer's runs,
    e.g. "adamw eps=1e-15" or "sgd finetune=lora clip=1"."""
    labels = runs.optimizer.astype(str).copy()
    for _, group in runs.groupby("optimizer", sort=False):
        for key in SETUP_KEYS:
            if group[key].map(_short).nunique() > 1:
                labels[group.index] += " " + key + "=" + group[key].map(_short)
    return labels


def _short(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "off"
    return short_number(value) if isinstance(value, float) else str(value)




def curve(curves: pd.DataFrame, run: str, metric: str) -> pd.Series:
    """One run's metric as a Series indexed by step."""
    rows = curves[(curves.run == run) & (curves.metric == metric)]
    return pd.Series(rows.value.to_numpy(), index=rows.step.to_numpy(), name=run)
