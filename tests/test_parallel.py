"""Real ranks (gloo, 2 processes): torchrun DDP and FSDP2 against emulation, the parity oracle, the
mutation self-test that proves the oracle can fail, and a dead rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradscale.analysis.load import read_jsonl
from gradscale.runs import job_dirs
from tests.conftest import OFFLINE_ENV, ROOT, TINY, read_metrics, train_records


def torchrun(args: list[str], cache_dir: Path, timeout: float = 240, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def runs_by_config(sweep_dir: Path) -> dict[tuple, list[dict]]:
    out = {}
    for d in job_dirs(sweep_dir):
        summary = json.loads((d / "summary.json").read_text())
        assert summary["status"] == "completed", summary
        out[(summary["ranks"], summary["optimizer"], summary["fix"])] = train_records(read_metrics(d))
    return out


@pytest.mark.distributed
def test_torchrun_ddp_and_fsdp2_match_emulation(cli, tmp_path, cache_dir):
    steps = ["steps=5", "world_size=2", "checkpoint_every=2"]  # checkpoints gather states mid-run
    real = torchrun(["-m", "gradscale.run", "-m", "optimizer=sgd,adamw", "dist.strategy=ddp,fsdp2",
                     "fix=true,false", *TINY, *steps, f"hydra.sweep.dir={tmp_path / 'real'}"], cache_dir)
    assert real.returncode == 0, real.stderr[-4000:]
    emulated = cli(["-m", "optimizer=sgd,adamw", "fix=true,false", *TINY, *steps,
                    f"hydra.sweep.dir={tmp_path / 'emulated'}"])
    assert emulated.returncode == 0, emulated.stderr[-4000:]
    runs = {**runs_by_config(tmp_path / "real"), **runs_by_config(tmp_path / "emulated")}
    assert len(runs) == 12
    for optimizer in ("sgd", "adamw"):
        for fix in (True, False):
            reference = [r["train/loss"] for r in runs[("emulated", optimizer, fix)]]
            for strategy in ("ddp", "fsdp2"):
                curve = [r["train/loss"] for r in runs[(strategy, optimizer, fix)]]
                assert curve == pytest.approx(reference, rel=1e-5), (strategy, optimizer, fix)
                for key in ("train/update_rms", "train/param_norm"):  # over all shards, as emulated
                    assert [r[key] for r in runs[(strategy, optimizer, fix)]] == pytest.approx(
                        [r[key] for r in runs[("emulated", optimizer, fix)]], rel=1e-4), (key, strategy, optimizer)
        for ranks in ("emulated", "ddp", "fsdp2"):  # the logged grad-norm ratio at step 0 is exactly N
            ratio = runs[(ranks, optimizer, True)][0]["train/grad_norm"] / runs[(ranks, optimizer, False)][0][
                "train/grad_norm"]
            assert ratio == pytest.approx(2.0, rel=1e-5), ranks
    # the sqrt(v_hat) histograms cover every shard: FSDP2's records equal emulation's
    histograms = {}
    for d in [*job_dirs(tmp_path / "real"), *job_dirs(tmp_path / "emulated")]:
        summary = json.loads((d / "summary.json").read_text())
        if summary["optimizer"] == "adamw" and summary["fix"]:
            histograms[summary["ranks"]] = [r for r in read_jsonl(d / "adam_stats.jsonl") if r["step"] == 0]
    for strategy in ("ddp", "fsdp2"):
        assert len(histograms[strategy]) == len(histograms["emulated"])
        for mine, emulated in zip(histograms[strategy], histograms["emulated"]):
            assert sum(mine["hist_count"]) + mine["hist_zeros"] == emulated["numel"] == mine["numel"], strategy
            assert sum(mine["hist_energy"]) == pytest.approx(sum(emulated["hist_energy"]), rel=1e-4), strategy
    # only rank 0 writes the run's files; rank 1 keeps its own log
    first = job_dirs(tmp_path / "real")[0]
    assert (first / "run.rank1.log").exists() and not list(first.glob("*rank1*.json*"))


@pytest.mark.distributed
def test_lora_under_torchrun_matches_emulation(cli, tmp_path, cache_dir):
    """The engines with a frozen base and peft adapters (FSDP2 shards the layers under the peft wrapper)."""
    args = ["optimizer=adamw", "finetune=lora", "fix=false", *TINY, "steps=5", "world_size=2"]
    real = torchrun(["-m", "gradscale.run", "-m", "dist.strategy=ddp,fsdp2", *args,
                     f"hydra.sweep.dir={tmp_path / 'real'}"], cache_dir)
    assert real.returncode == 0, real.stderr[-4000:]
    emulated = cli(["-m", *args, f"hydra.sweep.dir={tmp_path / 'emulated'}"])
    assert emulated.returncode == 0, emulated.stderr[-4000:]
    runs = {**runs_by_config(tmp_path / "real"), **runs_by_config(tmp_path / "emulated")}
    reference = [r["train/loss"] for r in runs[("emulated", "adamw", False)]]
    for strategy in ("ddp", "fsdp2"):
        records = runs[(strategy, "adamw", False)]
        assert [r["train/loss"] for r in records] == pytest.approx(reference, rel=1e-5), strategy
        assert [r["train/grad_norm"] for r in records] == pytest.approx(
            [r["train/grad_norm"] for r in runs[("emulated", "adamw", False)]], rel=1e-4), strategy


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_parity_oracle(strategy):
    from gradscale.parity import format_table, run_parity

    rows = run_parity(world_size=2, strategy=strategy, grad_accum=2)
    assert all(r.ok for r in rows), format_table(rows)
    by = {(r.case, r.recipe): r for r in rows}
    assert by[("ragged", "global_tokens")].rel_err < 1e-5
    assert by[("ragged", "global_tokens_no_world_fix")].norm_ratio == pytest.approx(0.5, rel=1e-6)
    assert by[("ragged", "local_mean")].cosine < 0.99
    assert by[("equal", "per_microbatch_mean")].rel_err < 1e-5
    assert by[("zero_rank", "global_tokens")].rel_err < 1e-5


# Known bugs, injected into every rank before it computes (module-level functions: picklable for spawn).
def inject_dropped_world_factor():
    from gradscale.grads import GradPipeline

    def factor(self, num_tokens, ranks_averaged=False):
        return (1.0 if ranks_averaged else 1.0 / self.world_size) / max(num_tokens, 1) * self.scale

    GradPipeline.factor = factor


def inject_local_token_count():
    from gradscale import train
    from gradscale.grads import count_trained_tokens

    train.global_token_count = lambda local_targets, ranks: count_trained_tokens(local_targets)


@pytest.mark.distributed
@pytest.mark.parametrize("bug", [inject_dropped_world_factor, inject_local_token_count])
def test_mutation_self_test_the_oracle_flags_each_known_bug(bug):
    from gradscale.parity import run_parity

    rows = run_parity(world_size=2, strategy="ddp", grad_accum=2, child_setup=bug)
    flagged = [r for r in rows if r.recipe == "global_tokens" and not r.ok]
    assert flagged, "the oracle did not notice the injected bug"
    assert {r.case for r in flagged} == {"equal", "ragged", "zero_rank"}


@pytest.mark.distributed
def test_parity_cli_prints_the_table():
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "gradscale.parity", "--grad-accum", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 12 and "global_tokens_no_world_fix" in proc.stdout


@pytest.mark.distributed
def test_a_dead_rank_ends_the_job_quickly_and_nothing_claims_completion(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = torchrun([str(ROOT / "tests" / "helpers" / "failing_rank.py"), *TINY, "steps=50", "world_size=2",
                     "dist.timeout_s=10", f"hydra.run.dir={run_dir}"], cache_dir, timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert elapsed < 90, f"took {elapsed:.0f} s"
    assert "injected failure on rank 1 at step 2" in proc.stderr
    summary_file = run_dir / "summary.json"
    if summary_file.exists():
        assert json.loads(summary_file.read_text())["status"] == "failed"


def test_explicit_world_size_that_disagrees_with_torchrun_is_refused(monkeypatch):
    from gradscale.checks import ConfigError
    from gradscale.config import validate
    from tests.conftest import compose

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"world_size=4 .*WORLD_SIZE=2"):
        validate(compose(["world_size=4", "batch_size=8"]), overrides=["world_size=4"])
    validate(compose(["batch_size=8"]), overrides=[])  # left out: torchrun's 2 is used


@pytest.mark.parametrize("launcher", ["submitit_local", "local_parallel"])
def test_scale_out_launchers_run_a_two_job_sweep(cli, tmp_path, launcher):
    """submitit's local executor stands in for SLURM (same launcher plugin); local_parallel is joblib."""
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", f"hydra/launcher={launcher}", "scale=1,8", "fix=true", *TINY, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in job_dirs(sweep_dir)]
    assert [(s["scale"], s["status"]) for s in summaries] == [(1.0, "completed"), (8.0, "completed")]


def test_slurm_launcher_config_composes():
    """hydra/launcher=slurm is submitit's SLURM launcher (its class resolves) with one task per GPU, also when
    the user changes the GPU count: adopt_slurm_tasks turns each task into one rank on the GPU LOCAL_RANK."""
    from hydra.utils import get_class

    from tests.conftest import compose

    launcher = compose(["hydra/launcher=slurm"], with_hydra=True).hydra.launcher
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8
    launcher = compose(["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=4", "hydra.launcher.nodes=2"],
                       with_hydra=True).hydra.launcher
    assert (launcher.nodes, launcher.tasks_per_node) == (2, 4)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# task 11 of a 16-task job on two 8-GPU nodes, as SLURM and submitit's SLURM executor describe it
SLURM_TASK = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": "/tmp/submitit/%j", "SLURM_JOB_ID": "4242",
              "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "11",
              "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": "gpu[07-08]"}


@pytest.fixture
def bare_env():
    """os.environ without any torchrun, SLURM or submitit variable, restored whole afterwards
    (adopt_slurm_tasks writes os.environ directly, past monkeypatch)."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key in TORCHRUN_VARS or key.startswith(("SLURM_", "SUBMITIT_")) or key == "CUDA_VISIBLE_DEVICES":
            del os.environ[key]
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_slurm_tasks_become_torchrun_ranks(bare_env):
    from gradscale.checks import ConfigError
    from gradscale.config import validate
    from gradscale.parallel import adopt_slurm_tasks, env_rank, under_torchrun
    from tests.conftest import compose

    bare_env.update(SLURM_TASK, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    adopt_slurm_tasks()
    assert {k: bare_env.get(k) for k in TORCHRUN_VARS if k != "MASTER_PORT"} == {
        "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu07"}
    assert under_torchrun() and env_rank() == 11
    assert bare_env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # every GPU stays visible: LOCAL_RANK picks one
    port = bare_env["MASTER_PORT"]
    assert 20000 <= int(port) <= 60000
    # every task of the job must meet at the same address: task 0 on the first node derives the same port
    for key in TORCHRUN_VARS:
        del bare_env[key]
    bare_env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    adopt_slurm_tasks()
    assert (bare_env["RANK"], bare_env["LOCAL_RANK"], bare_env["MASTER_ADDR"], bare_env["MASTER_PORT"]) == (
        "0", "0", "gpu07", port)
    # and the run's world_size is checked against SLURM's task count, as gradscale/conf/hydra/launcher/slurm.yaml says
    with pytest.raises(ConfigError, match=r"world_size=8 .*WORLD_SIZE=16"):
        validate(compose(["world_size=8", "batch_size=16"]), overrides=["world_size=8"])


def test_slurm_adoption_keeps_a_given_master_port(bare_env):
    from gradscale.parallel import adopt_slurm_tasks

    bare_env.update(SLURM_TASK, MASTER_PORT="29400")
    adopt_slurm_tasks()
    assert (bare_env["RANK"], bare_env["MASTER_PORT"]) == ("11", "29400")


@pytest.mark.parametrize("case", ["under torchrun", "one task", "no SLURM", "SLURM without submitit"])
def test_slurm_adoption_leaves_the_environment_alone(bare_env, case):
    from gradscale.parallel import adopt_slurm_tasks

    if case == "under torchrun":  # torchrun inside the SLURM job: its ranks win
        bare_env.update(SLURM_TASK, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    elif case == "one task":  # a one-GPU job: emulated ranks, no process group
        bare_env.update(SLURM_TASK, SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0")
    elif case == "SLURM without submitit":  # the user's own srun, not the launcher's job
        bare_env.update({k: v for k, v in SLURM_TASK.items() if not k.startswith("SUBMITIT_")})
    before = dict(bare_env)
    adopt_slurm_tasks()
    assert dict(bare_env) == before


class _Reduced(Exception):
    """Raised by the fake all_reduce once it has seen where the tensor lies."""


@pytest.mark.parametrize("collective", ["token count", "loss sum", "sharded norm"])
def test_every_collective_runs_on_the_backends_device(monkeypatch, collective):
    """NCCL refuses CPU tensors: each collective of the loop must place its tensor on the ranks' device
    (here `meta`, which no CPU tensor is on) before it reduces. The global token count once did not."""
    import torch

    from gradscale import grads
    from gradscale.parallel import Ranks

    placed = []

    def fake_all_reduce(tensor, op=None):
        placed.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    ranks = Ranks(world_size=2, real=True, strategy="fsdp2", device=torch.device("meta"))
    calls = {
        "token count": lambda: grads.global_token_count(torch.tensor([[1, -100, 2]]), ranks),
        "loss sum": lambda: ranks.sum(torch.zeros(())),
        "sharded norm": lambda: grads.total_norm([torch.ones(3)], ranks),
    }
    with pytest.raises(_Reduced):
        calls[collective]()
    assert placed == [torch.device("meta")]


def test_no_collective_bypasses_ranks():
    """Every all-reduce, gather, broadcast or barrier in gradscale/ goes through gradscale/parallel.py."""
    import re

    collective = re.compile(r"\bdist\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|reduce|gather"
                            r"|scatter|barrier|monitored_barrier)\(")
    offenders = [f"{path.name}:{n}" for path in sorted((ROOT / "gradscale").glob("*.py"))
                 if path.name != "parallel.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if collective.search(line)]
    assert offenders == []
