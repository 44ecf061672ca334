"""Sweep-level pieces: the pre-run config check and the end-of-sweep table of runs.

The sweeper plugin itself must live in the `hydra_plugins` package (a Hydra rule); it is
`hydra_plugins/gradscale_sweeper/sweeper.py` and calls what is here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from experiments.checks import ConfigError, check_writable, override_key
from experiments.config import validate
from experiments.probes import check_environment


class ValidateBeforeRun(Callback):
    """Single runs: range-check the config, what it needs from this machine, and the output folder, before
    Hydra creates the run folder.

    Hydra turns exceptions raised in callbacks into warnings, so a bad value exits here directly.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = Path(config.hydra.run.dir)
        is_rank_0 = int(os.environ.get("RANK", "0")) == 0
        try:
            validate(config)
            check_environment(config)
            check_writable("hydra.run.dir", run_dir)
            # Under torchrun rank 0 alone checks and writes the provenance: another rank could read the
            # config.yaml rank 0 is writing at that moment.
            if is_rank_0 and (run_dir / ".hydra" / "config.yaml").exists():
                check_same_config(run_dir, config, "hydra.run.dir", run_dir, "this run")
        except ConfigError as e:
            print(e, file=sys.stderr, flush=True)
            sys.exit(2)
        if not is_rank_0 or is_finished(run_dir):  # a skipped run's provenance stays as it ran
            with open_dict(config.hydra):
                config.hydra.output_subdir = None


# Keys that change nothing a run computes: a re-run sweep may set them differently.
NON_RESULT_KEYS = ("wandb",)
# Keys added after a study's first runs, left out of the comparison with the runs that lack them.
ADDED_SINCE = ("bf16_matmul",)


def check_same_sweep(sweep_dir: Path, jobs: dict[tuple[str, ...], DictConfig]) -> dict[tuple[str, ...], Path]:
    """Re-running into an existing sweep folder resumes it; refuse when the folder holds runs of another
    sweep (overrides no job of this one has) or of another config (a key's value changed since).

    Returns the folder each job (its overrides) already has: the job runs there again, or is skipped when its
    run there is finished (is_finished)."""
    if not Path(sweep_dir).is_dir():
        return {}

    def result_overrides(overrides) -> tuple[str, ...]:
        return tuple(o for o in overrides if override_key(o).split(".")[0] not in NON_RESULT_KEYS)

    wanted = {result_overrides(job): job for job in jobs}
    folders: dict[tuple[str, ...], Path] = {}
    for job_dir in job_dirs(sweep_dir):
        done = result_overrides(job_overrides(job_dir))
        if done not in wanted:
            raise ConfigError(f"error: hydra.sweep.dir={str(sweep_dir)!r} holds runs of another sweep "
                              f"({job_dir.name}); re-run its own command, or choose a new hydra.sweep.dir")
        check_same_config(job_dir, jobs[wanted[done]], "hydra.sweep.dir", sweep_dir, "this sweep")
        folders.setdefault(wanted[done], job_dir)
    return folders


def folder_name_overrides(jobs: list[list[str]], exclude_keys: list[str],
                          existing: dict[tuple[str, ...], Path]) -> list[list[str]]:
    """Per job (in job order), the hydra overrides that name its folder.

    A folder is `N_OVERRIDES` (conf/config.yaml) with only the overrides that tell the sweep's jobs apart:
    those every job shares (`experiment=...`, `smoke=on`) join exclude_keys. A job whose overrides are all
    left out is just `N`; a sweep of one job keeps all of its overrides. A job that already has a folder
    (a re-run, also of a sweep named before this rule) keeps that folder, so it is resumed or skipped."""
    parser = OverridesParser.create()

    def by_key(job: list[str]) -> dict[str, list[str]]:
        lines: dict[str, list[str]] = {}
        for override in parser.parse_overrides(job):
            if not override.is_hydra_override():
                lines.setdefault(override.key_or_group, []).append(str(override.input_line))
        return lines

    keyed = [by_key(job) for job in jobs]
    shared = {key for key, lines in keyed[0].items() if all(k.get(key) == lines for k in keyed[1:])} \
        if len(jobs) > 1 else set()
    excluded = [*exclude_keys, *sorted(shared - set(exclude_keys))]
    naming = [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(map(hydra_quoted, excluded))}]"] \
        if shared else []
    result = []
    for num, (job, keys) in enumerate(zip(jobs, keyed)):  # launchers number jobs in this order
        folder = existing.get(tuple(job))
        if folder is not None:
            subdir = [f"hydra.sweep.subdir={hydra_quoted(folder.name)}"]
        elif all(key in excluded for key in keys):
            subdir = [f"hydra.sweep.subdir={num}"]  # not `N_`: nothing else names it
        else:
            subdir = []
        result.append([*naming, *subdir])
    return result


def hydra_quoted(text: str) -> str:
    """text as a quoted Hydra override value that reads back as exactly text: quotes (and backslashes before
    them) escaped, `${` kept literal rather than an interpolation."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)  # backslashes before the closing quote
    return "'" + body.replace("${", "\\${") + "'"


def check_same_config(job_dir: Path, cfg: DictConfig, key: str, folder: Path, this: str) -> None:
    """The run in job_dir ran with cfg's values (NON_RESULT_KEYS aside), or a one-line ConfigError."""
    before = _result_config(OmegaConf.load(job_dir / ".hydra" / "config.yaml"))
    now = _result_config(cfg)
    for added in ADDED_SINCE:  # a run from before the key was added could not set it
        if added not in before:
            now.pop(added, None)
    if before != now:
        changed = next(k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k))
        ran = f"{job_dir.name} ran" if job_dir != folder else "ran"
        raise ConfigError(f"error: {key}={str(folder)!r}: {ran} with {changed}={before.get(changed)!r}, "
                          f"{this} has {changed}={now.get(changed)!r}; choose a new {key}")


def is_finished(run_dir: Path) -> bool:
    """The folder holds a completed or diverged run: a re-run skips it."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") in ("completed", "diverged")
    except (OSError, ValueError):
        return False


def _result_config(cfg: DictConfig) -> dict[str, Any]:
    """The job config without the hydra node and NON_RESULT_KEYS, flattened to dotted keys."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    flat: dict[str, Any] = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            if prefix == "" and k in ("hydra", *NON_RESULT_KEYS):
                continue
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v
    walk(tree)
    return flat


def job_overrides(job_dir: Path) -> list[str]:
    """The job's command-line overrides, as Hydra saved them ([] when it has none saved)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    return list(OmegaConf.to_container(OmegaConf.load(overrides_file))) if overrides_file.exists() else []


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders of a sweep in job order (their names start with Hydra's job number)."""

    def job_number(d: Path) -> tuple[int, str]:
        head = d.name.split("_")[0]
        return (int(head) if head.isdigit() else 1 << 30, d.name)

    return sorted((d for d in Path(sweep_dir).iterdir() if (d / ".hydra").is_dir()), key=job_number)


def wandb_group(task: list[str], params: dict[str, Any], preset: str | None, sweep_dir: Path,
                exclude_keys: list[str]) -> str:
    """The W&B group of a sweep's runs (wandb.group unless set): what the sweep runs, i.e. its command's overrides
    (paths and W&B keys left out) and, without a preset, the sweep the default config adds (fix on and off),
    each as key:value (W&B's run filters garble `=`); then where it writes (the folder's last two parts, by
    default DATE/TIME, so each sweep is a group of its own). At most 128 characters, W&B's limit: what gives
    way, not where."""
    shown = [o for o in task if override_key(o) not in exclude_keys and not override_key(o).startswith("wandb.")]
    if preset is None:
        keys = {override_key(o) for o in task}
        shown += [f"{key}={value}" for key, value in params.items() if key not in keys]
    where = " @ " + "/".join(Path(sweep_dir).parts[-2:])
    what = " ".join(shown).replace("=", ":") or "defaults"
    return (what[:max(0, 128 - len(where))] + where)[:128]


def sweep_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder in the sweep: its overrides (the W&B group the sweeper names aside) and what its
    summary.json says."""
    rows = []
    for job_dir in job_dirs(sweep_dir):
        overrides = [o for o in job_overrides(job_dir) if override_key(o) != "wandb.group"]
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
    return render_table(header, lines)


def render_table(header: tuple[str, ...], lines: list[tuple]) -> str:
    """Plain-text table: left-aligned columns, a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    render = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *lines)]
    return "\n".join([render[0], "  ".join("-" * w for w in widths), *render[1:]])
