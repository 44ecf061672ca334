"""How Adam's second moment s = sqrt(v_hat) scales with model size, and what that says about larger models.

    python -m gradscale.analysis.scaling SWEEP_DIR [SWEEP_DIR ...] [--point RUN_DIR ...] [--eps 1e-8] [--out DIR]

For every AdamW run with sqrt(v_hat) histograms (the width_scaling preset's), at its last recorded step:
the parameter count, the median and q10 of s per tensor group, and N_1%, the largest world size at which
the bug (c = 1/N) keeps the whole model's update RMS within 1% (gradscale.analysis.advise). Per series (the init,
random or pretrained, and what its sweep varies, width or depth) a power law log10(y) = a + b
log10(parameters) is fitted to each by least squares, with the slope's standard error and the 95%
prediction interval at the Llama 3.2 1B and 3B sizes. `--point` runs
(SmolLM2, a user's model) are shown beside the lines, not fitted. Writes scaling.md, scaling.csv and
scaling.png into --out (default: the first SWEEP_DIR's report/).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from gradscale.analysis.advise import WITHIN, AdviseError, load_histograms
from gradscale.analysis.plots import plain_ticks
from gradscale.checks import CommandParser
from gradscale.records import HIST_BINS_PER_DECADE
from gradscale.runs import job_dirs, render_table, short_number
from gradscale.theory import BIN_LOW, Histogram, update_rms_ratio

# parameter counts of the Llama 3.2 checkpoints (tied embeddings), for the extrapolation
LLAMA_SIZES = {"Llama 3.2 1B": 1.236e9, "Llama 3.2 3B": 3.213e9}
FITTED = ("s_median embeddings / output", "s_q10 embeddings / output", "s_median attention", "s_median MLP",
          "s_median all", "s_q10 all", "n_1pct")


def quantile(h: Histogram, q: float) -> float:
    """The q-quantile of s at bin resolution, log-linear within the bin that holds it (0 among the zeros)."""
    cumulative = np.cumsum(h.counts)
    target = q * cumulative[-1]
    b = int(np.searchsorted(cumulative, target))
    if b == 0:
        return 0.0
    inside = (target - cumulative[b - 1]) / h.counts[b]
    return float(BIN_LOW[b] * 10 ** (inside / HIST_BINS_PER_DECADE))


def critical_world_size(h: Histogram, eps: float) -> float:
    """The largest N (continuous, bisection in log N) at which the bug's c = 1/N keeps the update RMS within 1%."""
    low, high = 0.0, 12.0  # log10 N
    if update_rms_ratio(h, 10**-high, eps, eps) >= WITHIN:
        return 10**high
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if update_rms_ratio(h, 10**-mid, eps, eps) >= WITHIN else (low, mid)
    return 10**low


def measure(run_dir: Path, eps: float | None = None) -> dict:
    """One run's row: its shape, init, parameter count, s quantiles per group and N_1% at its last step."""
    run_eps, steps = load_histograms(run_dir)
    last = max(steps)
    groups = steps[last]
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml").model
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    init = "checkpoint" if cfg.path or cfg.gguf_file else cfg.init
    row = {"run": run_dir.name, "model": cfg.name, "init": init,
           "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "step": last,
           "parameters": int(groups["all"].counts.sum()), "status": summary.get("status")}
    for group, h in groups.items():
        row[f"s_median {group}"] = quantile(h, 0.5)
        row[f"s_q10 {group}"] = quantile(h, 0.1)
    row["n_1pct"] = critical_world_size(groups["all"], run_eps if eps is None else eps)
    return row


def collect(sweep_dirs: list[Path], eps: float | None = None) -> pd.DataFrame:
    """Every run's row, with its series: the init and what its sweep varies (width, depth), fitted apart."""
    rows = []
    for sweep in sweep_dirs:
        if not sweep.is_dir():
            raise AdviseError(f"error: sweep folder {str(sweep)!r} does not exist")
        sweep_rows = []
        for run_dir in job_dirs(sweep) or [sweep]:
            try:
                sweep_rows.append(measure(run_dir, eps))
            except AdviseError as e:
                print(f"skipped {run_dir}: {str(e).removeprefix('error: ')}", file=sys.stderr)
        varied = [name for key, name in (("hidden_size", "width"), ("layers", "depth"))
                  if len({r[key] for r in sweep_rows}) > 1]
        for r in sweep_rows:
            r["series"] = f"{r['init']}, {' and '.join(varied) or 'one shape'}"
        rows += sweep_rows
    if not rows:
        raise AdviseError(f"error: no AdamW run with sqrt(v_hat) histograms in {', '.join(map(str, sweep_dirs))}")
    return pd.DataFrame(rows).sort_values(["series", "parameters"]).reset_index(drop=True)


def fit_power_law(parameters: np.ndarray, values: np.ndarray) -> dict | None:
    """log10(values) = a + b log10(parameters) by least squares: a, b, b's standard error, and a function
    giving the prediction and its 95% prediction interval at new parameter counts. None below 3 points."""
    keep = np.isfinite(values) & (values > 0)
    x, y = np.log10(parameters[keep]), np.log10(values[keep])
    n = len(x)
    if n < 3 or np.ptp(x) == 0:
        return None
    sxx = ((x - x.mean()) ** 2).sum()
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * x.mean())
    residual = y - (intercept + slope * x)
    sigma = math.sqrt((residual**2).sum() / (n - 2))
    t = student_t_975(n - 2)

    def predict(p: float) -> tuple[float, float, float]:
        x0 = math.log10(p)
        half = t * sigma * math.sqrt(1 + 1 / n + (x0 - x.mean()) ** 2 / sxx)
        centre = intercept + slope * x0
        return 10**centre, 10 ** (centre - half), 10 ** (centre + half)

    r2 = 1 - (residual**2).sum() / ((y - y.mean()) ** 2).sum() if np.ptp(y) > 0 else 1.0
    return {"a": intercept, "b": slope, "b_stderr": sigma / math.sqrt(sxx), "r2": float(r2), "n": n,
            "predict": predict}


# Student's t 97.5% quantiles for 1..10 degrees of freedom (the standard table); above, the expansion
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def student_t_975(df: int) -> float:
    """Student's t 97.5% quantile: the table up to df = 10, then the Cornish-Fisher expansion in 1/df
    around the normal's 1.96 (within 1e-4 there), so that the fit needs no scipy."""
    if df <= len(T_975):
        return T_975[df - 1]
    z = 1.959964
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def fits(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (series, quantity): exponent, its standard error, R^2, the extrapolated 1B and 3B values."""
    rows = []
    for series, runs in table.groupby("series"):
        for quantity in FITTED:
            if quantity not in runs:
                continue
            fit = fit_power_law(runs.parameters.to_numpy(float), runs[quantity].to_numpy(float))
            if fit is None:
                continue
            row = {"series": series, "quantity": quantity, "points": fit["n"], "exponent": fit["b"],
                   "exponent_stderr": fit["b_stderr"], "r2": fit["r2"]}
            for name, size in LLAMA_SIZES.items():
                row[f"{name}"], row[f"{name} low"], row[f"{name} high"] = fit["predict"](size)
            rows.append(row)
    return pd.DataFrame(rows)


def _statistic(quantity: str) -> str:
    return "N_1%" if quantity == "n_1pct" else quantity.split()[0].removeprefix("s_")


PANELS = (("s_median embeddings / output", "s_q10 embeddings / output", "embeddings / output: sqrt(v_hat)"),
          ("s_median all", "s_q10 all", "whole model: sqrt(v_hat)"),
          ("n_1pct", None, "N_1%: largest N with the update within 1%"))


def plot_scaling(table: pd.DataFrame, points: pd.DataFrame | None = None):
    """s (median, q10) of the embeddings / output and of the whole model, and N_1%, against parameters:
    each series' runs with its fitted line extended to 3B; `points` runs in black."""
    import matplotlib.pyplot as plt

    # stacked, each legend beside its panel: legible at the README's width
    fig, axes = plt.subplots(3, 1, figsize=(9.5, 11.5), layout="constrained")
    grid = np.logspace(math.log10(table.parameters.min()) - 0.2, math.log10(max(LLAMA_SIZES.values())) + 0.1, 50)
    colors = dict(zip(sorted(table.series.unique()), ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red")))
    for ax, (first, second, title) in zip(axes, PANELS):
        shown = []  # the points and fitted lines: the axis covers them, not the widest intervals
        for series, runs in table.groupby("series"):
            for quantity, marker, style in ((first, "o", "-"), (second, "v", "--")):
                if quantity is None or quantity not in runs:
                    continue
                ax.scatter(runs.parameters, runs[quantity], marker=marker, color=colors[series],
                           label=f"{series}, {_statistic(quantity)}")
                shown += list(runs[quantity])
                fit = fit_power_law(runs.parameters.to_numpy(float), runs[quantity].to_numpy(float))
                if fit is None:
                    continue
                predicted = np.array([fit["predict"](p) for p in grid])
                shown += list(predicted[:, 0])
                ax.plot(grid, predicted[:, 0], style, color=colors[series], lw=1,
                        label=f"fit: exponent {fit['b']:.2f} ± {fit['b_stderr']:.2f}")
                if marker == "o":
                    ax.fill_between(grid, predicted[:, 1], predicted[:, 2], color=colors[series], alpha=0.12)
        for _, p in (points if points is not None else pd.DataFrame()).iterrows():
            for quantity, marker in ((first, "*"), (second, "P")):
                if quantity is not None and np.isfinite(p.get(quantity, np.nan)):
                    ax.scatter(p.parameters, p[quantity], marker=marker, s=160, color="black",
                               label=f"{p.model}, {_statistic(quantity)}")
                    shown.append(p[quantity])
        for name, size in LLAMA_SIZES.items():
            ax.axvline(size, color="grey", lw=0.8, ls=":")
            ax.text(size, 1.01, name.removeprefix("Llama 3.2 "), transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=8, color="grey")
        shown = np.array([v for v in shown if np.isfinite(v) and v > 0])
        ax.set(xscale="log", yscale="log", xlabel="trained parameters")
        if shown.size:
            ax.set_ylim(shown.min() / 5, shown.max() * 5)
        ax.set_title(title, pad=14)
        plain_ticks(ax)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    axes[0].set_ylabel("sqrt(v_hat)")
    axes[2].set_ylabel("world size N (at the runs' eps)")
    fig.suptitle("Adam's second moment against model size: fits per series, extended to Llama 3.2 1B / 3B\n"
                 "(shaded: the median fit's 95% prediction interval)")
    return fig


def format_tables(table: pd.DataFrame, fitted: pd.DataFrame) -> str:
    runs = render_table(
        ["series", "hidden", "layers", "parameters", "step", "s median emb/out", "s q10 emb/out", "s median all",
         "s q10 all", "N_1%"],
        [[r.series, r.hidden_size, r.layers, f"{r.parameters:,}", r.step,
          short_number(r['s_median embeddings / output']),
          short_number(r['s_q10 embeddings / output']), short_number(r['s_median all']), short_number(r['s_q10 all']),
          short_number(r.n_1pct)] for _, r in table.iterrows()])
    if fitted.empty:
        return runs + "\n\n(fewer than 3 runs per series: no fit)"
    lines = render_table(
        ["series", "quantity", "points", "exponent", "R^2", *[f"{name} (95% interval)" for name in LLAMA_SIZES]],
        [[f.series, f.quantity, f.points, f"{f.exponent:.3f} ± {f.exponent_stderr:.3f}", f"{f.r2:.2f}",
          *[f"{short_number(f[name])} ({short_number(f[name + ' low'], 2)} .. {short_number(f[name + ' high'], 2)})"
            for name in LLAMA_SIZES]]
         for _, f in fitted.iterrows()])
    return runs + "\n\n" + lines


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m gradscale.analysis.scaling", description=__doc__.split("\n\n")[0],
                           epilog="example: python -m gradscale.analysis.scaling SWEEP_DIR --point RUN_DIR, "
                                  "SWEEP_DIR from python -m gradscale.run -m experiment=width_scaling")
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders (or run folders) of AdamW runs with "
                        "sqrt(v_hat) histograms, e.g. experiment=width_scaling's")
    parser.add_argument("--point", type=Path, action="append", default=[],
                        help="a run shown beside the fits, not fitted (e.g. SmolLM2's gradscale.advise run)")
    parser.add_argument("--eps", type=float, help="N_1%% for this eps (default: each run's)")
    parser.add_argument("--out", type=Path, help="output folder (default: the first sweep's report/)")
    args = parser.parse_args(argv)
    out = args.out or args.sweeps[0] / "report"
    from gradscale.checks import ConfigError, check_writable

    try:
        if args.eps is not None and not (math.isfinite(args.eps) and args.eps > 0):
            raise AdviseError(f"error: --eps={args.eps!r} must be > 0")
        try:
            check_writable("--out", out)  # before reading the runs, not after the fits
        except ConfigError as e:
            raise AdviseError(str(e)) from None
        for point in args.point:
            if not point.is_dir():
                raise AdviseError(f"error: --point={str(point)!r} is not a run folder (it does not exist)")
        table = collect(args.sweeps, args.eps)
        points = pd.DataFrame([measure(p, args.eps) for p in args.point]) if args.point else None
        if points is not None:
            points["series"] = points.model + " (not fitted)"
    except AdviseError as e:
        print(e, file=sys.stderr)
        return 2
    fitted = fits(table)
    out.mkdir(parents=True, exist_ok=True)
    text = format_tables(table if points is None else pd.concat([table, points]), fitted)
    print(text)
    (out / "scaling.md").write_text("# sqrt(v_hat) against model size\n\n```\n" + text + "\n```\n")
    pd.concat([table, points]).to_csv(out / "scaling.csv", index=False) if points is not None else table.to_csv(
        out / "scaling.csv", index=False)
    import matplotlib

    matplotlib.use("Agg")
    plot_scaling(table, points).savefig(out / "scaling.png", dpi=200)
    print(f"written: {out / 'scaling.md'}, {out / 'scaling.csv'}, {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
