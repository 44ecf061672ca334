"""Metric sinks: metrics.jsonl and summary.json (always), W&B (offline by default; off with wandb.mode=disabled
or WANDB_MODE=disabled in the environment).

Local files are the source of truth; analysis reads only them. W&B never stops training: if it
cannot start or fails mid-run, one warning is logged and the local files carry on.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from gradscale.checks import installed

log = logging.getLogger(__name__)


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file and rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def _json_number(value: float) -> float | str:
    # JSON has no NaN/Inf; strings keep a diverged value readable by json.loads everywhere
    return value if math.isfinite(value) else str(value)


def wandb_disabled_by_env() -> bool:
    """WANDB_MODE=disabled in the environment switches W&B off whatever wandb.mode says: wandb.init's own
    mode= argument would win over the variable, and wandb-core would still start."""
    return os.environ.get("WANDB_MODE", "").strip().lower() == "disabled"


class RunLog:
    def __init__(self, run_dir: Path, wandb_cfg, *, name: str, group: str | None, tags: list[str], config: dict):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self._metrics = open(self.metrics_path, "a", buffering=1)  # line-buffered: one flush per record
        self._adam_stats = None  # adam_stats.jsonl, opened on first use
        self._wandb, self._wandb_failed = None, False
        if wandb_cfg.mode != "disabled":
            if wandb_disabled_by_env():
                log.info("W&B off: WANDB_MODE=disabled in the environment (wandb.mode=%s)", wandb_cfg.mode)
            elif not installed("wandb"):
                log.info("W&B off: wandb is not installed (pip install 'gradscale[wandb]'); local files only")
            else:
                self._wandb = self._start_wandb(wandb_cfg, name=name, group=group, tags=tags, config=config)

    def _start_wandb(self, wandb_cfg, **run_info):
        """Online falls back to offline (no key, no network); if W&B cannot start at all, local files only."""
        modes = [wandb_cfg.mode, "offline"] if wandb_cfg.mode == "online" else [wandb_cfg.mode]
        for mode in modes:
            try:
                import wandb  # inside the try: not even a broken install stops training

                run = wandb.init(
                    project=wandb_cfg.project,
                    mode=mode,
                    dir=str(self.run_dir),
                    job_type="train",
                    reinit="finish_previous",  # one W&B run per sweep job, never merged
                    settings=wandb.Settings(init_timeout=15 if mode == "online" else 60, console="off", silent=True),
                    **run_info,
                )
                run.define_metric("step")
                run.define_metric("*", step_metric="step")
                return run
            except Exception as e:  # W&B never stops training
                then = "falling back to offline" if mode == "online" else "continuing with local files only"
                log.warning("W&B (%s) could not start (%s: %s); %s", mode, type(e).__name__, e, then)
        return None

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _json_number(v) if isinstance(v, float) else v for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        if self._wandb is not None and not self._wandb_failed:
            try:
                self._wandb.log(record)
            except Exception as e:
                log.warning("W&B log failed (%s: %s); W&B is off for the rest of this run", type(e).__name__, e)
                self._wandb_failed = True

    def rewind(self, next_step: int) -> None:
        """Resuming from a checkpoint at next_step: keep only the records of earlier steps (and no torn
        last line), each file rewritten atomically, so the resumed run neither repeats nor skips a step."""
        for name in ("metrics.jsonl", "adam_stats.jsonl"):
            path = self.run_dir / name
            if not path.exists():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < next_step:
                        kept.append(line + "\n")
                except (ValueError, KeyError):  # a line torn by the kill
                    continue
            write_text_atomic(path, "".join(kept))
        self._metrics.close()
        self._metrics = open(self.metrics_path, "a", buffering=1)

    def log_adam_stats(self, records: list[dict[str, Any]]) -> None:
        """Per-tensor sqrt(v_hat) quantiles (adam_stats_every), next to metrics.jsonl."""
        if self._adam_stats is None:
            self._adam_stats = open(self.run_dir / "adam_stats.jsonl", "a", buffering=1)
        self._adam_stats.write("".join(json.dumps(r) + "\n" for r in records))

    def finish(self, summary: dict[str, Any]) -> None:
        """summary.json is written once, at the end, atomically; W&B's finish() always runs."""
        self._metrics.close()
        if self._adam_stats is not None:
            self._adam_stats.close()
        write_json_atomic(self.run_dir / "summary.json", summary)
        if self._wandb is None:
            return
        try:
            try:
                for key, value in summary.items():
                    if isinstance(value, (int, float, str, bool)) or value is None:
                        self._wandb.summary[key] = value
            finally:
                self._wandb.finish(exit_code=0 if summary.get("status") != "failed" else 1)
        except Exception as e:  # the local summary is already written
            log.warning("W&B summary or finish failed (%s: %s)", type(e).__name__, e)
