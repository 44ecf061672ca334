"""Study presets (gradscale/conf/experiment/): each composes with its own sweep, opens with its comment block, and
runs whole in its smoke form; scripts/study.sh runs one and writes its report."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from gradscale.config import validate
from gradscale.runs import job_dirs
from tests.conftest import CONF, OFFLINE_ENV, ROOT, compose, read_metrics, train_records

PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_the_issue_presets_are_all_there():
    assert set(PRESETS) >= {"world_size_fix", "scale_sweep", "eps_vs_scale", "lr_vs_scale", "clipping", "precision"}


def sweep_of(name: str) -> tuple[dict, list]:
    cfg = compose([f"experiment={name}"], with_hydra=True)
    return dict(cfg.hydra.sweeper.params or {}), list(cfg.hydra.sweeper.include or [])


def expected_jobs(name: str) -> int:
    params, include = sweep_of(name)
    return math.prod(len(str(v).split(",")) for v in params.values()) + len(include)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_documents_itself(name):
    params, _ = sweep_of(name)
    assert params, f"{name} has no hydra.sweeper.params"
    header = "".join(itertools.takewhile(lambda line: line.startswith("#"),
                                         (CONF / "experiment" / f"{name}.yaml").read_text().splitlines(True)))
    for part in ("Question:", "Scientific:", "Nuisance:", "Fixed:", "Expected", "Run: python -m experiments.run -m "
                 f"experiment={name}"):
        assert part in header, f"{name}: the opening comment block lacks {part!r}"
    # every value of every swept key composes and passes the range checks, the other keys at their first value
    # (the whole grid: the sweeper checks every job before any runs, in the smoke runs below)
    grid = {key: str(values).split(",") for key, values in params.items()}
    first = {key: f"{key}={values[0]}" for key, values in grid.items()}
    for key, values in grid.items():
        for value in values:
            validate(compose([f"experiment={name}", *{**first, key: f"{key}={value}"}.values()]), overrides=[])


def run_preset(name: str, sweep_dir, cache_dir, *extra: str, threads: int | None = None
               ) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.run(
        ["scripts/study.sh", name, "smoke=on", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**env, "STUDY_DIR": str(sweep_dir), "PYTHON": os.environ.get("PYTHON", sys.executable)},
    )


@pytest.fixture(scope="module")
def gguf_stand_in(tmp_path_factory, cache_dir) -> list[str]:
    """Presets on SmolLM2 run their smoke form on a tiny GGUF file written here (no fetch in tests)."""
    from tests.helpers.tiny_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path)
    return [f"model.gguf_file={path}", "model.gguf_package=null"]


# The jobs whose full run diverges by design (docs/findings.md, studies 2-4): SGD at a multiplier or lr past
# its stability. Only these may end "diverged" in smoke form too (3 steps: so far they all complete there).
EXPECTED_DIVERGENCE = {
    "scale_sweep": [dict(optimizer="sgd", scale=c) for c in (100, 1e3, 1e4)],
    "clipping": [dict(optimizer="sgd", clip_grad_norm=None, scale=c) for c in (30, 100, 1e4)],
    "lr_vs_scale": [dict(optimizer="sgd", finetune="full", lr=1.0, fix=True)],
}


def may_diverge(name: str, summary: dict, job_dir) -> bool:
    settings = {**summary, "clip_grad_norm": OmegaConf.load(job_dir / ".hydra" / "config.yaml").clip_grad_norm}
    return any(all(settings[k] == v for k, v in job.items()) for job in EXPECTED_DIVERGENCE.get(name, []))


def unfinished_jobs(name: str, sweep_dir) -> dict[str, tuple]:
    """{job folder: (status, steps done)} for every job that did not complete its smoke steps, less the jobs of
    EXPECTED_DIVERGENCE that diverged."""
    smoke_steps = OmegaConf.load(CONF / "smoke" / "on.yaml").steps
    unfinished = {}
    for d in job_dirs(sweep_dir):
        if not (d / "summary.json").exists():
            unfinished[d.name] = ("no summary.json", None)
            continue
        summary = json.loads((d / "summary.json").read_text())
        if (summary["status"], summary["steps_done"]) == ("completed", smoke_steps):
            continue
        if summary["status"] == "diverged" and may_diverge(name, summary, d):
            continue
        unfinished[d.name] = (summary["status"], summary["steps_done"])
    return unfinished


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, cache_dir, gguf_stand_in) -> dict[str, tuple[subprocess.CompletedProcess, object]]:
    """Every preset in its smoke form, two at a time on one thread each (the jobs are tiny: each preset is mostly
    single-threaded Python, so the two cores finish them sooner side by side), the largest grids first."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("smoke")
    extra = {name: gguf_stand_in if compose([f"experiment={name}"]).model.gguf_file is not None else []
             for name in PRESETS}  # composed here: Hydra's global state is not for threads

    def run(name):
        return name, (run_preset(name, root / name, cache_dir, *extra[name], threads=1), root / name)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, sorted(PRESETS, key=expected_jobs, reverse=True)))


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_whole_in_smoke_form_with_its_report(name, smoke_runs):
    """Every job of the grid ran and completed all its smoke steps (a job named in EXPECTED_DIVERGENCE may
    diverge instead), and the report is written."""
    proc, sweep_dir = smoke_runs[name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(job_dirs(sweep_dir)) == expected_jobs(name)
    assert unfinished_jobs(name, sweep_dir) == {}
    report = (sweep_dir / "report" / "report.md").read_text()
    assert "## Breakdown against theory" in report and (sweep_dir / "report" / "loss_curves.png").exists()


@pytest.mark.slow
def test_world_size_fix_reproduces_the_reports_three_runs(smoke_runs):
    """fix on, fix off, and fix on at lr / 8 (the `include` jobs): SGD's fix-off run is its lr / 8 run. The smoke
    runs' sweep of the preset: the command's own override, smoke=on, is one the include jobs must carry."""
    proc, sweep_dir = smoke_runs["world_size_fix"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    # include jobs carry the sweep's fixed overrides (smoke=on) under their own
    overrides = [OmegaConf.load(d / ".hydra" / "overrides.yaml") for d in job_dirs(sweep_dir)]
    assert len(overrides) == 6 and all("smoke=on" in o for o in overrides)
    runs = {}
    for d in job_dirs(sweep_dir):
        summary = json.loads((d / "summary.json").read_text())
        runs[(summary["optimizer"], summary["fix"], summary["lr"])] = train_records(read_metrics(d))
    assert set(runs) == {("sgd", True, 0.03), ("sgd", False, 0.03), ("sgd", True, 0.00375),
                         ("adamw", True, 1e-3), ("adamw", False, 1e-3), ("adamw", True, 1.25e-4)}
    for opt, lr in (("sgd", 0.03), ("adamw", 1e-3)):
        ratio = runs[(opt, False, lr)][0]["train/grad_norm"] / runs[(opt, True, lr)][0]["train/grad_norm"]
        assert ratio == pytest.approx(1 / 8, rel=1e-6)
    bug, control = runs[("sgd", False, 0.03)], runs[("sgd", True, 0.00375)]
    assert [r["train/loss"] for r in bug] == pytest.approx([r["train/loss"] for r in control], rel=1e-6)
    report = (sweep_dir / "report" / "report.md").read_text()
    assert "SGD(lr=0.03, c=0.125) == SGD(lr=3.75e-3, c=1)" in report


def test_study_script_names_the_studies_on_a_bad_name():
    proc = subprocess.run(["scripts/study.sh", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == f"error: study 'nope' is not one of: {' '.join(PRESETS)}"


def test_keep_runs_stages_only_finished_runs_with_their_adam_statistics_gzipped(tmp_path):
    import gzip

    repo = tmp_path / "repo"
    sweep = repo / "studies" / "s"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("studies/**/checkpoint*\n")
    # finished; running (a checkpoint, no summary); killed by SIGTERM (failed, its checkpoint kept to resume)
    for name, status in (("0_seed=0", "completed"), ("1_fix=false", None), ("2_seed=1", "failed")):
        run = sweep / name
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 0}\n')
        (run / "adam_stats.jsonl").write_text('{"step": 0, "eps": 1e-08}\n')
        (run / "notes.txt").write_text("not read by the analysis")
        if status:
            (run / "summary.json").write_text(json.dumps({"status": status}))
        if status != "completed":
            (run / "checkpoint.pt").write_bytes(b"weights")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    proc = subprocess.run([str(ROOT / "scripts" / "keep_runs.sh"), str(sweep)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    staged = subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--name-only"], capture_output=True,
                            text=True, check=True).stdout.split()
    assert sorted(staged) == ["studies/s/0_seed=0/adam_stats.jsonl.gz", "studies/s/0_seed=0/metrics.jsonl",
                              "studies/s/0_seed=0/summary.json", "studies/s/multirun.yaml"]
    assert gzip.decompress((sweep / "0_seed=0" / "adam_stats.jsonl.gz").read_bytes()).startswith(b'{"step": 0')
    assert (sweep / "1_fix=false" / "adam_stats.jsonl").exists()  # the unfinished runs are left as they are
    assert (sweep / "2_seed=1" / "adam_stats.jsonl").exists()
    ignored = subprocess.run([str(ROOT / "scripts" / "keep_runs.sh"), str(tmp_path)], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert ignored.returncode == 2 and "not a folder git keeps" in ignored.stderr  # outside the repository
