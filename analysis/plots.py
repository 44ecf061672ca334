"""Pure plotting functions: tables from analysis.load in, a matplotlib Figure out."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.load import curve, pair_references
from analysis.theory import clipped_share as predicted_clipped_share

# Figures are built with matplotlib.figure.Figure, not pyplot: no global state, nothing to close, and a
# notebook shows each returned figure exactly once.


# Cycled within a panel, so that runs whose curves coincide (the point of several comparisons) stay visible.
LINE_STYLES = ("-", "--", ":", "-.")


def _label(r) -> str:
    return f"scale={r.scale:g} fix={'on' if r.fix else 'off'} (c_eff={r.c_eff:g})"


def _panels(keys, title: str, height: float = 3.6, sharey: bool = False):
    """One axes per distinct key (setup or optimizer), four to a row."""
    keys = list(dict.fromkeys(keys))
    cols = min(len(keys), 4)
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(5.2 * cols, height * rows))
    axes = fig.subplots(rows, cols, squeeze=False, sharey=sharey).flatten()
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, dict(zip(keys, axes))


def _per_setup(runs: pd.DataFrame, title: str, height: float = 3.6):
    """A panel per setup: the optimizer and whichever of finetune, eps, clip, precision vary (analysis.load)."""
    return _panels(runs.setup, title, height)


def loss_curves(runs: pd.DataFrame, curves: pd.DataFrame, metric: str = "train/loss"):
    """Training loss per optimizer, one line per scale/fix (and lr when the sweep has several)."""
    fig, axes = _per_setup(runs, f"{metric} by optimizer")
    several_lrs = runs.groupby("setup").lr.nunique().max() > 1
    for r in runs.itertuples():
        series = curve(curves, r.run, metric)
        label = _label(r) + (f" lr={r.lr:g}" if several_lrs else "")
        ax = axes[r.setup]
        ax.plot(series.index, series.to_numpy(), label=label, lw=1.4, ls=LINE_STYLES[len(ax.get_lines()) % 4])
    for name, ax in axes.items():
        ax.set(title=name, xlabel="step", ylabel=metric)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _paired(runs: pd.DataFrame):
    references = pair_references(runs)
    return [(r, references[i]) for i, r in zip(runs.index, runs.itertuples())
            if references[i] is not None and references[i] != r.run]


def divergence(runs: pd.DataFrame, curves: pd.DataFrame):
    """|loss(run) - loss(reference)| vs step, log y; reference = same run at scale 1 with the fix on."""
    fig, axes = _per_setup(runs, "|loss - loss(reference: scale 1, fix on)|")
    several_lrs = runs.groupby("setup").lr.nunique().max() > 1
    for r, ref in _paired(runs):
        delta = (curve(curves, r.run, "train/loss") - curve(curves, ref, "train/loss")).abs()
        # exact zeros cannot sit on a log axis: show them at the float32 resolution of the loss
        label = _label(r) + (f" lr={r.lr:g}" if several_lrs else "")
        axes[r.setup].plot(delta.index, delta.clip(lower=1e-7).to_numpy(), label=label, lw=1.2)
    for name, ax in axes.items():
        ax.set(title=name, xlabel="step", ylabel="|Δ loss|", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def grad_norm_ratio(runs: pd.DataFrame, curves: pd.DataFrame):
    """grad_norm(run) / grad_norm(reference) vs step: flat at exactly c_eff until the trajectories part."""
    fig, axes = _per_setup(runs, "grad norm / grad norm(reference)")
    for r, ref in _paired(runs):
        ratio = curve(curves, r.run, "train/grad_norm") / curve(curves, ref, "train/grad_norm")
        line, = axes[r.setup].plot(ratio.index, ratio.to_numpy(), label=_label(r), lw=1.2)
        axes[r.setup].axhline(r.c_eff, color=line.get_color(), ls=":", lw=0.8)
    for name, ax in axes.items():
        ax.set(title=name, xlabel="step", ylabel="ratio (dotted: c_eff)", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def max_divergence(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.Series:
    """Per run, max over steps of |loss - loss(reference)| (NaN without a reference, inf when it diverged)."""
    references = pair_references(runs)
    out = {}
    for i, r in zip(runs.index, runs.itertuples()):
        if references[i] is None or references[i] == r.run:
            out[r.run] = np.nan if references[i] is None else 0.0
            continue
        mine = curve(curves, r.run, "train/loss")
        delta = (mine - curve(curves, references[i], "train/loss")).abs()
        diverged = r.status == "diverged" or not np.isfinite(mine.to_numpy()).all()
        out[r.run] = np.inf if diverged else float(delta.max()) if len(delta.dropna()) else np.nan
    return pd.Series(out)


def breakdown(runs: pd.DataFrame, curves: pd.DataFrame, bands: dict[str, tuple[float, float]] | None = None,
              onsets: dict[str, float] | None = None):
    """Max |Δ loss| vs c_eff (log x), a line per setup (and lr); shaded in the line's colour: where the
    theory predicts that setup stops being invariant (bands: setup -> (c_start, c_end), e.g. eps/s from
    measured sqrt(v_hat) quantiles, or the clipping band); dashed: where the risk advisor predicts a 1%
    update cut (onsets: setup -> c); diverged runs as x at the top. One panel per optimizer when an
    optimizer has several setups, else one panel for all."""
    deltas = max_divergence(runs, curves)
    table = runs.assign(delta=runs.run.map(deltas)).dropna(subset=["delta"])
    one_panel = table.groupby("optimizer").setup.nunique().max() <= 1 if len(table) else True
    title = "Where scale invariance breaks down"
    fig, axes = (_panels(["all"], title, 4.2) if one_panel else _panels(table.optimizer, title, 4.2, sharey=True))
    several_lrs = table.groupby("setup").lr.nunique().max() > 1 if len(table) else False
    colors = {}
    for (setup, lr), group in table.groupby(["setup", "lr"], sort=False):
        group = group.sort_values("c_eff")
        ax = axes["all" if one_panel else group.optimizer.iloc[0]]
        label = setup + (f" lr={lr:g}" if several_lrs else "")
        finite = group[np.isfinite(group.delta)]
        line, = ax.plot(finite.c_eff, finite.delta.clip(lower=1e-7), "o-", label=label)
        diverged = group[~np.isfinite(group.delta)]
        if len(diverged):  # at the top of the data, as x
            top = max(table.delta[np.isfinite(table.delta)].max() * 3, 1.0)
            ax.plot(diverged.c_eff, [top] * len(diverged), "x", color=line.get_color(), ms=9,
                    label=f"{label}: diverged")
        colors.setdefault(setup, (ax, line.get_color()))
    for setup, (low, high) in (bands or {}).items():
        if setup in colors:
            ax, color = colors[setup]
            ax.axvspan(min(low, high), max(low, high), alpha=0.12, color=color, label=f"{setup}: predicted band")
    for setup, c in (onsets or {}).items():
        if setup in colors:
            ax, color = colors[setup]
            ax.axvline(c, color=color, ls="--", lw=1.2, label=f"{setup}: advisor's 1% update cut (c={c:.2g})")
    for name, ax in axes.items():
        ax.set(title="" if one_panel else name, xscale="log", yscale="log",
               xlabel="c_eff (effective gradient multiplier)", ylabel="max |Δ loss| vs reference (0 drawn at 1e-7)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def eps_collapse(runs: pd.DataFrame):
    """Final loss vs c_eff / eps, one line per eps: AdamW(c, eps) == AdamW(1, eps/c) says every run's
    outcome depends on c / eps alone, so the lines fall on one curve (docs/design.md physics 3). Plotted
    against the outcome itself, not a deviation from each eps's own c = 1 run, which moves with eps."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    table = runs[runs.eps.notna() & (runs.status == "completed")]
    for i, ((optimizer, eps), group) in enumerate(table.groupby(["optimizer", "eps"])):
        group = group.sort_values("c_eff")
        ax.plot(group.c_eff / eps, group.final_loss, "o" + LINE_STYLES[i % 4], label=f"{optimizer} eps={eps:g}",
                ms=7 - i, lw=1.2)
    ax.set(xscale="log", xlabel="c_eff / eps", ylabel="final loss",
           title="AdamW trades c for eps: one curve in c / eps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def clipping(runs: pd.DataFrame, curves: pd.DataFrame):
    """Share of steps clipped vs c_eff, per clipped setup: measured (dots) and predicted from the reference
    run's grad norms at c = 1 (line: share of its logged steps with c * ||g|| > max_norm)."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    references = pair_references(runs)
    clipped = runs[runs["clip"].notna() & runs.clipped_steps.notna()]
    for setup, group in clipped.groupby("setup", sort=False):
        group = group.sort_values("c_eff")
        line, = ax.plot(group.c_eff, group.clipped_steps / group.steps_done, "o", label=f"{setup}: measured")
        reference = references[group.index[0]]
        if reference is not None:
            norms = curve(curves, reference, "train/grad_norm").to_numpy()
            grid = np.logspace(np.log10(group.c_eff.min()), np.log10(group.c_eff.max()), 200)
            predicted = [predicted_clipped_share(c, norms, float(group["clip"].iloc[0])) for c in grid]
            ax.plot(grid, predicted, "-", color=line.get_color(), lw=1, label=f"{setup}: predicted")
    ax.set(xscale="log", xlabel="c_eff", ylabel="share of steps clipped", ylim=(-0.03, 1.03),
           title="Clipping: which steps are clipped at each c")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def lr_separation(runs: pd.DataFrame, curves: pd.DataFrame):
    """Max |Δ loss| against the reference vs lr, a line per setup and c_eff: how a higher learning rate
    amplifies the same gradient multiplier (docs/design.md physics 6); diverged runs as x at the top."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    deltas = max_divergence(runs, curves)
    table = runs.assign(delta=runs.run.map(deltas)).dropna(subset=["delta"])
    table = table[table.delta > 0]  # the references themselves
    finite = table.delta[np.isfinite(table.delta)]
    top = max(finite.max() * 3, 1.0) if len(finite) else 1.0
    for i, ((setup, c_eff), group) in enumerate(table.groupby(["setup", "c_eff"], sort=False)):
        group = group.sort_values("lr")
        ok = group[np.isfinite(group.delta)]
        line, = ax.plot(ok.lr, ok.delta, "o" + LINE_STYLES[i % 4], label=f"{setup} c_eff={c_eff:g}")
        bad = group[~np.isfinite(group.delta)]
        ax.plot(bad.lr, [top] * len(bad), "x", color=line.get_color(), ms=9)
    ax.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="max |Δ loss| vs reference (c = 1)",
           title="A higher lr amplifies the same multiplier (x: diverged)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def final_loss_heatmap(runs: pd.DataFrame):
    """Final loss over (lr, c_eff) per optimizer: SGD's contours run diagonal, AdamW's vertical."""
    fig, axes = _per_setup(runs, "final loss over (lr, c_eff)", height=4.0)
    for setup, ax in axes.items():
        grid = runs[runs.setup == setup].pivot_table(index="lr", columns="c_eff", values="final_loss",
                                                            aggfunc="mean")
        image = ax.imshow(grid.to_numpy(dtype=float), origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(grid.shape[1]), [f"{c:g}" for c in grid.columns], rotation=45)
        ax.set_yticks(range(grid.shape[0]), [f"{lr:g}" for lr in grid.index])
        ax.set(title=setup, xlabel="c_eff", ylabel="lr")
        fig.colorbar(image, ax=ax, label="final loss (blank: diverged)")
    fig.tight_layout()
    return fig


def adam_state(runs: pd.DataFrame, curves: pd.DataFrame):
    """eps-dominated share of coordinates and update RMS vs step, for Adam-type runs."""
    fig = Figure(figsize=(10.4, 3.8))
    frac_ax, rms_ax = fig.subplots(1, 2)
    for r in runs.itertuples():
        frac = curve(curves, r.run, "adam/eps_dominated_frac")
        if frac.empty:
            continue
        label = f"{r.setup} " + _label(r)
        frac_ax.plot(frac.index, frac.to_numpy(), label=label, lw=1.2)
        rms = curve(curves, r.run, "train/update_rms")
        rms_ax.plot(rms.index, rms.to_numpy(), label=label, lw=1.2)
    frac_ax.set(xlabel="step", ylabel="share of coordinates with sqrt(v_hat) < eps", title="eps-dominated share")
    rms_ax.set(xlabel="step", ylabel="update RMS", yscale="log", title="update RMS")
    rms_ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def lr_axis(runs: pd.DataFrame):
    """Final loss vs lr per optimizer and c_eff; diverged runs marked with x at the top."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    finite = runs.final_loss.astype(float)
    top = np.nanmax(finite.where(np.isfinite(finite))) if np.isfinite(finite).any() else 1.0
    for (setup, c_eff), group in runs.groupby(["setup", "c_eff"], sort=False):
        group = group.sort_values("lr")
        ok = group[group.status == "completed"]
        line, = ax.plot(ok.lr, ok.final_loss, "o-", label=f"{setup} c_eff={c_eff:g}")
        bad = group[group.status == "diverged"]
        ax.plot(bad.lr, [top * 1.05] * len(bad), "x", color=line.get_color(), ms=9)
    ax.set(xscale="log", xlabel="learning rate", ylabel="final loss", title="final loss vs lr (x: diverged)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
