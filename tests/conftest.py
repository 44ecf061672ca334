"""Shared fixtures: a tiny, fast config; in-process composition and runs; the CLI as a subprocess.

No network anywhere: W&B disabled unless a test turns it offline, hub access off, the tokenizer
cache in a per-session temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradscale.hydra_glue import (
    CONF_DIR,
    compose,  # noqa: F401  (tests import compose from here
)

ROOT = Path(__file__).resolve().parent.parent
CONF = Path(CONF_DIR)

OFFLINE_ENV = {
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
os.environ.update(OFFLINE_ENV)
# make test runs the suite on two pytest-xdist workers: each keeps to one thread, and so does every process it
# starts (a test that needs more sets its own), since two processes spinning two OpenMP threads each on two
# cores run several times slower than one thread each
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# small enough for a run to take well under a second after start-up
TINY = [
    "model.init=random",  # the pretrained base has tests of its own (test_weights.py)
    "steps=4", "batch_size=8", "seq_len=64", "log_every=1", "eval_every=2", "eval_batches=1", "wandb.mode=disabled",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gradscale-cache")
    os.environ["GRADSCALE_CACHE"] = str(path)
    return path


def run_in_process(run_dir: Path, overrides: list[str]) -> tuple[dict, list[dict]]:
    """Build, check and train as `gradscale.run` does (gradscale.run.run_job); returns (result, metrics)."""
    from gradscale.hydra_glue import to_object
    from gradscale.metrics import RunLog
    from gradscale.run import run_job

    run_cfg = to_object(compose([*TINY, *overrides]))
    run_dir.mkdir(parents=True, exist_ok=True)
    run_log = RunLog(run_dir, run_cfg.wandb, name="test", group=None, tags=[], config={})
    result = run_job(run_cfg, run_log, overrides)
    run_log.finish(result)
    return result, read_metrics(run_dir)


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "train/loss" in r]


@pytest.fixture
def cli(cache_dir):
    """Run the user's command, `python -m experiments.run ARGS`, in the clone; returns the CompletedProcess."""

    def _run(args: list[str], timeout: float = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "",
               **(extra_env or {})}
        env.pop("HYDRA_FULL_ERROR")
        return subprocess.run(
            [sys.executable, "-m", "experiments.run", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )

    return _run


# the modules whose fixtures take minutes, dealt to the two workers first so that neither is left alone at the end
LONGEST_MODULES = ("test_studies.py", "test_audit.py", "test_device_check.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    """The longest modules first (the order is otherwise the files'); tests marked `gpu` run only where CUDA is."""
    import torch

    items.sort(key=lambda item: LONGEST_MODULES.index(item.path.name) if item.path.name in LONGEST_MODULES
               else len(LONGEST_MODULES))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
