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
import time
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
        self.composed: dict[tuple[str, ...], Any] = {}  # launched overrides -> the config _checked_jobs composed

    def setup(self, *, hydra_context, task_function, config) -> None:
        """The basic launcher (one job after another, in this process) gets each job's config as _checked_jobs
        composed it rather than composing it again (composing is a large share of a smoke job's time)."""
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher
        from hydra.types import HydraContext

        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        if type(self.launcher) is BasicLauncher:
            self.launcher.hydra_context = HydraContext(
                config_loader=ComposedOnce(hydra_context.config_loader, self.composed),
                callbacks=hydra_context.callbacks)

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
        launched = self.launched(self.jobs(overrides))
        size = max_batch_size or len(launched)
        return [launched[i:i + size] for i in range(0, len(launched), size)]

    def launched(self, grid: list[list[str]]) -> list[list[str]]:
        """Each job's overrides as the launcher gets them: its own, the W&B group, the hydra overrides that name
        its folder (self.folders: the jobs that have one already keep it)."""
        from gradscale.checks import override_key
        from gradscale.sweep import folder_name_overrides, hydra_quoted, is_finished, wandb_group

        exclude_keys = list(self.config.hydra.job.config.override_dirname.exclude_keys)
        naming = folder_name_overrides(grid, exclude_keys, self.folders)
        group = "wandb.group=" + hydra_quoted(wandb_group(self.task, dict(self.params or {}), self.preset,
                                                          self.sweep_dir, exclude_keys))
        launched = []
        for job, names in zip(grid, naming):
            grouped = [] if any(override_key(o) == "wandb.group" for o in job) else [group]
            folder = self.folders.get(tuple(job))
            # a finished job is skipped, and Hydra must not rewrite its .hydra/ (the provenance of its results)
            skipped = ["hydra.output_subdir=null"] if folder is not None and is_finished(folder) else []
            launched.append([*job, *grouped, *names, *skipped])
        return launched

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
        log.info("sweep of %d jobs -> %s", len(jobs), self.sweep_dir)
        return self._launch(arguments)

    def _checked_jobs(self, arguments: list[str]) -> list[list[str]]:
        """Every job's overrides, each composed and range-checked; the sweep folder writable, and holding
        nothing but this sweep's runs (a re-run resumes it: finished jobs skipped, killed ones resumed)."""
        from gradscale.checks import ConfigError, check_writable
        from gradscale.config import validate
        from gradscale.probes import check_environment
        from gradscale.runs import job_dirs
        from gradscale.sweep import check_same_sweep

        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        jobs = self.jobs(overrides)
        sweep_dir = self.sweep_dir
        # a new sweep's jobs are composed as the launcher will ask for them, so that it need not compose them again;
        # a re-run's folder names wait for check_same_sweep, which needs the configs first
        new = not sweep_dir.is_dir() or not job_dirs(sweep_dir)
        composing = self.launched(jobs) if new else [list(job) for job in jobs]
        configs = {}
        for job, job_overrides in zip(jobs, composing):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, job_overrides)
            try:
                validate(job_cfg)
                check_environment(job_cfg)
            except ConfigError as e:
                raise ConfigError(f"{e} (job: {' '.join(job)})") from None
            configs[tuple(job)] = job_cfg

        check_writable("hydra.sweep.dir", sweep_dir)
        self.folders = settled(lambda: check_same_sweep(sweep_dir, configs))
        if new:
            self.composed.update({tuple(o): configs[tuple(job)] for job, o in zip(jobs, composing)})
        return jobs

    def validate_batch_is_legal(self, batch) -> None:
        """Hydra composes every job once more here only to see that it composes: _checked_jobs has composed
        and range-checked them all before any ran (a third of a smoke preset's time went to this)."""

    def _launch(self, arguments: list[str]) -> Any:
        from gradscale.sweep import format_sweep_table, sweep_runs

        sweep_dir = self.sweep_dir
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


def settled(check, wait_s: float = 30.0):
    """check(), which reads the sweep folder. On a torchrun rank other than 0 a refusal is tried again for up to
    wait_s: rank 0 may have started a job by then, and a job folder whose .hydra/ Hydra has not written yet reads as
    another sweep's. Rank 0 refuses at once (torchrun then stops every rank)."""
    from gradscale.checks import ConfigError

    deadline = time.monotonic() + (wait_s if os.environ.get("RANK", "0") != "0" else 0.0)
    while True:
        try:
            return check()
        except ConfigError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


class ComposedOnce:
    """A config loader that hands out a job's config composed already (the sweeper's, by the exact overrides the
    launcher asks for; each once, as the launcher then sets the job's number in it), and composes any other."""

    def __init__(self, loader, composed: dict[tuple[str, ...], Any]) -> None:
        self.loader = loader
        self.composed = composed

    def load_sweep_config(self, master_config, sweep_overrides: list[str]):
        config = self.composed.pop(tuple(sweep_overrides), None)
        return config if config is not None else self.loader.load_sweep_config(master_config, sweep_overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
