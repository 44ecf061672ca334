"""Re-running is always safe: a killed run resumes from its checkpoint to the same metrics, a re-run sweep
skips finished jobs and resumes killed ones, and a folder of another sweep is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradscale.runs import job_dirs
from tests.conftest import OFFLINE_ENV, ROOT, TINY, read_metrics

LONG = [*TINY, "steps=150", "checkpoint_every=20"]


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def start(args: list[str], cache_dir) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    return subprocess.Popen([sys.executable, "-m", "gradscale.run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_when(proc: subprocess.Popen, metrics: Path, records: int, timeout: float = 120) -> None:
    """SIGKILL the process once `metrics` holds at least this many records (no chance to clean up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= records:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended (rc={proc.poll()}) before {metrics} held {records} records")


@pytest.mark.slow
def test_killed_run_resumes_to_the_metrics_of_an_uninterrupted_run(cli, tmp_path, cache_dir):
    whole = tmp_path / "whole"
    assert cli([*LONG, f"hydra.run.dir={whole}"]).returncode == 0
    killed = tmp_path / "killed"
    args = [*LONG, f"hydra.run.dir={killed}"]
    kill_when(start(args, cache_dir), killed / "metrics.jsonl", records=70)  # train and eval records: past step 40
    assert not (killed / "summary.json").exists() and (killed / "checkpoint.pt").exists()
    proc = cli(args)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from_step"] >= 20
    assert without_timings(read_metrics(killed)) == without_timings(read_metrics(whole))  # no step twice or missing
    assert (killed / "adam_stats.jsonl").read_text() == (whole / "adam_stats.jsonl").read_text()
    assert not (killed / "checkpoint.pt").exists()  # removed once the run ended


@pytest.mark.slow
def test_rerun_sweep_resumes_the_killed_job_and_leaves_the_diverged_one(cli, tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    args = ["-m", "optimizer=sgd", "optimizer.lr=0.05", "scale=1e30,1", "fix=true", *LONG, f"hydra.sweep.dir={sweep}"]
    proc = start(args, cache_dir)
    kill_when(proc, next_metrics(sweep, 1, proc), records=50)  # job 0 diverged; job 1 is killed mid-way
    diverged = job_dirs(sweep)[0]
    summary_before = (diverged / "summary.json").read_text()
    assert json.loads(summary_before)["status"] == "diverged"
    rerun = cli(args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (diverged / "summary.json").read_text() == summary_before  # left alone
    assert "already diverged, skipped" in (diverged / "run.log").read_text()
    resumed = json.loads((job_dirs(sweep)[1] / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["resumed_from_step"] >= 20
    steps = [r["step"] for r in read_metrics(job_dirs(sweep)[1]) if "train/loss" in r]
    assert steps == list(range(150))
    from gradscale.analysis.report import main

    assert main([str(sweep)]) == 0
    report = (sweep / "report" / "report.md").read_text()
    assert "| diverged |" in report and "| completed |" in report


def next_metrics(sweep: Path, job: int, proc: subprocess.Popen, timeout: float = 120) -> Path:
    """metrics.jsonl of the sweep's job number `job`, once its folder exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        dirs = [d for d in job_dirs(sweep) if d.name.startswith(f"{job}_")] if sweep.exists() else []
        if dirs:
            return dirs[0] / "metrics.jsonl"
        time.sleep(0.01)
    raise AssertionError(f"job {job} of {sweep} never started")


def test_a_folder_of_another_sweep_is_refused_untouched(cli, tmp_path):
    sweep = tmp_path / "sweep"
    assert cli(["-m", "scale=1,2", "fix=true", *TINY, "steps=1", f"hydra.sweep.dir={sweep}"]).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in sweep.rglob("*")}
    proc = cli(["-m", "scale=1,4", "fix=true", *TINY, "steps=1", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: hydra.sweep.dir={str(sweep)!r} holds runs of another sweep ({job_dirs(sweep)[1].name}); "
        "re-run its own command, or choose a new hydra.sweep.dir"]
    assert {p: p.stat().st_mtime_ns for p in sweep.rglob("*")} == before
    # the same sweep again is fine: both jobs are skipped, their provenance untouched
    provenance = hydra_files(sweep)
    again = cli(["-m", "scale=1,2", "fix=true", *TINY, "steps=1", f"hydra.sweep.dir={sweep}", "wandb.mode=offline"])
    assert again.returncode == 0 and "skipped" in (job_dirs(sweep)[0] / "run.log").read_text()
    assert hydra_files(sweep) == provenance


def hydra_files(folder: Path) -> dict[Path, bytes]:
    """Every file under the .hydra/ folders below `folder`, with its bytes."""
    return {p: p.read_bytes() for p in sorted(folder.rglob(".hydra/*"))}


def test_single_run_into_a_folder_of_another_config_is_refused_untouched(cli, tmp_path):
    run_dir = tmp_path / "run"
    assert cli([*TINY, "steps=1", "optimizer.lr=0.01", f"hydra.run.dir={run_dir}"]).returncode == 0
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    proc = cli([*TINY, "steps=1", "optimizer.lr=0.02", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={str(run_dir)!r}: ran with optimizer.lr=0.01, this run has optimizer.lr=0.02; "
        "choose a new hydra.run.dir"]
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_skipped_single_run_leaves_its_provenance_byte_identical(cli, tmp_path):
    run_dir = tmp_path / "run"
    assert cli([*TINY, "steps=1", f"hydra.run.dir={run_dir}"]).returncode == 0
    provenance, summary = hydra_files(run_dir), (run_dir / "summary.json").read_bytes()
    # the same config by other words (wandb changes no result): skipped, nothing rewritten
    again = cli([*TINY, "steps=1", "wandb.mode=offline", f"hydra.run.dir={run_dir}"])
    assert again.returncode == 0 and "already completed, skipped" in (run_dir / "run.log").read_text()
    assert hydra_files(run_dir) == provenance and (run_dir / "summary.json").read_bytes() == summary


def test_rewind_drops_later_records_and_a_torn_line(tmp_path):
    from gradscale.config import WandbConfig
    from gradscale.metrics import RunLog

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n"
                                                    for s in range(5)) + '{"step": 5, "train/lo')
    run_log = RunLog(tmp_path, WandbConfig(mode="disabled"), name="t", group=None, tags=[], config={})
    run_log.rewind(3)
    run_log.log({"step": 3, "train/loss": 2.0})
    run_log.finish({"status": "completed"})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_a_checkpoint_holding_a_pickled_object_is_refused_in_one_line_and_runs_nothing(tmp_path):
    """Resuming loads with weights_only: a file dropped into a shared run folder cannot run code."""
    import torch

    from gradscale.checkpoint import CheckpointError, read

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": {}, "loop": {"next_step": 3}, "payload": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError) as refused:
        read(tmp_path / "checkpoint.pt")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"error: {tmp_path / 'checkpoint.pt'}: refused")
    assert "GLOBAL posix.system" in message and "remove it to start this run afresh" in message
    assert not marker.exists()


def test_a_refused_run_ends_its_log_with_the_reason(tmp_path, monkeypatch, caplog):
    """The last line a failed run logs says why (it once said "failed: None" after the refusal)."""
    import logging

    from omegaconf import OmegaConf

    from gradscale import run
    from gradscale.checkpoint import CheckpointError
    from gradscale.hydra_glue import compose

    def refuse(*args, **kwargs):
        raise CheckpointError(f"error: {tmp_path / 'checkpoint.pt'}: refused (it holds GLOBAL posix.system)")

    monkeypatch.setattr(run, "run_job", refuse)
    hydra_cfg = OmegaConf.create({"runtime": {"output_dir": str(tmp_path)}, "overrides": {"task": []},
                                  "mode": {"name": "MULTIRUN"}, "sweep": {"dir": str(tmp_path)},
                                  "job": {"override_dirname": "seed=0"}})
    with caplog.at_level(logging.INFO, logger="gradscale"), pytest.raises(run.RunFailed):
        run.run_folder_job(compose([*TINY, "wandb.mode=disabled"]), hydra_cfg, is_main=True)
    last = caplog.records[-1].getMessage()
    assert last.startswith(f"failed: CheckpointError: error: {tmp_path / 'checkpoint.pt'}: refused"), last
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_a_torchrun_rank_waits_for_the_job_folder_rank_0_is_writing(tmp_path, monkeypatch):
    """Hydra makes a job's folder before its .hydra/, and a folder without .hydra/overrides.yaml reads as another
    sweep's: a rank other than 0, checking the folder while rank 0 starts the first job, tries again until
    rank 0 has written it; rank 0 refuses at once."""
    import threading

    from gradscale.checks import ConfigError
    from hydra_plugins.gradscale_sweeper.sweeper import settled

    overrides = tmp_path / "0_scale=1" / ".hydra" / "overrides.yaml"

    def check():
        if not overrides.exists():
            raise ConfigError("error: holds runs of another sweep (0_scale=1)")
        return {("scale=1",): overrides.parent.parent}

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError):
        settled(check)
    monkeypatch.setenv("RANK", "1")
    writer = threading.Timer(1.0, lambda: (overrides.parent.mkdir(parents=True), overrides.write_text("- scale=1\n")))
    writer.start()
    assert settled(check) == {("scale=1",): tmp_path / "0_scale=1"}
    writer.join()
    overrides.unlink()
    with pytest.raises(ConfigError):  # a folder that never settles is refused after the wait
        settled(check, wait_s=1.0)
