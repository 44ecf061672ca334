"""On a CUDA device (skipped without one): the default sweep in fp32 and bf16, and NCCL under torchrun
with DDP and FSDP2, which exercises every collective of the loop on the GPU."""

from __future__ import annotations

import json

import pytest

from gradscale.runs import job_dirs
from tests.conftest import TINY, read_metrics, train_records
from tests.test_parallel import torchrun

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_sweep_on_cuda(cli, tmp_path, precision):
    proc = cli(["-m", "optimizer=sgd,adamw", "scale=1,8", *TINY, "device=cuda", f"precision={precision}",
                f"hydra.sweep.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    for job_dir in job_dirs(tmp_path):
        summary = json.loads((job_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["device"].startswith("cuda"), summary


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_nccl_torchrun_matches_the_emulated_run(cli, tmp_path, cache_dir, strategy):
    """One process under torchrun: a real NCCL group, with every collective and the checkpoint gather."""
    args = ["optimizer=adamw", *TINY, "steps=5", "world_size=1", "checkpoint_every=2", "device=cuda"]
    real = torchrun(["-m", "gradscale.run", f"dist.strategy={strategy}", *args,
                     f"hydra.run.dir={tmp_path / 'real'}"], cache_dir, nproc=1)
    assert real.returncode == 0, real.stderr[-4000:]
    summary = json.loads((tmp_path / "real" / "summary.json").read_text())
    assert summary["ranks"] == strategy and summary["status"] == "completed", summary
    emulated = cli([*args, f"hydra.run.dir={tmp_path / 'emulated'}"])
    assert emulated.returncode == 0, emulated.stderr[-4000:]
    losses = [[r["train/loss"] for r in train_records(read_metrics(tmp_path / d))] for d in ("real", "emulated")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
