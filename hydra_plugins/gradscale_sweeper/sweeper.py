"""Hydra's basic sweeper with these additions for gradscale sweeps:

1. `hydra.sweeper.include`: jobs beyond the grid, each a list of overrides on top of the sweep's fixed
   (not swept) overrides, e.g. a control run at another lr (gradscale/conf/experiment/world_size_fix.yaml);
2. every job's config is composed and range-checked, and what it needs from the machine checked, before
   the first job starts, so a bad value anywhere in the sweep costs nothing;
3. a job that fails is recorded (its summary.json says failed) and the other jobs still run;
4. the sweep ends with a table of its runs, and exits non-zero if any failed;
5. job folders are named by the overrides that tell the jobs apart (not `experiment=...`, `smoke=on`, which
   every job shares), and a re-run keeps each job's existing folder (gradscale.sweep.folder_name_overrides);
6. the jobs log to a W&B group named by what the sweep runs and where (gradscale.sweep.wandb_group), unless
   the command sets wandb.group.

Hydra imports every module under hydra_plugins/ when any Hydra app starts, so this one imports nothing of
gradscale at module level: only a sweep that selects this sweeper does.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import CompactHydraException

log = logging.getLogger(__name__)


class SweepFailed(CompactHydraException):
    pass


class GradscaleSweeper(BasicSweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 include: list[list[str]] | None = None) -> None:
        super().__init__(max_batch_size, params)
        self.include = [[str(o) for o in job] for job in include or []]
        self.folders: dict[tuple[str, ...], Path] = {}  # jobs that have a folder in the sweep already
        self.task: list[str] = []
        self.preset: str | None = None
        self.sweep_dir = Path()

    def jobs(self, overrides: list[Override]) -> list[list[str]]:
        """Every job's own overrides: the grid (as the basic sweeper builds it), then one per `include` entry."""
        from gradscale.checks import override_key

        grid = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        fixed = [f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in overrides
                 if not o.is_sweep_override()]
        for entry in self.include:
            keys = {override_key(o) for o in entry}
            grid.append([o for o in fixed if override_key(o) not in keys] + entry)
        return grid

    def split_arguments(self, overrides: list[Override], max_batch_size: int | None) -> list[list[list[str]]]:
        """The jobs, each with the hydra overrides that name its folder, in batches."""
        from gradscale.sweep import folder_name_overrides, hydra_quoted, is_finished, wandb_group

        grid = self.jobs(overrides)
        exclude_keys = list(self.config.hydra.job.config.override_dirname.exclude_keys)
        naming = folder_name_overrides(grid, exclude_keys, self.folders)
        group = [] if any(o.get_key_element() == "wandb.group" for o in overrides) else [
            "wandb.group=" + hydra_quoted(wandb_group(self.task, dict(self.params or {}), self.preset, self.sweep_dir,
                                                      exclude_keys))]
        launched = []
        for job, names in zip(grid, naming):
            folder = self.folders.get(tuple(job))
            # a finished job is skipped, and Hydra must not rewrite its .hydra/ (the provenance of its results)
            skipped = ["hydra.output_subdir=null"] if folder is not None and is_finished(folder) else []
            launched.append([*job, *group, *names, *skipped])
        size = max_batch_size or len(launched)
        return [launched[i:i + size] for i in range(0, len(launched), size)]

    def sweep(self, arguments: list[str]) -> Any:
        from gradscale.checks import ConfigError

        self.task = list(arguments)  # the command's own overrides: they name the sweep's W&B group
        self.preset = self.config.hydra.runtime.choices.get("experiment")
        self.sweep_dir = Path(self.config.hydra.sweep.dir)
        try:
            jobs = self._checked_jobs(arguments)
        except ConfigError as e:  # one line and exit 2, as for a single run (Hydra would add a hint line)
            print(e, file=sys.stderr, flush=True)
            sys.exit(2)
        log.info("sweep of %d jobs -> %s", len(jobs), self.config.hydra.sweep.dir)
        return self._launch(arguments)

    def _checked_jobs(self, arguments: list[str]) -> list[list[str]]:
        """Every job's overrides, each composed and range-checked; the sweep folder writable, and holding
        nothing but this sweep's runs (a re-run resumes it: finished jobs skipped, killed ones resumed)."""
        from gradscale.checks import ConfigError, check_writable
        from gradscale.config import validate
        from gradscale.probes import check_environment
        from gradscale.sweep import check_same_sweep

        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        jobs = self.jobs(overrides)
        configs = {}
        for job in jobs:
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
            try:
                validate(job_cfg)
                check_environment(job_cfg)
            except ConfigError as e:
                raise ConfigError(f"{e} (job: {' '.join(job)})") from None
            configs[tuple(job)] = job_cfg

        sweep_dir = Path(self.config.hydra.sweep.dir)
        check_writable("hydra.sweep.dir", sweep_dir)
        self.folders = check_same_sweep(sweep_dir, configs)
        return jobs

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra composes every job once more here only to see that it composes: _checked_jobs has composed
        and range-checked them all before any ran (a third of a smoke preset's time went to this)."""

    def _launch(self, arguments: list[str]) -> Any:
        from gradscale.sweep import format_sweep_table, sweep_runs

        sweep_dir = Path(self.config.hydra.sweep.dir)
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
        print(f"\nsweep {sweep_dir}: {len(rows)} runs\n{format_sweep_table(rows)}\n"
              f"figures and report.md: gradscale-report {sweep_dir}", flush=True)
        failed = [r for r in rows if r["status"] not in ("completed", "diverged")]
        if returns is None or failed:
            print(f"error: {len(failed)} of {len(rows)} runs did not complete; see {sweep_dir}/*/run.log",
                  file=sys.stderr, flush=True)
            sys.exit(1)
        return returns

