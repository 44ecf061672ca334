"""The benchmark script runs and ends with its machine-readable line; parallel sweep jobs share the cores;
freed CPU memory stays in the process.
(Speed itself is measured by scripts/bench.py, never asserted here.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from gradscale.cache import GLIBC_MALLOC_ENV
from tests.conftest import OFFLINE_ENV, ROOT, load_script


@pytest.mark.slow
def test_bench_runs_every_loop_and_ends_with_its_ratios(cache_dir):
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--steps", "2", "--repeats", "2", "batch_size=8",
                           "seq_len=64", "model.init=random"],  # no test else builds the default base (27 s)
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for loop in ("| bare |", "| suite |", "| suite, metrics off |", "| hf_trainer |"):
        assert loop in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"suite/bare=([\d.]+) suite/hf_trainer=([\d.]+) utilization=([\d.]+)", last)
    assert match, last
    assert all(float(x) > 0 for x in match.groups())


@pytest.mark.slow
def test_bench_real_model_mode_measures_each_precision_and_loop(cache_dir):
    """--real-model on a small stand-in for SmolLM2 (the mode's overrides replace its model key by key): a process
    per measurement, both precisions and loops, and the ratios line."""
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    small = ["model=llama3_2_tiny", "model.init=random", "batch_size=8", "seq_len=32"]
    # a small matmul: a CPU without bf16 instructions takes minutes for the default 2048^3 in bf16 (measured here)
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--real-model", "1", "--steps", "1", "--matmul-size",
                           "256", *small], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for precision in ("fp32", "bf16"):
        for loop in ("bare", "suite"):
            assert f"| this | {precision} | {loop} |" in proc.stdout, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    ratios = dict(field.split("=") for field in last.split()[1:])
    assert last.startswith("real-model ") and set(ratios) == {"suite/bare_fp32", "suite/bare_bf16",
                                                              "bf16/fp32_suite_tokens"}
    assert all(float(v) > 0 for v in ratios.values())


def test_bench_against_measures_an_earlier_commit_in_a_worktree_it_removes():
    """--against's code: a git worktree of the commit, on which this script's probe imports that commit's code."""
    bench = load_bench()
    with bench.worktree("HEAD") as tree:
        assert (tree / "gradscale" / "train.py").is_file()
        probe = subprocess.run([sys.executable, "-c", "import sys, os; sys.path.insert(0, os.environ["
                                "'GRADSCALE_BENCH_CODE']); import gradscale; print(gradscale.__file__)"],
                               cwd=tree, env={**os.environ, "GRADSCALE_BENCH_CODE": str(tree)}, capture_output=True,
                               text=True, timeout=60)
        assert probe.stdout.strip() == str(tree / "gradscale" / "__init__.py")
    assert not tree.exists()
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "gradscale-bench-" not in listed
    with pytest.raises(SystemExit, match="error: --against no-such-ref"):
        with bench.worktree("no-such-ref"):
            pass


def test_bench_refuses_against_without_real_model():
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--against", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--against goes with --real-model N" in proc.stderr


@pytest.mark.slow
def test_bench_memory_measures_every_loop_at_two_depths(cache_dir):
    """--memory on a small model: one process per loop and depth, the table, and the ratios line."""
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    # wide enough that the 4 layers between the depths (3M parameters, 16+ bytes each) stand well above the
    # process's RSS noise (a few MB: a 64-wide model's 0.15M parameters read a negative slope once); the
    # sqrt(v) quantiles off, as they cost the most time and no memory the test reads
    small = ["model.init=random", "model.hidden_size=256", "model.intermediate_size=704",
              "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=64",
              "adam_stats_every=null"]
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--memory", "1", *small], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for loop in ("| bare |", "| suite, logged every step |", "| suite |"):
        assert loop in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"memory suite/bare=(-?[\d.]+) suite=(-?[\d.]+) bare=(-?[\d.]+) default/bare=(-?[\d.]+)", last)
    assert match, last
    # each loop's slope: weights, gradients and the Adam state alone are 16 bytes per parameter
    assert all(float(match[i]) > 0 for i in (2, 3, 4)), last


def test_bench_refuses_too_few_steps():
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--steps", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--steps=0 must be >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--memory", "-1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--memory=-1 must be >= 0" in proc.stderr


def test_parallel_jobs_share_the_cores(monkeypatch):
    from gradscale.run import share_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    threads = torch.get_num_threads()
    try:
        share_cores(OmegaConf.create({"launcher": {"n_jobs": 2}}))
        assert torch.get_num_threads() == 4
        share_cores(OmegaConf.create({"launcher": {"n_jobs": -1}}))  # joblib: as many jobs as cores
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)
        share_cores(OmegaConf.create({"launcher": {"_target_": "basic"}}))  # one job at a time: untouched
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


# Imports as a suite job's process does (gradscale.run) before the setting: with only gradscale.cache
# imported, 3 of 4 processes still faulted 1,638-4,915 pages per 64 MB allocation (2026-12-06, not understood).
FAULTS_PER_ALLOCATION = """
import resource, torch
import gradscale.run
from gradscale.cache import keep_freed_memory
applied = keep_freed_memory()
for _ in range(3):
    torch.ones(16 << 20).sum()  # 64 MB: above the largest size glibc ever serves from its heap by default
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16 << 20).sum()  # allocated, touched, freed
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt: Linux with glibc")
def test_freed_memory_is_kept_unless_the_user_set_glibc_malloc():
    def run(extra_env):
        env = {k: v for k, v in os.environ.items() if k not in GLIBC_MALLOC_ENV}
        proc = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION], cwd=ROOT, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        applied, faults = proc.stdout.split()
        return applied == "True", float(faults)

    assert run({}) == (True, pytest.approx(0, abs=50))  # the 64 MB are reused: no page faults
    applied, faults = run({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"})  # glibc's default, set explicitly
    assert not applied and faults > 10_000  # mmap'd and unmapped each time: 16,384 pages faulted in


@pytest.mark.parametrize("n", [1, 2, 7, 4097, 131072])
def test_cpu_quantiles_are_torch_quantiles(n):
    from gradscale.optimizer_stats import QUANTILES, quantiles

    values = torch.rand(n, generator=torch.Generator().manual_seed(n)).square()  # skewed, like sqrt(v_hat)
    values[: n // 3] = values[0]  # ties
    expected = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    assert torch.allclose(torch.tensor(quantiles(values, QUANTILES), dtype=torch.float64), expected, rtol=1e-6, atol=0)


def load_bench():
    return load_script("bench")


class FakeOptimizer:
    def zero_grad(self):
        pass


def test_interleaved_times_only_the_timed_steps_in_turns(monkeypatch):
    """Two fake loops on a fake clock: each block of steps is billed to its own loop, warm-up and what a
    loop does after its last timed step are not billed, and the loops take turns block by block."""
    bench = load_bench()
    clock, order = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    warmup, steps, block = 2, 7, 3

    def make_loop(name, cost, optimizer):
        def loop():
            for step in range(warmup + steps):
                clock[0] += 1000.0 if step < warmup else cost  # warm-up steps: slow, and not timed
                order.append((name, step))
                optimizer.zero_grad()
            clock[0] += 1000.0  # after the last step (final eval, closing the log): not timed
        return loop

    interleaved = bench.Interleaved(warmup, steps, block, torch.device("cpu"))
    for name, cost in (("a", 1.0), ("b", 2.5)):
        optimizer = FakeOptimizer()
        interleaved.add(name, make_loop(name, cost, optimizer), optimizer)
    assert interleaved.run() == {"a": 1.0, "b": 2.5}
    turns = [name for i, (name, _) in enumerate(order) if i == 0 or order[i - 1][0] != name]
    assert turns == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then blocks of 3, 3 and the last 1 step


def test_interleaved_refuses_a_loop_that_stops_early():
    bench = load_bench()
    optimizer = FakeOptimizer()
    interleaved = bench.Interleaved(1, 5, 5, torch.device("cpu"))
    interleaved.add("short", lambda: [optimizer.zero_grad() for _ in range(3)], optimizer)
    with pytest.raises(RuntimeError, match="a loop ended after 3 steps, not 6"):
        interleaved.run()
