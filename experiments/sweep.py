"""Sweep-level pieces: the pre-run config check and the end-of-sweep table of runs.

The sweeper plugin itself must live in the `hydra_plugins` package (a Hydra rule); it is
`hydra_plugins/gradscale_sweeper/sweeper.py` and calls what is here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.config import validate


class ValidateBeforeRun(Callback):
    """Single runs: range-check the config before Hydra creates the run folder."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        validate(config)


def sweep_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder in the sweep: its overrides and what its summary.json says."""
    rows = []
    job_dirs = [d for d in Path(sweep_dir).iterdir() if (d / ".hydra").is_dir()]
    for job_dir in sorted(job_dirs, key=lambda d: (int(d.name.split("_")[0]) if d.name.split("_")[0].isdigit() else 1 << 30, d.name)):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
        summary_file = job_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {"status": "interrupted"}
        rows.append({**summary, "dir": job_dir.name, "overrides": " ".join(overrides)})
    return rows


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("overrides", "status", "final loss", "best eval", "steps", "wall s")
    lines = [
        (r["overrides"] or "(defaults)", r["status"], fmt(r.get("final_loss"), ".4f"),
         fmt(r.get("best_eval_loss"), ".4f"), fmt(r.get("steps_done"), "d"), fmt(r.get("wall_s"), ".1f"))
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    render = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *lines)]
    return "\n".join([render[0], "  ".join("-" * w for w in widths), *render[1:]])
