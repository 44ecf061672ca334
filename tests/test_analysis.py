"""analysis: loading, pairing, theory, plots on synthetic tables, and the report on a real tiny sweep."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import matplotlib.figure
import numpy as np
import pandas as pd
import pytest

from gradscale import theory
from gradscale.analysis import plots
from gradscale.analysis.load import curve, load, read_jsonl, run_names, setup_labels
from gradscale.analysis.tables import crossing_cell, equivalent_references, pair_references
from gradscale.recipes import c_eff, normalization_in_effect
from gradscale.runs import short_number
from tests.conftest import TINY


def synthetic(c_values=(1.0, 8.0), optimizers=("sgd", "adamw"), lrs=(1e-3,), steps=5):
    """A runs table and curves in the shape gradscale.analysis.load returns; loss drifts away with log2(c)."""
    runs, curves = [], []
    for optimizer in optimizers:
        for lr in lrs:
            for c in c_values:
                name = f"{optimizer}-{lr:g}-{c:g}"
                runs.append({"run": name, "optimizer": optimizer, "model": "llama3_2_tiny (pretrained init)",
                             "finetune": "full", "lr": lr,
                             "eps": 1e-8 if optimizer == "adamw" else float("nan"), "weight_decay": 0.0, "scale": c,
                             "fix": True, "world_size": 8, "clip": None, "precision": "fp32",
                             "bf16_matmul": "auto",
                             "normalization": "global_tokens", "seed": 0, "steps": steps, "status": "completed",
                             "final_loss": 5.0 + math.log2(c), "best_eval_loss": 5.0, "diverged_at_step": None,
                             "steps_done": steps, "clipped_steps": 0, "path": "", "c_eff": c, "setup": optimizer})
                for step in range(steps):
                    curves += [(name, step, "train/loss", 6.0 - 0.1 * step + 0.01 * step * math.log2(c)),
                               (name, step, "train/grad_norm", c * (1 + 0.1 * step)),
                               (name, step, "train/update_rms", 1e-3)]
                    if optimizer == "adamw":
                        curves.append((name, step, "adam/eps_dominated_frac", 0.01 * step))
    return pd.DataFrame(runs), pd.DataFrame(curves, columns=["run", "step", "metric", "value"])


def test_c_eff_and_theory():
    assert c_eff(1.0, normalization_in_effect(fix=False, normalization="global_tokens"), world_size=8) == 1 / 8
    assert c_eff(8.0, normalization_in_effect(fix=True, normalization="global_tokens"), world_size=8) == 8
    assert theory.update_ratio(1.0, 1e-8, 1e-8) == 1.0  # against c = 1 itself
    assert theory.update_ratio(1 / 8, 1e-8, 1e-8) == pytest.approx(2 / 9)  # (s + eps) / (s + 8 eps)
    assert theory.update_ratio(1e-6, 1.0, 0.0) == 1.0  # no eps: invariant
    assert theory.critical_scale(1e-4, 1e-8) == pytest.approx(1e-4)
    assert theory.twin_value(0.1, 8, 1) == pytest.approx(0.8)  # SGD's lr
    assert theory.twin_value(1e-8, 8, -1) == 1e-8 / 8  # AdamW's eps, exactly
    counts = np.zeros(len(theory.BIN_LOW))  # one coordinate in each of four bins, their lower edges exact
    counts[[np.searchsorted(theory.BIN_LOW, s, side="right") - 1 for s in (1e-9, 1e-7, 1e-6, 1e-5)]] = 1
    assert theory.eps_dominated_share(theory.Histogram(counts, counts), 1.0, 1e-8) == 0.25
    c_start, c_all = theory.breakdown_band({"q10": 1e-6, "q90": 1e-3}, 1e-8)
    assert c_start == pytest.approx(1e-2) and c_all == pytest.approx(1e-5)


def test_pairing_finds_the_reference_run():
    runs, _ = synthetic(lrs=(1e-3, 1e-2))
    runs.loc[len(runs)] = {**runs.iloc[1].to_dict(), "run": "sgd-0.001-nofix", "fix": False, "scale": 1.0,
                           "c_eff": 1 / 8}
    references = dict(zip(runs.run, pair_references(runs)))
    assert references["sgd-0.01-8"] == "sgd-0.01-1"
    assert references["adamw-0.001-8"] == "adamw-0.001-1"
    assert references["sgd-0.001-nofix"] == "sgd-0.001-1"
    runs.loc[1, "seed"] = 1  # sgd-0.001-8 with a different seed is a different experiment: no reference for it
    assert pair_references(runs)[1] is None


def test_runs_from_other_weights_are_other_setups_with_their_own_reference():
    """A sweep over model.init (or model=): each run is compared with the reference of its own weights."""
    runs, _ = synthetic(optimizers=("adamw",))
    runs = pd.concat([runs, runs.assign(model="llama3_2_tiny (random init)", run=lambda t: t.run + "-random")],
                     ignore_index=True)
    references = dict(zip(runs.run, pair_references(runs)))
    assert references["adamw-0.001-8"] == "adamw-0.001-1"
    assert references["adamw-0.001-8-random"] == "adamw-0.001-1-random"
    labels = dict(zip(runs.run, setup_labels(runs)))
    assert labels["adamw-0.001-8-random"] == "adamw model=llama3_2_tiny (random init)"


@pytest.mark.parametrize(
    ("maker", "n_axes"),
    [(plots.loss_curves, 2), (plots.divergence, 2), (plots.grad_norm_ratio, 2), (plots.adam_state, 2)],
)
def test_curve_plots(maker, n_axes):
    runs, curves = synthetic()
    fig = maker(runs, curves)
    assert isinstance(fig, matplotlib.figure.Figure)
    axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(axes) == n_axes
    if maker is plots.loss_curves:
        assert [len(ax.get_lines()) for ax in axes] == [2, 2]  # one line per scale
    if maker is plots.divergence:
        data = [[line for line in ax.get_lines() if line.get_gid() is None] for ax in axes]
        assert [len(lines) for lines in data] == [1, 1]  # the reference itself is not drawn
        assert axes[0].get_yscale() == "log"
        # the exact zero at step 0: a hollow marker on the named floor, and the line starts after it
        on_floor, = [line for line in axes[0].get_lines() if line.get_gid() == "on floor"]
        assert list(on_floor.get_xdata()) == [0] and on_floor.get_ydata()[0] == plots.FLOOR
        assert on_floor.get_markerfacecolor() == "none" and np.isnan(data[0][0].get_ydata()[0])
        assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])  # sizes compare across panels
    if maker is plots.grad_norm_ratio:
        ratio = axes[0].get_lines()[0].get_ydata()
        assert np.allclose(ratio, 8.0)  # flat at exactly c_eff
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert any("have parted" in t and "not a scaling error" in t for t in legend)  # why SGD's line wobbles
    if maker is plots.adam_state:  # the share in percent, from 0 to a little above the largest (4% here)
        share = axes[0]
        assert share.get_ylim() == pytest.approx((0, 1.1 * 0.04))
        assert isinstance(share.yaxis.get_major_formatter(), matplotlib.ticker.PercentFormatter)


def test_a_flat_line_says_its_value_not_that_it_equals_another_runs():
    zeros = pd.Series([0.0, 0.0, 0.0])
    drawn = {("unseen", "sgd"): zeros, ("unseen", "adamw"): zeros.copy(), ("rare", "adamw"): zeros.copy(),
             ("unseen", "lion"): pd.Series([0.0, 1.0, 2.0]), ("unseen", "lion twin"): pd.Series([0.0, 1.0, 2.0])}
    assert plots._coincidence("adamw", drawn) == plots._coincidence("sgd", drawn) == " (exactly 0 throughout)"
    assert plots._coincidence("lion twin", drawn) == " (identical to lion)"


def test_a_panel_of_two_coinciding_lines_says_both():
    same = pd.Series([1.0, 2.0, 3.0])
    assert plots._panel_note([same, same.copy()]) == "both lines identical"
    assert plots._panel_note([same, same.copy(), same.copy()]) == "all 3 lines identical"


def test_breakdown_heatmap_and_lr_axis():
    runs, curves = synthetic(c_values=(1e-3, 1.0, 8.0, 64.0), lrs=(1e-3, 1e-2))
    runs.loc[runs.run == "sgd-0.01-64", ["status", "final_loss"]] = ["diverged", float("nan")]
    fig = plots.breakdown(runs, curves, bands={"adamw": (1e-2, 1e-5)})
    ax = fig.axes[0]
    # a line per setup and lr, the diverged run as x; the band shaded in its setup's colour
    markers = [line.get_marker() for line in ax.get_lines() if line.get_gid() is None]
    assert ax.get_xscale() == "log" and len(ax.patches) == 1
    assert len(markers) == 5 and len(set(markers) - {"x"}) == 4 and markers.count("x") == 1  # 4 looks, 1 diverged
    # the 1% threshold it is judged by: 1% of the references' final losses (5.0 here)
    threshold, = [line for line in ax.get_lines() if line.get_gid() == "threshold"]
    assert threshold.get_ydata()[0] == pytest.approx(0.05)
    # the runs' range, and the band as far as a decade beyond the runs
    assert ax.get_xlim() == pytest.approx((1e-4 / 2.5, 64 * 2.5)) and ax.patches[0].get_x() == pytest.approx(1e-4)
    # a sweep of c = 1 .. 64 only: the band below it is named in the legend, not drawn as a figure of empty band
    few = runs[runs.c_eff >= 1]
    fig = plots.breakdown(few, curves, bands={"adamw": (1e-2, 1e-5)}, onsets={"adamw": 1e-3})
    ax = fig.axes[0]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(ax.patches) == 0 and ax.get_xlim() == pytest.approx((1 / 2.5, 64 * 2.5))
    assert "adamw: predicted band at c = 1e-5..0.01, below this sweep's c_eff: not drawn" in legend
    assert any(t.startswith("adamw: advisor's 1% update cut at c = 1e-3, below") for t in legend)
    heat = plots.final_loss_heatmap(runs)
    assert len(heat.axes) == 3 and heat.axes[0].images[0].get_array().shape == (2, 4)  # 2 plots, 1 colour scale
    assert "diverged" in [t.get_text() for t in heat.axes[0].texts + heat.axes[1].texts]
    axis = plots.lr_axis(runs)
    diverged_marks = [line for line in axis.axes[0].get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert len(diverged_marks) == 1


def test_numbers_read_in_one_short_format():
    values = (1e-8, 1e-4, 1e4, 0.125, 8.0, 0.00375, 1.25e-4, 0.03, 1000.0, 0.0)
    assert [short_number(v) for v in values] == ["1e-8", "1e-4", "1e4", "0.125", "8", "3.75e-3", "1.25e-4", "0.03",
                                                 "1e3", "0"]


def test_a_diverged_run_is_cut_and_coinciding_lines_are_named():
    runs, curves = synthetic(optimizers=("sgd", "adamw"), c_values=(1.0, 8.0, 64.0))
    loss = curves.metric == "train/loss"
    exploding = loss & (curves.run == "sgd-0.001-64")
    curves.loc[exploding, "value"] = [6.0, 50.0, 1.7e6, float("nan"), float("nan")]
    runs.loc[runs.run == "sgd-0.001-64", "status"] = "diverged"
    for optimizer in ("sgd", "adamw"):  # scale 8 trains exactly like scale 1 (as AdamW's would)
        same = curves.loc[loss & (curves.run == f"{optimizer}-0.001-1"), "value"].to_numpy()
        curves.loc[loss & (curves.run == f"{optimizer}-0.001-8"), "value"] = same
    fig = plots.loss_curves(runs, curves)
    sgd, adamw = fig.axes[:2]
    assert sgd.get_ylim() == adamw.get_ylim() and sgd.get_ylim()[1] < 7  # 1.7e6 flattens nothing
    cut = [line for line in sgd.get_lines() if line.get_marker() == "x"]
    assert len(cut) == 1 and cut[0].get_xdata()[0] == 1  # marked where it leaves the others' range
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "sgd scale=8 (identical to sgd scale=1)" in labels and "sgd scale=64" in labels
    assert any(label.startswith("diverged") for label in labels)
    fig = plots.divergence(runs, curves)
    assert fig.axes[0].yaxis.get_major_formatter()(1e-4, 0) == "1e-4"  # not 10^-4


def test_run_names_drop_the_overrides_the_whole_sweep_shares(tmp_path):
    from omegaconf import OmegaConf

    dirs = []
    for i, overrides in enumerate([["experiment=scale_sweep", "optimizer=sgd", "scale=1", "smoke=on"],
                                   ["experiment=scale_sweep", "optimizer=adamw", "scale=1e-4", "smoke=on"]]):
        d = tmp_path / "sweep" / f"{i}_{','.join(overrides)}"
        (d / ".hydra").mkdir(parents=True)
        OmegaConf.save(OmegaConf.create(overrides), d / ".hydra" / "overrides.yaml")
        dirs.append(d)
    assert run_names(dirs) == ["0_optimizer=sgd,scale=1", "1_optimizer=adamw,scale=1e-4"]
    assert run_names(dirs[:1]) == [dirs[0].name]  # alone, nothing is shared with others


def test_setups_label_what_varies_per_optimizer():
    runs, _ = synthetic(optimizers=("sgd", "adamw"))
    runs = pd.concat([runs, runs[runs.optimizer == "adamw"].assign(eps=1e-15, run=lambda t: t.run + "-eps15")],
                     ignore_index=True)
    runs.loc[runs.optimizer == "sgd", "clip"] = [None, 1.0]
    labels = dict(zip(runs.run, setup_labels(runs)))
    assert labels["adamw-0.001-1"] == "adamw eps=1e-8" and labels["adamw-0.001-1-eps15"] == "adamw eps=1e-15"
    assert labels["sgd-0.001-1"] == "sgd clip=off" and labels["sgd-0.001-8"] == "sgd clip=1"


def test_equivalent_references_follow_the_theory():
    runs, _ = synthetic(c_values=(1.0, 8.0), lrs=(1e-3, 8e-3))
    adamw_eps = runs[(runs.optimizer == "adamw") & (runs.c_eff == 1.0)].iloc[0].to_dict()
    runs.loc[len(runs)] = {**adamw_eps, "run": "adamw-eps/8", "eps": 1e-8 / 8}
    runs.loc[len(runs)] = {**adamw_eps, "run": "adamw-clipped-8", "scale": 8.0, "c_eff": 8.0, "clip": 1.0}
    pairs = {(r.run, r.equivalent) for r in equivalent_references(runs).itertuples()}
    assert ("sgd-0.001-8", "sgd-0.008-1") in pairs  # SGD(lr, 8) == SGD(8 lr, 1)
    assert ("adamw-0.001-8", "adamw-eps/8") in pairs  # AdamW(8, eps) == AdamW(1, eps/8)
    assert ("sgd-0.008-8", "sgd-0.001-1") not in pairs and not any(r == "adamw-clipped-8" for r, _ in pairs)
    # clipped at M, the twin clips at M / c too; eps / c alone is no twin once the loop clips
    runs.loc[len(runs)] = {**adamw_eps, "run": "adamw-eps/8-clip/8", "eps": 1e-8 / 8, "clip": 1.0 / 8}
    runs.loc[len(runs)] = {**adamw_eps, "run": "adamw-eps/8-clip", "eps": 1e-8 / 8, "clip": 1.0}
    rules = {(r.run, r.equivalent): r.rule for r in equivalent_references(runs).itertuples()}
    assert rules[("adamw-clipped-8", "adamw-eps/8-clip/8")] == (
        "AdamW(c=8, eps=1e-8, max_norm=1) == AdamW(c=1, eps=1.25e-9, max_norm=0.125), up to torch's 1e-6 in the clip")
    assert ("adamw-clipped-8", "adamw-eps/8-clip") not in rules and ("adamw-0.001-8", "adamw-eps/8") in rules
    # without the fix SGD at lr 8e-3 sees c = 1/8: the same steps as SGD at lr 1e-3 with it
    sgd = runs[runs.run == "sgd-0.008-1"].iloc[0].to_dict()
    runs.loc[len(runs)] = {**sgd, "run": "sgd-0.008-nofix", "fix": False, "c_eff": 1 / 8,
                           "normalization": "global_tokens_no_world_fix"}
    pairs = {(r.run, r.equivalent) for r in equivalent_references(runs).itertuples()}
    assert ("sgd-0.008-nofix", "sgd-0.001-1") in pairs


def test_crossing_and_clipping_theory():
    c = [1e-4, 1e-2, 1.0, 100.0]
    # log-log between (1e-2, 6.5e-3) and (1e-4, 0.15): 0.05 is crossed near 5e-4
    assert theory.crossing(c, [0.15, 6.5e-3, 0.0, 5e-5], 0.05) == pytest.approx(5.0e-4, rel=0.02)
    assert math.isnan(theory.crossing(c, [0.15, 6.5e-3, 0.0, 5e-5], 0.05, side="above"))
    assert theory.crossing(c, [0.0, 0.0, 0.0, float("inf")], 0.05, side="above") == 100.0  # diverged: no slope
    # report.md says which values are interpolated, and from what
    assert crossing_cell(c, [0.15, 6.5e-3, 0.0, 5e-5], 0.05, "below") == "≈5.01e-4 (interpolated, 1e-4..0.01)"
    assert crossing_cell(c, [0.0, 0.0, 0.0, float("inf")], 0.05, "above") == "100 (grid point)"
    assert crossing_cell(c, [0.15, 6.5e-3, 0.0, 5e-5], 0.05, "above") == "-"
    norms = [0.5, 1.0, 2.0, 4.0]
    assert theory.clipping_band(norms, 1.0) == (0.25, 2.0)
    assert theory.clipped_share(0.3, norms, 1.0) == 0.25 and theory.clipped_share(3.0, norms, 1.0) == 1.0


def test_eps_collapse_and_clipping_figures():
    runs, curves = synthetic(optimizers=("adamw",), c_values=(1.0, 8.0, 64.0))
    other = runs.assign(eps=1e-6, run=runs.run + "-eps6")
    curves = pd.concat([curves, curves.assign(run=curves.run + "-eps6")], ignore_index=True)
    runs = pd.concat([runs, other], ignore_index=True)
    fig = plots.eps_collapse(runs)
    lines = fig.axes[0].get_lines()  # groups sorted by eps: 1e-8, then 1e-6
    assert len(lines) == 2 and np.allclose(lines[1].get_xdata(), [1 / 1e-6, 8 / 1e-6, 64 / 1e-6])
    assert np.allclose(lines[0].get_ydata(), [5.0, 8.0, 11.0])  # final losses
    clipped = runs[runs.eps == 1e-8].assign(clip=1.0, clipped_steps=[0, 2, 5], setup="adamw clip=1")
    fig = plots.clipping(clipped, curves)
    measured, predicted = fig.axes[0].get_lines()[:2]
    assert np.allclose(measured.get_ydata(), [0, 0.4, 1.0])
    # the reference's norms are 1.0 .. 1.4: at c = 1 four of five steps exceed max_norm = 1, at c = 64 all do
    assert predicted.get_ydata()[0] == pytest.approx(0.8) and predicted.get_ydata()[-1] == 1.0
    coefs = pd.concat([curves, pd.DataFrame(
        [(r, step, "train/clip_coef", min(1.0, 1 / (c * (1 + 0.1 * step))))
         for r, c in zip(clipped.run, clipped.c_eff) for step in range(5)], columns=curves.columns)])
    fig = plots.clip_coefficient(clipped, coefs)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert len(lines) == 3
    assert np.allclose(lines["adamw-0.001-1"].get_ydata(), [1 / (1 + 0.1 * step) for step in range(5)])  # c = 1
    legend = [" ".join(t.get_text().split()) for t in fig.legends[0].get_texts()]  # the legend wraps long labels
    steps = int(clipped.steps_done.iloc[0])
    assert any(text.endswith(f"clipped at {steps} of {steps} steps (100%)") for text in legend), legend
    # one clipped step in 600 is not "0%": the summary's count, every step, not only the logged ones
    assert plots.clipped_steps_label(SimpleNamespace(clipped_steps=1, steps_done=600)) == "1 of 600 steps (0.2%)"
    assert plots.clipped_steps_label(SimpleNamespace(clipped_steps=599, steps_done=600)) == "599 of 600 steps (99.8%)"
    assert plots.clipped_steps_label(SimpleNamespace(clipped_steps=0, steps_done=600)) == "0 of 600 steps (0%)"
    unfinished = SimpleNamespace(clipped_steps=float("nan"), steps_done=float("nan"))
    assert plots.clipped_steps_label(unfinished) == "? steps (no summary.json: the run has not finished)"


def test_torn_last_line_is_tolerated(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n" + '{"step": 1, "train/lo')
    assert read_jsonl(path) == [{"step": 0, "train/loss": 1.0}]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, cache_dir):
    import os
    import subprocess
    import sys

    from tests.conftest import OFFLINE_ENV, ROOT

    sweep = tmp_path_factory.mktemp("analysis") / "sweep"
    args = ["-m", "optimizer=sgd,adamw", "optimizer.lr=1e-3,1e-2", "scale=1,8", "fix=true", *TINY, "adam_stats_every=2",
            f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-m", "gradscale.run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


def test_load_a_real_sweep(tiny_sweep):
    runs, curves = load(tiny_sweep)
    assert len(runs) == 8 and set(runs.status) == {"completed"}
    assert set(runs.c_eff) == {1.0, 8.0}
    assert {"train/loss", "train/grad_norm", "eval/loss", "adam/sqrt_v_rms"} <= set(curves.metric)
    # an interrupted run (no summary) is kept, with that status
    (runs.path.map(Path).iloc[0] / "summary.json").unlink()
    runs, _ = load(tiny_sweep)
    assert runs.status.iloc[0] == "interrupted"
    assert runs.c_eff.iloc[0] == runs.scale.iloc[0]  # from the config's rule when summary.json is missing


def test_load_takes_c_eff_and_the_normalization_from_summary_json(tiny_sweep, tmp_path):
    """What the run trained with is what summary.json says; folders written before the rename carry
    effective_scale."""
    sweep = tmp_path / "sweep"
    shutil.copytree(tiny_sweep, sweep)
    runs, _ = load(sweep)
    summary_file = Path(runs.path.iloc[1]) / "summary.json"
    summary = json.loads(summary_file.read_text())
    assert summary["c_eff"] == runs.c_eff.iloc[1] and summary["normalization"] == runs.normalization.iloc[1]
    summary["effective_scale"] = 0.25
    del summary["c_eff"]
    summary["normalization"] = "global_tokens_no_world_fix"
    summary_file.write_text(json.dumps(summary))
    runs, _ = load(sweep)
    assert runs.c_eff.iloc[1] == 0.25 and runs.normalization.iloc[1] == "global_tokens_no_world_fix"


@pytest.mark.parametrize("what", ["loss", "update"])
def test_token_frequency_plots_draw_each_bucket_against_the_reference(tiny_sweep, what):
    runs, curves = load(tiny_sweep)
    fig = plots.token_frequency(runs, curves, what)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible() and ax.get_title()}
    assert [title.split()[:2] for title in panels] == [[f"{o}:", b] for o in ("sgd", "adamw")
                                                       for b in ("unseen", "rare", "middle", "frequent")]
    paired = [(r, ref) for r, ref in zip(runs.run, pair_references(runs)) if ref is not None and ref != r]
    rare = {o: panels[next(t for t in panels if t.startswith(f"{o}: rare"))] for o in ("sgd", "adamw")}
    drawn = {line.get_label(): line for ax in rare.values() for line in ax.get_lines()
             if line.get_gid() != "level"}  # 0 (loss) or 1 (update): no run
    assert len(drawn) == len(paired) == 4
    run, ref = paired[0]
    assert drawn[run] in rare[runs.set_index("run").optimizer[run]].get_lines()  # in its optimizer's panel
    metric = "eval/loss_rare" if what == "loss" else "train/output_update_rms_rare"
    expected = curve(curves, run, metric) - curve(curves, ref, metric) if what == "loss" else \
        curve(curves, run, metric) / curve(curves, ref, metric)
    assert np.allclose(drawn[run].get_ydata(), expected.dropna().to_numpy())


def test_report_writes_figures_and_markdown(tiny_sweep, tmp_path):
    from gradscale.analysis.report import main

    assert main([str(tiny_sweep), "--out", str(tmp_path / "report")]) == 0
    out = tmp_path / "report"
    expected = {"loss_curves", "divergence", "grad_norm_ratio", "breakdown", "lr_separation", "final_loss_heatmap",
                "adam_state", "lr_axis", "token_frequency_loss", "token_frequency_update", "advisor_along_run"}
    assert {p.stem for p in out.glob("*.png")} == expected
    report = (out / "report.md").read_text()
    assert "## Per setup and scale" in report and report.count("| adamw |") >= 4
    summary = pd.read_csv(out / "summary.csv")
    scaled = summary[(summary.scale == 8) & summary["reference"].notna()]
    assert np.allclose(scaled["grad-norm ratio @ step 0"], 8.0, rtol=1e-5)


def test_report_skips_figures_that_do_not_apply(tmp_path, cli):
    sweep = tmp_path / "one"
    assert cli(["-m", "scale=8", "fix=true", *TINY, f"hydra.sweep.dir={sweep}"]).returncode == 0
    from gradscale.analysis.report import main

    assert main([str(sweep), "--out", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    assert "`divergence`: skipped, no run pairs with a reference" in report
    assert (tmp_path / "r" / "loss_curves.png").exists() and not (tmp_path / "r" / "divergence.png").exists()


def test_report_on_a_missing_folder_is_one_line_error(tmp_path, capsys):
    from gradscale.analysis.report import main

    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} does not exist"


def test_report_refuses_an_out_it_cannot_write_before_any_figure(tiny_sweep, tmp_path, capsys):
    from gradscale.analysis.report import main

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main([str(tiny_sweep), "--out", str(blocker / "report")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out={str(blocker / 'report')!r} cannot be written: "
                                               f"{blocker} is not a folder")
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]  # nothing written


@pytest.mark.parametrize("name", ["01_world_size_fix", "02_adam_invariance_breakdown"])
def test_notebooks_execute_headless_on_a_tiny_sweep(tiny_sweep, tmp_path, name):
    import nbformat

    from gradscale.analysis.notebook import execute
    from tests.conftest import ROOT

    out = execute(ROOT / "gradscale" / "analysis" / "notebooks" / f"{name}.py", tiny_sweep, tmp_path / f"{name}.ipynb")
    notebook = nbformat.read(out, as_version=4)
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors and len(images) >= 2


def test_notebook_command_writes_into_the_sweep_never_over_the_committed_notebook(tiny_sweep, tmp_path, capsys):
    from gradscale.analysis.notebook import main
    from tests.conftest import ROOT

    committed = ROOT / "gradscale" / "analysis" / "notebooks" / "01_world_size_fix.ipynb"
    before = committed.read_bytes()
    sweep = tmp_path / "sweep"
    shutil.copytree(tiny_sweep, sweep)
    assert main([str(ROOT / "gradscale" / "analysis" / "notebooks" / "01_world_size_fix.py"), str(sweep)]) == 0
    assert (sweep / "notebooks" / "01_world_size_fix.ipynb").is_file()
    assert capsys.readouterr().out.strip() == f"wrote {sweep / 'notebooks' / '01_world_size_fix.ipynb'}"
    assert committed.read_bytes() == before


def test_notebook_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    from gradscale.analysis.notebook import main
    from tests.conftest import ROOT

    notebook = str(ROOT / "gradscale" / "analysis" / "notebooks" / "01_world_size_fix.py")
    assert main([notebook, str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} is not a sweep folder (it does not exist)"
    assert main([str(tmp_path / "nope.py"), str(tmp_path)]) == 2
    assert "is not a notebook" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # a folder without runs: the notebook's first cell fails, nothing is written
    assert main([notebook, str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 01_world_size_fix.py failed on") and "\n" not in err
    assert not (tmp_path / "empty" / "notebooks").exists() or not any((tmp_path / "empty" / "notebooks").iterdir())
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--out" in capsys.readouterr().out


def test_report_logs_one_offline_wandb_analysis_run(tiny_sweep, tmp_path, monkeypatch):
    from gradscale.analysis.report import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([str(tiny_sweep), "--out", str(tmp_path / "r"), "--wandb"]) == 0
    offline_runs = list((tmp_path / "r" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb"))


def test_share_below_reads_the_distribution_off_the_quantiles():
    from gradscale.theory import share_below

    q = {"q01": 1e-9, "q10": 1e-8, "q50": 1e-6, "q90": 1e-4, "q99": 1e-3}
    assert share_below(q, 1e-8) == pytest.approx(0.10)
    assert share_below(q, 1e-7) == pytest.approx(0.30)  # halfway between q10 and q50 in log s
    assert share_below(q, 1e-12) == pytest.approx(0.01) and share_below(q, 1.0) == pytest.approx(0.99)  # bounds
    assert share_below({k: 0.0 for k in q}, 1e-8) == 1.0


@pytest.mark.parametrize(("name", "group"), [
    ("model.embed_tokens.weight", "embeddings / output"), ("lm_head.weight", "embeddings / output"),
    ("model.layers.3.self_attn.k_proj.weight", "attention"), ("model.layers.0.mlp.down_proj.weight", "MLP"),
    ("model.layers.1.input_layernorm.weight", "norms"), ("model.norm.weight", "norms"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "attention"),
])
def test_tensor_groups(name, group):
    from gradscale.theory import tensor_group

    assert tensor_group(name) == group


def test_seed_band_reads_each_difference_in_units_of_the_seeds_spread():
    from gradscale.analysis.tables import seed_band_table, seed_siblings

    runs, curves = synthetic(c_values=(1.0, 0.125), optimizers=("adamw",))
    fixed = runs.iloc[0]
    repeats = pd.DataFrame([{**fixed.to_dict(), "run": f"seed{s}", "seed": s} for s in (1, 2)])
    runs = pd.concat([runs, repeats], ignore_index=True)
    # eval/loss at steps 0..4: the seed-0 reference, two repeats 0.02 above and below, the bug run 0.05 above
    rows = [(name, step, "eval/loss", 3.0 - 0.1 * step + offset) for step in range(5) for name, offset in
            (("adamw-0.001-1", 0.0), ("seed1", 0.02), ("seed2", -0.02), ("adamw-0.001-0.125", 0.05))]
    curves = pd.concat([curves, pd.DataFrame(rows, columns=curves.columns)], ignore_index=True)
    assert sorted(seed_siblings(runs)["adamw-0.001-1"]) == ["adamw-0.001-1", "seed1", "seed2"]
    band = seed_band_table(runs, curves, ["eval/loss", "eval/loss_rare"])  # no bucket curves: no row for it
    assert len(band) == 1
    row = band.iloc[0]
    assert row.run == "adamw-0.001-0.125" and row.step == 4 and row.seeds == 3
    assert row.difference == pytest.approx(0.05) and row["seed std"] == pytest.approx(0.02)
    assert row["difference / std"] == pytest.approx(2.5) and row["max |difference| / std"] == pytest.approx(2.5)
    # an eps / N repair of the bug is read against the run the theory calls it equal to
    repair = {**runs.iloc[1].to_dict(), "run": "repair", "eps": 1.25e-9}
    runs = pd.concat([runs, pd.DataFrame([repair])], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([("repair", step, "eval/loss", 3.0 - 0.1 * step + 0.001)
                                              for step in range(5)], columns=curves.columns)], ignore_index=True)
    band = seed_band_table(runs, curves, ["eval/loss"]).set_index("run")
    assert band.loc["repair", "difference / std"] == pytest.approx(0.05)
    # a reference in another precision, without repeats of its own, is read against the banded one's seeds;
    # one that also differs in lr is not
    control = {**fixed.to_dict(), "run": "bf16", "precision": "bf16"}
    other = {**control, "run": "bf16-lr", "lr": 1e-2}
    runs = pd.concat([runs, pd.DataFrame([control, other])], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([(name, step, "eval/loss", 3.0 - 0.1 * step - 0.03) for step in range(5)
                                              for name in ("bf16", "bf16-lr")], columns=curves.columns)],
                       ignore_index=True)
    band = seed_band_table(runs, curves, ["eval/loss"]).set_index("run")
    assert band.loc["bf16", "difference / std"] == pytest.approx(-1.5) and "bf16-lr" not in band.index
    # so is one whose bf16 products ran by fp32 kernels: a contrast, not a fourth seed of the band
    kernels = {**fixed.to_dict(), "run": "fp32-kernels", "bf16_matmul": "fp32"}
    runs = pd.concat([runs, pd.DataFrame([kernels])], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([("fp32-kernels", step, "eval/loss", 3.0 - 0.1 * step + 0.01)
                                              for step in range(5)], columns=curves.columns)], ignore_index=True)
    band = seed_band_table(runs, curves, ["eval/loss"]).set_index("run")
    assert band.loc["fp32-kernels", "difference / std"] == pytest.approx(0.5)
    assert (band.seeds == 3).all() and seed_siblings(runs)["fp32-kernels"] == ["fp32-kernels"]
    # an attempted repair no theory calls equal (eps / N alone where the loop clips) is read against the fixed
    # run it means to reproduce: the banded one at the same max_norm, not at another
    clipped = runs.assign(clip=1.0)
    eps_only = {**clipped.loc[clipped.run == "adamw-0.001-0.125"].iloc[0].to_dict(), "run": "eps-only", "eps": 1.25e-9}
    elsewhere = clipped[clipped.run.isin(["adamw-0.001-1", "seed1", "seed2"])].assign(
        clip=2.0, run=lambda d: d.run + "-clip2")
    runs = pd.concat([clipped, pd.DataFrame([eps_only]), elsewhere], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([("eps-only", step, "eval/loss", 3.0 - 0.1 * step + 0.04)
                                              for step in range(5)], columns=curves.columns)], ignore_index=True)
    other_eps = {**eps_only, "run": "other-eps", "eps": 3e-9}  # no reference has its twin's eps, 2.4e-8
    runs = pd.concat([runs, pd.DataFrame([other_eps])], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([("other-eps", step, "eval/loss", 3.0) for step in range(5)],
                                             columns=curves.columns)], ignore_index=True)
    band = seed_band_table(runs, curves, ["eval/loss"]).set_index("run")
    assert band.loc["eps-only", "reference"] == "adamw-0.001-1" and "other-eps" not in band.index
    assert band.loc["eps-only", "difference / std"] == pytest.approx(2.0)
    # the bug at another world size stands against the fixed run at this one: a reference's gradient is the
    # global token mean however many ranks split the batch
    n2 = {**eps_only, "run": "n2", "eps": 1e-8, "world_size": 2, "c_eff": 0.5}
    runs = pd.concat([runs, pd.DataFrame([n2])], ignore_index=True)
    curves = pd.concat([curves, pd.DataFrame([("n2", step, "eval/loss", 3.0 - 0.1 * step + 0.01) for step in range(5)],
                                             columns=curves.columns)], ignore_index=True)
    band = seed_band_table(runs, curves, ["eval/loss"]).set_index("run")
    assert band.loc["n2", "reference"] == "adamw-0.001-1" and band.loc["n2", "difference / std"] == pytest.approx(0.5)
    # one seed only: no band, no rows
    assert seed_band_table(runs[~runs.run.isin(["seed1", "seed2"])], curves, ["eval/loss"]).empty


def test_read_jsonl_reads_a_gzipped_file_beside_the_name(tmp_path):
    import gzip

    records = [{"step": 0, "x": 1.5}, {"step": 1, "x": 2.5}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "adam_stats.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert read_jsonl(tmp_path / "adam_stats.jsonl") == records
    (tmp_path / "adam_stats.jsonl").write_text(text + '{"step": 2, "x"')  # the plain file wins; torn line skipped
    assert read_jsonl(tmp_path / "adam_stats.jsonl") == records
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_token_frequency_loss_shades_two_seed_standard_deviations_around_the_reference():
    runs, curves = synthetic(c_values=(1.0, 8.0), optimizers=("adamw",))
    repeats = runs[runs.scale == 1.0].copy()
    rows = []
    for seed, offset in ((0, 0.0), (1, 0.01), (2, -0.03)):  # the reference repeated at other data orders
        if seed:
            repeat = repeats.assign(seed=seed, run=f"adamw-seed{seed}")
            runs = pd.concat([runs, repeat], ignore_index=True)
        name = "adamw-0.001-1" if seed == 0 else f"adamw-seed{seed}"
        rows += [(name, step, "eval/loss_rare", 3.0 + offset) for step in (2, 4)]
    rows += [("adamw-0.001-8", step, "eval/loss_rare", 3.05) for step in (2, 4)]
    curves = pd.concat([curves, pd.DataFrame(rows, columns=curves.columns)], ignore_index=True)
    fig = plots.token_frequency(runs, curves, "loss")
    rare = next(ax for ax in fig.axes if ax.get_title().startswith("rare"))
    band, = [c for c in rare.collections if c.get_gid() == "seed band"]
    std = np.std([0.0, 0.01, -0.03], ddof=1)
    assert np.isclose(band.get_paths()[0].vertices[:, 1].max(), 2 * std)  # ±2 std of the three seeds, around 0
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(t.startswith("±2 seed standard deviations around the reference (3 seeds") for t in legend)
    control = runs[(runs.scale == 1.0) & (runs.seed == 0)].assign(run="adamw-bf16", precision="bf16")
    rows = [("adamw-bf16", step, "eval/loss_rare", 2.98) for step in (2, 4)]
    fig = plots.token_frequency(pd.concat([runs, control], ignore_index=True),
                                pd.concat([curves, pd.DataFrame(rows, columns=curves.columns)], ignore_index=True))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "precision=bf16 against precision=fp32, the same seed (exactly -0.02 throughout)" in legend
    rare = next(ax for ax in fig.axes if ax.get_title().startswith("rare"))
    assert [ln for ln in rare.lines if np.allclose(ln.get_ydata(), -0.02)]  # the contrast minus its seed-0 reference
    runs_without_repeats = runs[runs.seed == 0]
    assert not [c for ax in plots.token_frequency(runs_without_repeats, curves, "loss").axes
                for c in ax.collections if c.get_gid() == "seed band"]
    # a second banded reference (clipped, two seeds) shares the panels: each band its own fill and legend entry
    clipped = runs[runs.scale == 1.0].assign(clip=4.2, setup="adamw clip=4.2")
    clipped = clipped.assign(run=[f"clipped-seed{seed}" for seed in clipped.seed])
    clipped_bug = runs[runs.scale == 8.0].assign(clip=4.2, setup="adamw clip=4.2", run="clipped-8")
    rows = [(f"clipped-seed{seed}", step, "eval/loss_rare", 3.0 + 0.02 * seed) for seed in (0, 1) for step in (2, 4)]
    rows += [("clipped-8", step, "eval/loss_rare", 3.1) for step in (2, 4)]
    fig = plots.token_frequency(pd.concat([runs, clipped[clipped.seed < 2], clipped_bug], ignore_index=True),
                                pd.concat([curves, pd.DataFrame(rows, columns=curves.columns)], ignore_index=True))
    rare = next(ax for ax in fig.axes if ax.get_title().startswith("rare"))
    bands = [c for c in rare.collections if c.get_gid() == "seed band"]
    assert len(bands) == 2 and bands[0].get_hatch() != bands[1].get_hatch()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [t for t in legend if t.startswith("±2 seed standard deviations around adamw (3 seeds")]
    assert [t for t in legend if t.startswith("±2 seed standard deviations around adamw clip=4.2 (2 seeds")]
    assert undrawn_swatches(fig) == []


def test_a_setup_without_a_reference_gets_no_empty_panel_and_seed_repeats_stay_off_the_eps_curve():
    runs, curves = synthetic(c_values=(1.0, 8.0), optimizers=("adamw",))
    lone = runs[runs.scale == 8.0].assign(run="adamw-eps-lone", eps=1.25e-9, setup="adamw eps=1.25e-9")
    repeat = runs[runs.scale == 1.0].assign(run="adamw-seed1", seed=1, final_loss=4.0)
    runs = pd.concat([runs, lone, repeat], ignore_index=True)
    for name in ("adamw-eps-lone", "adamw-seed1"):
        curves = pd.concat([curves, curves[curves.run == "adamw-0.001-8"].assign(run=name)], ignore_index=True)
    for maker in (plots.divergence, plots.grad_norm_ratio):
        panels = [ax.get_title() for ax in maker(runs, curves).axes if ax.get_visible()]
        assert panels == ["adamw"], panels  # not a second, empty panel for the setup with no reference
    collapse = plots.eps_collapse(runs).axes[0]
    assert 4.0 not in {y for line in collapse.get_lines() for y in line.get_ydata()}  # the seed-1 repeat
    # another precision is a line of its own, not a point on the same eps's line
    control = runs[(runs.scale == 1.0) & (runs.seed == 0)].assign(run="adamw-bf16", precision="bf16", final_loss=3.0)
    fig = plots.eps_collapse(pd.concat([runs, control], ignore_index=True))
    bf16, = [line for line in fig.axes[0].get_lines() if 3.0 in line.get_ydata()]
    assert len(bf16.get_xdata()) == 1
    assert "adamw eps=1e-8 bf16" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_a_legend_label_longer_than_the_figure_wraps_inside_it():
    fig = matplotlib.figure.Figure(figsize=(6.0, 3.6))
    fig.subplots()
    label = " ".join(["a_long_setup_name"] * 12)  # 215 characters: more than twice as wide as the figure
    plots._legend(fig, [plots._handle(label, {"color": "k", "ls": "-", "marker": "o"})])
    text, = fig.legends[0].get_texts()
    assert text.get_text().replace("\n  ", " ") == label
    assert max(plots._text_points(line) for line in text.get_text().split("\n")) <= 6.0 * 72 - 60


def test_advisor_along_run_draws_predicted_and_measured_per_run():
    runs, _ = synthetic(optimizers=("adamw",), c_values=(1.0, 0.125))
    advisor = pd.DataFrame([{"run": "adamw-0.001-0.125", "setup": "adamw", "c_eff": 0.125, "step": step, "predicted": p,
                             "measured": m, "error": p / m - 1} for step, p, m in ((0, 0.97, 0.96), (50, 0.91, 0.92))])
    fig = plots.advisor_along_run(advisor, runs)
    measured, predicted = [line for line in fig.axes[0].get_lines() if line.get_linestyle() != ":"]
    assert list(measured.get_ydata()) == [0.96, 0.92] and list(predicted.get_ydata()) == [0.97, 0.91]
    assert predicted.get_linestyle() == "--"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    worst = max(abs(0.97 / 0.96 - 1), abs(0.91 / 0.92 - 1))
    assert legend == [f"adamw scale=0.125: largest |predicted / measured - 1| {plots.short_number(worst, 2)}"]



def with_buckets(runs: pd.DataFrame, curves: pd.DataFrame, spread: dict[str, float]) -> pd.DataFrame:
    """curves plus held-out loss and output-row update per token-frequency bucket at steps 2 and 4, each run off
    its reference by log2(c) x spread[optimizer]: SGD's differences orders larger than AdamW's."""
    from gradscale.records import BUCKETS, eval_loss_of, output_update_rms_of

    rows = [(r.run, step, metric(bucket), base + spread[r.optimizer] * math.log2(r.c_eff) * step)
            for r in runs.itertuples() for step in (2, 4) for bucket in BUCKETS
            for metric, base in ((eval_loss_of, 3.0), (output_update_rms_of, 1.0))]
    return pd.concat([curves, pd.DataFrame(rows, columns=curves.columns)], ignore_index=True)


def run_looks(fig) -> dict[str, tuple]:
    """Each run's (colour, marker, line style) in a figure, read off the lines labelled with its name; a run
    drawn in two looks in one figure fails here."""
    looks: dict[str, set] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                looks.setdefault(line.get_label(), set()).add(
                    (matplotlib.colors.to_hex(line.get_color()), line.get_marker(), line.get_linestyle()))
    assert all(len(seen) == 1 for seen in looks.values()), looks
    return {run: seen.pop() for run, seen in looks.items()}


def undrawn_swatches(fig) -> list[str]:
    """Legend entries whose swatch matches nothing drawn: a coloured one (a run's) no artist in its colour, a
    band's (a patch, or a line 5 points wide or more) no shaded area in its colour (a hatched one: in its
    hatch); a black or grey one (a key to a shape: the x of a diverged run, the dotted c_eff, the hollow floor
    marker, drawn in each run's colour) no line with its line style, marker or hollow marker."""
    def color(c) -> str:
        return matplotlib.colors.to_hex(c, keep_alpha=False)

    def shapes(line) -> set:
        return ({("ls", line.get_linestyle())} - {("ls", "None")}) | ({("marker", line.get_marker())} - {
            ("marker", "None"), ("marker", "")}) | ({("hollow",)} if line.get_markerfacecolor() == "none" else set())

    colours, shaded, drawn_shapes = set(), set(), set()
    for ax in fig.axes:
        lines = [line for line in ax.get_lines() if len(line.get_xdata())]
        colours |= {color(line.get_color()) for line in lines} | {color(line.get_markeredgecolor()) for line in lines}
        shaded |= {color(patch.get_facecolor()) for patch in ax.patches}
        shaded |= {color(fc) for c in ax.collections for fc in c.get_facecolor()}
        shaded |= {("hatch", c.get_hatch()) for c in ax.collections if c.get_hatch()}  # an unfilled band
        drawn_shapes |= {shape for line in lines for shape in shapes(line)}
    missing = []
    for handle, text in zip(fig.legends[0].legend_handles, fig.legends[0].get_texts()):
        if isinstance(handle, matplotlib.lines.Line2D) and handle.get_linewidth() < 5:
            if not shapes(handle):
                continue  # text alone: a note
            rgb = matplotlib.colors.to_rgb(handle.get_color())
            drawn = shapes(handle) & drawn_shapes if max(rgb) == min(rgb) else {color(handle.get_color())} & colours
        elif isinstance(handle, matplotlib.patches.Patch) and handle.get_hatch():
            drawn = {("hatch", handle.get_hatch())} & shaded
        else:
            drawn = {color(handle.get_color() if isinstance(handle, matplotlib.lines.Line2D)
                           else handle.get_facecolor())} & shaded
        if not drawn:
            missing.append(text.get_text())
    return missing


def test_each_run_wears_one_look_in_every_figure_and_none_shares_it():
    """The colour mapping across figures: a run's colour, marker and line style are one in loss_curves,
    divergence, grad_norm_ratio, adam_state and token_frequency, whatever each figure draws first (divergence
    leaves the references out; adam_state the SGD runs), and no two runs share them."""
    runs, curves = synthetic(c_values=(1.0, 8.0))
    bug = runs[runs.scale == 8.0].assign(run=lambda t: t.run + "-nofix", scale=1.0, fix=False, c_eff=1 / 8,
                                         normalization="global_tokens_no_world_fix")
    curves = pd.concat([curves, curves[curves.run.isin(runs.run[runs.scale == 8.0])].assign(
        run=lambda t: t.run + "-nofix")], ignore_index=True)
    runs = pd.concat([runs, bug], ignore_index=True)
    curves = with_buckets(runs, curves, {"sgd": 0.5, "adamw": 1e-3})
    figures = {"loss_curves": plots.loss_curves(runs, curves), "divergence": plots.divergence(runs, curves),
               "grad_norm_ratio": plots.grad_norm_ratio(runs, curves), "adam_state": plots.adam_state(runs, curves),
               "token_frequency": plots.token_frequency(runs, curves, "loss")}
    looks = {name: run_looks(fig) for name, fig in figures.items()}
    everyone = looks["loss_curves"]
    assert set(everyone) == set(runs.run) and len(set(everyone.values())) == len(runs)  # one look per run
    for name, seen in looks.items():
        assert seen and {run: everyone[run] for run in seen} == seen, name
    assert "sgd-0.001-1" not in looks["divergence"]  # a reference is not drawn against itself
    assert set(looks["adam_state"]) == set(runs.run[runs.optimizer == "adamw"])
    # a line through several runs wears one of theirs: the breakdown's sgd line, its reference's
    breakdown = plots.breakdown(runs, curves)
    sgd_line = next(line for line in breakdown.axes[0].get_lines() if line.get_gid() is None)
    assert (matplotlib.colors.to_hex(sgd_line.get_color()), sgd_line.get_marker()) == everyone["sgd-0.001-1"][:2]


def test_an_adam_state_panel_of_zeros_is_left_out_and_a_tiny_share_is_rescaled():
    runs, curves = synthetic(optimizers=("adamw",))
    share = curves.metric == "adam/eps_dominated_frac"
    curves.loc[share, "value"] = 0.0  # no coordinate eps-dominated (the default sweep's tiny model)
    fig = plots.adam_state(runs, curves)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["update RMS"]
    assert "share's panel left out" in fig.get_suptitle()
    curves.loc[share, "value"] = curves.loc[share, "step"] * 1e-6  # up to 4e-6: drawn from 0 to it, not on 1%
    share_ax = next(ax for ax in plots.adam_state(runs, curves).axes if ax.get_title() == "eps-dominated share")
    assert share_ax.get_ylim() == pytest.approx((0, 1.1 * 4e-6))


def test_token_frequency_gives_each_optimizer_its_own_y_axis():
    """SGD's bucket differences are 500 times AdamW's here: on one axis AdamW's lines would lie on the 0 line."""
    runs, curves = synthetic(c_values=(1.0, 8.0))
    curves = with_buckets(runs, curves, {"sgd": 0.5, "adamw": 1e-3})
    for what, level in (("loss", 0.0), ("update", 1.0)):
        fig = plots.token_frequency(runs, curves, what)
        panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert list(panels) == [f"{o}: {b}" for o in ("sgd", "adamw") for b in (
            "unseen (0 times)", "rare (1-9 times)", "middle (10-99 times)", "frequent (>= 100 times)")]
        adamw, sgd = panels["adamw: rare (1-9 times)"], panels["sgd: rare (1-9 times)"]
        assert not adamw.get_shared_y_axes().joined(adamw, sgd)
        assert adamw.get_shared_y_axes().joined(adamw, panels["adamw: frequent (>= 100 times)"])
        low, high = adamw.get_ylim()  # AdamW's largest difference (3e-3 x 4 steps) fills its axis
        assert high - low < 0.05 and max(abs(low - level), abs(high - level)) > 0.01
        assert sgd.get_ylim()[1] - sgd.get_ylim()[0] > 1


def test_breakdown_draws_an_exact_zero_on_the_floor_and_joins_no_line_through_it():
    """Three runs at c = 1/8, 1, 8, the middle one the reference (exactly 0): no V through the floor."""
    runs, curves = synthetic(c_values=(0.125, 1.0, 8.0), optimizers=("adamw",))
    fig = plots.breakdown(runs, curves, bands={"adamw": (1e-5, 1e-4)}, onsets={"adamw": 1e-3})
    ax = fig.axes[0]
    line, = [line for line in ax.get_lines() if line.get_gid() is None]
    assert list(line.get_xdata()) == [0.125, 1.0, 8.0] and np.isnan(line.get_ydata()[1])  # broken at the zero
    assert np.isfinite(line.get_ydata()[[0, 2]]).all()
    on_floor, = [line for line in ax.get_lines() if line.get_gid() == "on floor"]
    assert list(on_floor.get_xdata()) == [1.0] and list(on_floor.get_ydata()) == [plots.FLOOR]
    assert on_floor.get_markerfacecolor() == "none" and on_floor.get_linestyle() == "None"
    assert [line for line in ax.get_lines() if line.get_gid() == "floor"]  # the floor line the legend names
    # the band and the onset lie below the sweep: named in words, with no swatch, and not drawn
    legend = dict(zip([t.get_text() for t in fig.legends[0].get_texts()], fig.legends[0].legend_handles))
    band = legend["adamw: predicted band at c = 1e-5..1e-4, below this sweep's c_eff: not drawn"]
    assert band.get_linestyle() == "None" and band.get_marker() in ("None", "")
    assert not ax.patches and undrawn_swatches(fig) == []


def test_a_legend_lists_only_what_is_drawn():
    runs, curves = synthetic(c_values=(0.125, 1.0, 8.0))
    curves = with_buckets(runs, curves, {"sgd": 0.5, "adamw": 1e-3})
    for fig in (plots.loss_curves(runs, curves), plots.divergence(runs, curves), plots.grad_norm_ratio(runs, curves),
                plots.adam_state(runs, curves), plots.token_frequency(runs, curves, "loss"),
                plots.breakdown(runs, curves, bands={"adamw": (1e-2, 0.5)}, onsets={"adamw": 1e-4}),
                plots.breakdown(runs, curves, bands={"adamw": (1e-6, 1e-5)})):  # a band too far out to draw
        assert undrawn_swatches(fig) == [], fig.get_suptitle()
    # the negative control: a swatch in a colour nothing is drawn in is caught
    fig = plots.loss_curves(runs, curves)
    plots._legend(fig, [matplotlib.patches.Patch(color="#123456", label="a band not drawn")])
    fig.legends[:] = fig.legends[1:]
    assert undrawn_swatches(fig) == ["a band not drawn"]


def test_a_long_setup_name_wraps_within_its_panel_title():
    runs, curves = synthetic(c_values=(1.0, 8.0), optimizers=("sgd", "adamw"))
    long = "adamw eps=1e-8 clip=1 bf16_matmul=auto precision=bf16"  # wider than a panel at the title's size
    runs = runs.assign(setup=runs.setup.map({"sgd": "sgd", "adamw": long}))
    titles = [ax.get_title() for ax in plots.loss_curves(runs, curves).axes if ax.get_visible()]
    assert titles[0] == "sgd"
    assert titles[1].replace("\n", " ") == long and all(len(line) <= 33 for line in titles[1].split("\n"))
