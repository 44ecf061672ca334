"""Hydra's basic sweeper with three additions for gradscale sweeps:

1. every job's config is composed and range-checked before the first job starts, so a bad value
   anywhere in the sweep costs nothing;
2. a job that fails is recorded (its summary.json says failed) and the other jobs still run;
3. the sweep ends with a table of its runs, and exits non-zero if any failed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException

from experiments.config import ConfigError, validate
from experiments.sweep import format_sweep_table, sweep_runs

log = logging.getLogger(__name__)


class SweepFailed(CompactHydraException):
    pass


class GradscaleSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        jobs = [job for batch in self.split_arguments(overrides, None) for job in batch]
        for job in jobs:
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            try:
                validate(job_cfg)
            except ConfigError as e:
                raise ConfigError(f"{e} (job: {' '.join(job)})") from None

        sweep_dir = Path(self.config.hydra.sweep.dir)
        log.info("sweep of %d jobs -> %s", len(jobs), sweep_dir)
        try:
            returns = super().sweep(arguments)
        except Exception:  # a failed job: the basic launcher ran every job of the batch first
            returns = None
        if os.environ.get("RANK", "0") != "0":
            # other torchrun ranks judge by their own jobs: rank 0 may still be writing the last summary
            if returns is None:
                raise SweepFailed("error: a job of this sweep failed on this rank; see its run.rankN.log")
            return returns
        rows = sweep_runs(sweep_dir)
        print(f"\nsweep {sweep_dir}: {len(rows)} runs\n{format_sweep_table(rows)}", flush=True)
        failed = [r for r in rows if r["status"] not in ("completed", "diverged")]
        if returns is None or failed:
            raise SweepFailed(f"error: {len(failed)} of {len(rows)} runs did not complete; see {sweep_dir}/*/run.log")
        return returns
