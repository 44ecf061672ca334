"""The risk advisor: the sqrt(v_hat) histograms it reads, its formula, its commands and its proof against runs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradscale import theory
from gradscale.analysis import advise
from gradscale.analysis.load import load, read_jsonl
from gradscale.optimizer_stats import sqrt_v_histograms, sqrt_v_quantiles
from gradscale.records import HIST_BINS
from tests.conftest import OFFLINE_ENV, ROOT, TINY


def adamw_with_state(steps: int = 3, eps: float = 1e-8):
    """AdamW after a few steps on gradients spread over twelve decades (so that eps matters for some)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 70)), torch.nn.Parameter(torch.randn(50))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, eps=eps)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * torch.logspace(-12, 0, p.numel()).reshape(p.shape)
        optimizer.step()
    return params, optimizer


def moments(optimizer, p, steps=3):
    state = optimizer.state[p]
    s = (state["exp_avg_sq"].double() / (1 - 0.999**steps)).sqrt()
    return state["exp_avg"].double() / (1 - 0.9**steps), s


def test_histograms_hold_every_coordinate_and_the_update_energy():
    params, optimizer = adamw_with_state()
    histograms = sqrt_v_histograms(optimizer)
    assert histograms.shape == (2, 2, 1 + HIST_BINS)
    for p, (counts, energy) in zip(params, histograms):
        m_hat, s = moments(optimizer, p)
        assert counts.sum() == p.numel()
        assert energy.sum().item() == pytest.approx(((m_hat / (s + 1e-8)) ** 2).sum().item(), rel=1e-5)
    p0 = params[0]
    optimizer.state[p0]["exp_avg_sq"][0, :10] = 0  # exact zeros go to their own slot
    assert sqrt_v_histograms(optimizer)[0, 0, 0] == 10


def test_predicted_ratio_and_share_match_a_per_coordinate_computation():
    params, optimizer = adamw_with_state()
    records = sqrt_v_quantiles(optimizer, {p: f"model.layers.0.mlp.w{i}" for i, p in enumerate(params)}, 3)
    histogram = theory.histogram_of(records[0])
    m_hat, s = moments(optimizer, params[0])
    at_one = m_hat / (s + 1e-8)
    for c in (1.0, 1e-2, 1e-4, 1e-6):  # per coordinate (theory.update_ratio) against the histogram's binned form
        direct = ((at_one * torch.from_numpy(theory.update_ratio(c, s.numpy(), 1e-8))).norm() / at_one.norm()).item()
        assert theory.update_rms_ratio(histogram, c, 1e-8, 1e-8) == pytest.approx(direct, rel=0.02), c
        share = (c * s < 1e-8).double().mean().item()
        assert theory.eps_dominated_share(histogram, c, 1e-8) == pytest.approx(share, abs=0.01), c
    # another eps than the run's: the same direct computation at eps 1e-10
    direct = ((m_hat / (s + 1e-10 / 1e-4)).norm() / (m_hat / (s + 1e-10)).norm()).item()
    assert theory.update_rms_ratio(histogram, 1e-4, 1e-10, 1e-8) == pytest.approx(direct, rel=0.02)
    # the largest eps within 1% is where the ratio crosses 0.99
    safe = advise.largest_safe_eps(histogram, 1e-4, 1e-8)
    assert theory.update_rms_ratio(histogram, 1e-4, safe, 1e-8) >= 0.99 > theory.update_rms_ratio(
        histogram, 1e-4, safe * 1.1, 1e-8)


def advise_cli(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "gradscale.analysis.advise", *args], cwd=ROOT, capture_output=True,
                          text=True,
                          env={**os.environ, **OFFLINE_ENV}, timeout=timeout)


@pytest.fixture(scope="module")
def advisor_sweep(tmp_path_factory, cache_dir):
    """AdamW at c = 1, 1e-4, 1e-5 on the tiny model, histograms every step; an SGD run and one without records."""
    sweep = tmp_path_factory.mktemp("advisor")
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    commands = (["-m", "optimizer=adamw", "scale=1,1e-4,1e-5", "fix=true", "adam_stats_every=1",
                 f"hydra.sweep.dir={sweep / 'adamw'}"],
                ["optimizer=sgd", f"hydra.run.dir={sweep / 'sgd'}"],
                ["optimizer=adamw", "adam_stats_every=null", f"hydra.run.dir={sweep / 'no_records'}"])
    # side by side, one thread each: mostly start-up, single-threaded Python
    procs = [subprocess.Popen([sys.executable, "-m", "gradscale.run", *args, *TINY], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in commands]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    return sweep


def test_advisor_agrees_with_measured_runs_at_step_0(advisor_sweep):
    runs, curves = load(advisor_sweep / "adamw")
    comparison = advise.advisor_vs_measured(runs, curves)
    assert set(comparison.c_eff.round(8)) == {1e-4, 1e-5}
    first = comparison[comparison.step == 0]
    assert len(first) == 2 and (first.error.abs() < 0.05).all(), first
    assert (first.predicted < 0.99).all()  # c = 1e-4 and 1e-5 cut the update: the agreement is not trivial
    summary = advise.advisor_summary(comparison)
    assert list(summary["first step"]) == [0, 0] and summary["max abs error"].notna().all()
    onsets = advise.predicted_onsets(runs)
    assert 1e-5 < onsets["adamw"] < 1


def test_advise_command_prints_the_table_and_writes_the_json_contract(advisor_sweep, tmp_path):
    reference = next((advisor_sweep / "adamw").glob("0_*"))
    out = tmp_path / "advice.json"
    proc = advise_cli([str(reference), "--world-sizes", "8,64,1024", "--json", str(out),
                       "--figure", str(tmp_path / "advice.png")])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("N=")]
    assert [r[0] for r in rows] == ["N=8", "N=64", "N=1024"]
    ratios = [float(r[1]) for r in rows]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 1
    advice = json.loads(out.read_text())
    assert advice["eps"] == 1e-8
    recorded = sorted({r["step"] for r in read_jsonl(reference / "adam_stats.jsonl")})
    assert [s["step"] for s in advice["steps"]] == recorded
    for step in advice["steps"]:
        assert [p["c"] for p in step["predictions"]] == pytest.approx([1 / 8, 1 / 64, 1 / 1024])
        for p in step["predictions"]:
            assert 0 < p["update_rms_ratio"] <= 1 and 0 <= p["eps_dominated_share"] <= 1
            assert math.isfinite(p["largest_eps_within_1pct"])
    assert (tmp_path / "advice.png").stat().st_size > 0
    scales = advise_cli([str(reference), "--scales", "1e-4,1e-5", "--eps", "1e-12", "--figure",
                         str(tmp_path / "b.png")])
    assert scales.returncode == 0 and "c=1e-4" in scales.stdout and "eps = 1e-12" in scales.stdout


@pytest.mark.parametrize(("case", "args", "says"), [
    ("sgd", [], "optimizer=sgd"),
    ("no_records", [], "no sqrt(v_hat) histograms"),
    ("missing", [], "does not exist"),
    ("adamw/0_*", ["--world-sizes", "8,0"], "--world-sizes='8,0'"),
    ("adamw/0_*", ["--scales", "1e-4,x"], "--scales='1e-4,x'"),
])
def test_advise_refuses_bad_input_in_one_line(advisor_sweep, case, args, says):
    run = next(iter(advisor_sweep.glob(case)), advisor_sweep / case)
    proc = advise_cli([str(run), *args])
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr


def test_experiments_advise_runs_the_reference_and_advises(cache_dir, tmp_path):
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gradscale.advise", *TINY, "steps=3", f"hydra.run.dir={tmp_path / 'ref'}",
               "--world-sizes", "8,64", "--json", str(tmp_path / "ref.json")]
    # and --gradient-only: step 0 from one gradient (v_hat = g^2 at Adam's first step), side by side with it
    gradient_only = subprocess.Popen([*command[:-5], f"hydra.run.dir={tmp_path / 'gradient'}", "--gradient-only",
                                      "--world-sizes", "8,64", "--json", str(tmp_path / "gradient.json")],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "N=64" in proc.stdout
    # the memory it needs, said before the run (weights, gradients, Adam's state, activations), then measured
    assert re.search(r"^advise: the advisor's reference fine-tune needs about [\d.]+ GiB \(weights .*optimizer state",
                     proc.stdout, re.M)
    assert re.search(r"^advise: the run's measured peak resident memory [\d.]+ GiB", proc.stdout, re.M)
    records = read_jsonl(tmp_path / "ref" / "adam_stats.jsonl")
    assert sorted({r["step"] for r in records}) == [0, 1, 2]  # histograms on every step

    # --gradient-only: the same prediction, no optimizer state
    gradient_stdout, gradient_stderr = gradient_only.communicate(timeout=300)
    assert gradient_only.returncode == 0, gradient_stderr[-3000:]
    assert re.search(r"^advise: the gradient-only advisor needs about [\d.]+ GiB \(weights [\d.e-]+, gradients "
                     r"[\d.e-]+, activations", gradient_stdout, re.M) and "optimizer state" not in gradient_stdout
    assert not (tmp_path / "gradient" / "summary.json").exists()  # no fine-tune ran
    step_0 = json.loads((tmp_path / "ref.json").read_text())["steps"][0]
    only = json.loads((tmp_path / "gradient.json").read_text())["steps"]
    assert [s["step"] for s in only] == [0] and step_0["step"] == 0
    for a, b in zip(step_0["predictions"], only[0]["predictions"], strict=True):
        assert b["update_rms_ratio"] == pytest.approx(a["update_rms_ratio"], rel=1e-6)
        assert b["eps_dominated_share"] == pytest.approx(a["eps_dominated_share"], rel=1e-3, abs=1e-6)
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert summary["c_eff"] == 1 and summary["steps_done"] == 3
    refused = subprocess.run([*command[:3], "scale=8"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "scale=8 is not allowed" in refused.stderr
    assert np.isfinite(summary["final_loss"])


def test_experiments_advise_says_the_clipping_case_per_world_size(cache_dir, tmp_path):
    """clip_grad_norm=0.05 on the tiny model (grad norms about 0.6-1.2): at N = 8 both runs clip at every step
    (a), at N = 64 only the fixed run does (b), at N = 20 some steps (mixed); clip_grad_norm=100: none (c).
    The 20-step mode reads every step's norm, --gradient-only step 0's and says so."""
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "gradscale.advise", *TINY, "steps=6", "--world-sizes", "8,20,64"]
    commands = {"run": [*base, "clip_grad_norm=0.05", f"hydra.run.dir={tmp_path / 'run'}", "--json",
                        str(tmp_path / "run.json")],
                "gradient": [*base, "clip_grad_norm=0.05", f"hydra.run.dir={tmp_path / 'gradient'}", "--gradient-only"],
                "never": [*base, "clip_grad_norm=100", f"hydra.run.dir={tmp_path / 'never'}", "--gradient-only"]}
    procs = {k: subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in commands.items()}
    out, printed = {}, {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        printed[key] = stdout
        out[key] = {line.split(":")[0]: line for line in stdout.splitlines() if re.match(r"N=\d+: case", line)}
        assert list(out[key]) == ["N=8", "N=20", "N=64"], stdout
    run = out["run"]
    assert "case (a)" in run["N=8"] and "fixed run clipped at 100% of the steps, the bug's at 100%" in run["N=8"]
    assert "case (b)" in run["N=64"] and "the bug's at 0%" in run["N=64"]
    assert "both eps = 1.5625e-10 and max_norm = 0.00078125" in run["N=64"]
    assert "case (mixed)" in run["N=20"]
    norms = json.loads((tmp_path / "run.json").read_text())["clipping"]["grad_norms"]
    assert len(norms) == 6 and min(norms) / 20 < 0.05 < max(norms) / 20  # the mixed case is real, not assumed
    assert all("case (c)" in line and "eps = " in line for line in out["never"].values())
    assert "at step 0 only" in printed["gradient"] and "at step 0 only" not in printed["run"]
    assert "early norms run higher" in printed["run"] or "median" in printed["run"]
    step_0 = read_jsonl(tmp_path / "gradient" / "metrics.jsonl")
    assert len(step_0) == 1 and step_0[0]["train/grad_norm"] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.parametrize(("args", "says"), [
    (["--world-sizes", "8,abc"], "error: --world-sizes='8,abc' is not a comma-separated list of integers"),
    (["--scales=-1"], "error: --scales='-1': every value must be > 0"),
    (["--eps=0"], "error: --eps=0.0 must be > 0"),
    (["--json", "/nonexistent/x.json"], "error: --json='/nonexistent/x.json' its folder '/nonexistent' does not exist"),
])
def test_experiments_advise_checks_its_flags_before_the_reference_run(tmp_path, args, says):
    """Each bad flag: one line and exit 2 before the fine-tune, whose folder is never made."""
    run_dir = tmp_path / "ref"
    proc = subprocess.run([sys.executable, "-m", "gradscale.advise", *TINY, f"hydra.run.dir={run_dir}", *args],
                          cwd=ROOT, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == says and proc.stdout == ""
    assert not run_dir.exists()


@pytest.mark.parametrize("mode", [[], ["--gradient-only"]])
def test_experiments_advise_refuses_what_will_not_fit_before_loading_anything(tmp_path, mode):
    """Llama 3.2 3B at 64 x 4096 tokens: terabytes of activations on any machine; one line, exit 2, no folder."""
    run_dir = tmp_path / "ref"
    proc = subprocess.run([sys.executable, "-m", "gradscale.advise", "model=llama3_2_3b", "batch_size=64",
                           "seq_len=4096", f"hydra.run.dir={run_dir}", *mode], cwd=ROOT,
                          env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True, timeout=120)
    what = "the gradient-only advisor" if mode else "the advisor's reference fine-tune"
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.fullmatch(rf"error: {what} needs about \d+ GiB \(weights 12, gradients 12, "
                        + ("" if mode else r"optimizer state 37, ")
                        + r"activations \d+, framework 0.5\) on cpu, and 1.1 times that free; this machine has [\d.]+ "
                        r"GiB available \(this process holds [\d.]+\): lower "
                        r"batch_size or seq_len, raise grad_accum" + ("" if mode else ", or use --gradient-only"),
                        proc.stderr.strip()), proc.stderr
    assert not run_dir.exists()


def test_memory_estimate_counts_parameters_on_the_meta_device():
    from gradscale import memory
    from gradscale.hydra_glue import compose, to_object

    full = to_object(compose(["model=smollm2_135m"]))
    assert memory.parameter_counts(full) == (134515008, 134515008)  # SmolLM2-135M, tied embeddings counted once
    lora = to_object(compose(["model=smollm2_135m", "finetune=lora"]))
    total, trained = memory.parameter_counts(lora)
    assert total > 134515008 and 0 < trained < total // 50
    estimate = memory.estimate(full, "cpu", optimizer_state=True, sequences_per_forward=8)
    assert estimate.weights == estimate.gradients == 4 * 134515008 and estimate.optimizer_state > 8 * 134515008
    assert memory.estimate(full, "cpu", optimizer_state=False, sequences_per_forward=8).optimizer_state == 0


@pytest.mark.parametrize("step", [0, 19])
def test_the_table_says_what_its_eps_answers_and_that_step_0_understates(step):
    """"eps within 1%" is a tolerance at the measured step, not the exact repair eps x c, which the output gives
    beside it; a table from step 0 (gradient-only) says that step understates the cut."""
    from gradscale.analysis.advise import format_advice

    prediction = {"update_rms_ratio": 0.95, "eps_dominated_share": 0.01, "largest_eps_within_1pct": 1.2e-10,
                  "groups": {}}
    advice = {"run": "r", "eps": 1e-8, "steps": [{"step": step, "predictions": [{**prediction, "c": 1 / 8},
                                                                                {**prediction, "c": 1 / 64}]}]}
    text = format_advice(advice, ["N=8", "N=64"])
    assert f"a tolerance, the largest eps that keeps the update within 1% of the fixed run's at step {step}" in text
    assert "the exact repair without the fix is eps x c (eps / N for the world-size bug: N=8: 1.25e-9, N=64: " \
           "1.56e-10)" in text
    assert ("step 0 (gradient-only) understates the cut" in text) is (step == 0)
