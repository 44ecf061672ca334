"""Pure plotting functions: tables from analysis.load and analysis.tables in, a matplotlib Figure out.

What every figure does, so that a reader can compare at a glance:
- panels that compare setups share their y-axis, so sizes compare across panels;
- numbers in ticks and legends in one short format (gradscale.runs.short_number: 1e-8, 0.125, 1e4);
- exact zeros, which a log axis cannot show, sit as hollow markers on a floor line the legend names, and no
  line joins them to measured values (a line down to the floor and back would read as a measured dip);
- a diverged run is cut where it leaves the others' range and marked x there, so it flattens nothing;
- each run has one look (colour, line style and marker: RunLooks) in every figure drawn from the same runs
  table, and no two runs share one; markers are staggered, so coinciding lines stay visible, and the legend
  says "identical to ..." when they coincide exactly;
- no panel that is empty by construction; one legend per figure, outside the data, listing only what is drawn.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from gradscale.analysis.load import curve
from gradscale.analysis.tables import (
    compared_references,
    is_reference,
    max_divergence,
    one_percent_thresholds,
    pair_references,
    seed_curves,
    seed_siblings,
)
from gradscale.records import (
    CLIP_COEF,
    EPS_DOMINATED,
    GRAD_NORM,
    TRAIN_LOSS,
    UPDATE_RMS,
    eval_loss_of,
    output_update_rms_of,
)
from gradscale.runs import short_number
from gradscale.theory import clipped_share

# Figures are built with matplotlib.figure.Figure, not pyplot: no global state, nothing to close, and a
# notebook shows each returned figure exactly once.

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
FLOOR = 1e-7  # where an exact zero of |Δ loss| is drawn: below float32's resolution of a loss near 1..10
PANEL = (3.9, 2.9)  # inches per panel: two panels side by side stay legible at the README's width


class RunLooks:
    """One look (colour, line style, marker) per run, the same in every figure drawn from one runs table: a run
    compared with its reference (divergence, ratios, token_frequency) wears its own look, never its reference's.
    Looks are dealt in a fixed order of the runs (setups in order of appearance, each setup's references first),
    not in the order a figure asks for them, so no figure's drawing order can move them. A line through several
    runs (breakdown, lr_axis, ...) wears the look of the first of them in that order: a setup's line wears its
    reference's."""

    def __init__(self, runs: pd.DataFrame):
        setup_order = {setup: i for i, setup in enumerate(dict.fromkeys(runs.setup))}
        order = runs.assign(setup_order=runs.setup.map(setup_order), not_reference=~is_reference(runs),
                            row=np.arange(len(runs)))
        order = order.sort_values(["setup_order", "not_reference", "row"], kind="stable").run
        self.rank = {run: i for i, run in enumerate(order)}

    def __call__(self, run: str) -> dict:
        i = self.rank[run]  # the three cycles' lengths (10, 4, 11) keep the combinations distinct for 220 runs
        return {"color": COLORS[i % len(COLORS)], "ls": LINE_STYLES[i % len(LINE_STYLES)],
                "marker": MARKERS[i % len(MARKERS)]}

    def of(self, runs) -> dict:
        """The look of a line through several runs: its first run's."""
        return self(min(runs, key=self.rank.__getitem__))


class CurveFigure:
    """Panels of curves sharing one legend: draws each run's series in its look (RunLooks), cut (and marked x)
    where a diverged run leaves the range of the others, exact zeros of a log axis as hollow markers on the floor,
    and records what it drew to tell coinciding lines apart."""

    def __init__(self, keys, title: str, looks: RunLooks, sharey: bool = True, log_y: bool = False,
                 share_by: dict | None = None):
        self.fig, self.axes = _panels(keys, title, sharey=sharey, share_by=share_by)
        self.looks, self.log_y = looks, log_y
        self.legend_runs: dict[str, str] = {}  # label -> run
        self.drawn: dict[tuple[str, str], pd.Series] = {}
        self.diverged = self.zeros = False

    def draw(self, key: str, series: pd.Series, label: str, run: str, top: float | None = None,
             **extra) -> Line2D | None:
        series = series.astype(float)
        if series.empty:
            return None
        ax, look = self.axes[key], self.looks(run)
        x, y = series.index.to_numpy(), series.to_numpy()
        cut = _first_off_scale(y, top)
        if cut is not None:
            x, y = x[: cut + 1], np.append(y[:cut], top)
        every = max(1, len(x) // 6)
        offset = len(ax.get_lines()) % every
        if self.log_y:
            y, zeros = _floor_points(ax, x, y, look, ms=4.5, every=every, offset=offset)
            self.zeros |= zeros
        # the artist's label is the run's name (the legend's text is on the figure's handles): ax.legend() in a
        # notebook, and the tests, can tell each run's line by it
        line, = ax.plot(x, y, color=look["color"], ls=look["ls"], marker=look["marker"], ms=4.5, lw=1.3,
                        markevery=(offset, every), label=run, **extra)
        if cut is not None:
            ax.plot(x[-1:], [top], "x", color=look["color"], ms=9, mew=2, clip_on=False)
            self.diverged = True
        self.drawn[key, label] = series
        self.legend_runs.setdefault(label, run)
        return line

    def finish(self, xlabel: str, ylabel: str, extra_handles=()) -> Figure:
        fits = int(self.fig.get_figwidth() / min(len(self.axes), 2) * 8.5)  # characters of a panel's title
        for name, ax in self.axes.items():
            ax.set(title=textwrap.fill(name, fits), xlabel=xlabel)  # long setups would run into the next panel
            note = _panel_note([s for (key, _), s in self.drawn.items() if key == name])
            if note:
                ax.text(0.98, 0.95, note, transform=ax.transAxes, ha="right", va="top", fontsize=8.5,
                        bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.85})
            if self.log_y:
                ax.set_yscale("log")
            if self.zeros:
                _floor_line(ax)
            plain_ticks(ax)
        for ax in list(self.axes.values())[:: self._columns()]:
            ax.set_ylabel(ylabel)
        in_look_order = sorted(self.legend_runs.items(), key=lambda item: self.looks.rank[item[1]])
        handles = [_handle(label + _coincidence(label, self.drawn), self.looks(run)) for label, run in in_look_order]
        handles += list(extra_handles)
        if self.zeros:
            handles.append(_floor_handle())
        if self.diverged:
            handles.append(Line2D([], [], color="k", marker="x", ls="", ms=8, mew=2,
                                  label="diverged: cut where it leaves the axis"))
        _legend(self.fig, handles)
        return self.fig

    def _columns(self) -> int:
        return min(len(self.axes), 2)


def _floor_points(ax, x: np.ndarray, y: np.ndarray, look: dict, ms: float, every: int = 1,
                  offset: int = 0) -> tuple[np.ndarray, bool]:
    """Exact zeros, which a log axis cannot show: hollow markers on the floor line (the first and last of each
    stretch of zeros and every `every`-th between, so a long stretch stays a row of markers, not a smear), and
    y with NaN there, so that no line joins them to measured values. Returns (that y, whether any was zero)."""
    zero = y == 0
    if not zero.any():
        return y, False
    index = np.arange(len(y))
    before, after = np.r_[False, zero[:-1]], np.r_[zero[1:], False]
    shown = zero & (~before | ~after | ((index - offset) % every == 0))
    ax.plot(x[shown], np.full(shown.sum(), FLOOR), ls="", marker=look["marker"], ms=ms, mfc="none",
            mec=look["color"], mew=1.1, gid="on floor", clip_on=False)
    return np.where(zero, np.nan, y), True


def _floor_line(ax) -> None:
    ax.axhline(FLOOR, color="0.5", ls=(0, (1, 2)), lw=0.8, gid="floor")


def _floor_handle() -> Line2D:
    return Line2D([], [], color="0.5", ls=(0, (1, 2)), lw=0.8, marker="o", mfc="none", mec="k", ms=5,
                  label=f"hollow, on the dotted line at {short_number(FLOOR)}: exactly 0, which a log axis cannot "
                        "show (no line joins it)")


def _panels(keys, title: str, sharey: bool = False, size: tuple[float, float] = PANEL, share_by: dict | None = None):
    """One axes per distinct key (setup or optimizer), two to a row; share_by (key -> group) shares the y-axis
    within each group only."""
    keys = list(dict.fromkeys(keys))
    cols = min(len(keys), 2)
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(size[0] * cols, size[1] * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=sharey and not share_by).flatten()
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    _suptitle(fig, title)
    panels = dict(zip(keys, axes))
    first_of_group: dict = {}
    for key, ax in panels.items() if share_by else ():
        first = first_of_group.setdefault(share_by[key], ax)
        if first is not ax:
            ax.sharey(first)
    return fig, panels


def _single(title: str, size: tuple[float, float] = (6.0, 3.6)):
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.subplots()
    _suptitle(fig, title)
    return fig, ax


def _suptitle(fig: Figure, title: str) -> None:
    """The figure's title, wrapped to its width (about 11 characters an inch at 12 pt): a one-panel figure is
    narrower than a long title."""
    fits = int(fig.get_figwidth() * 11)
    fig.suptitle("\n".join(textwrap.fill(line, fits) for line in title.split("\n")))


def _legend(fig: Figure, handles) -> None:
    """Below the panels, in as many columns (at most 3) as the labels' length and the figure's width allow
    (about 12 characters an inch at this size): the figure keeps its width and grows in height by the
    legend's, so the panels keep theirs."""
    if handles:
        room = fig.get_figwidth() * 72 - 60  # points beside a handle, with a margin
        for h in handles:  # a label longer than the figure is wide wraps instead of running off its edges
            lines = h.get_label().split("\n")
            width, widest = max((_text_points(line), line) for line in lines)
            if width > room:
                fits = int(len(widest) * room / width)
                h.set_label("\n".join(textwrap.fill(line, fits, subsequent_indent="  ") for line in lines))
        longest = max(len(h.get_label().split("\n")[0]) for h in handles)
        columns = max(1, min(3, int(fig.get_figwidth() * 12 // (longest + 6))))
        rows = -(-len(handles) // columns) + max(h.get_label().count("\n") for h in handles)
        fig.set_figheight(fig.get_figheight() + 0.2 * rows + 0.15)
        fig.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize=8.5, frameon=False)


def _text_points(text: str) -> float:
    """The width of a line of legend text (8.5 pt), in points."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    return TextToPath().get_text_width_height_descent(text, FontProperties(size=8.5), ismath=False)[0]


def _handle(label: str, style: dict) -> Line2D:
    return Line2D([], [], color=style["color"], ls=style["ls"], marker=style["marker"], ms=4.5, lw=1.3, label=label)


def _note(label: str) -> Line2D:
    """A legend line of text alone, with no swatch: for what the figure says but does not draw."""
    return Line2D([], [], ls="", label=label)


def plain_ticks(ax) -> None:
    """Log axes labelled 1e-4, 0.01, 1, 100 instead of 10^x (and 8, 7.998 instead of 7.998x10^0 when the
    range spans less than a decade; 0.02, 0.05, 0.1 when it spans one or two); minor ticks unlabelled."""
    for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
        if scale != "log":
            if isinstance(axis.get_major_formatter(), ticker.ScalarFormatter):
                axis.get_major_formatter().set_useOffset(False)  # 3.2, 3.4 rather than 0.2, 0.4 + 3
            continue
        low, high = sorted(axis.get_view_interval())
        if low > 0 and high / low < 10:
            axis.set_major_locator(ticker.MaxNLocator(4))
        elif low > 0 and high / low < 100:  # a decade or two holds one power of 10 at most: 1, 2, 5 of each too
            axis.set_major_locator(ticker.LogLocator(10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: short_number(v, 4)))
        axis.set_minor_formatter(ticker.NullFormatter())


def _first_off_scale(y: np.ndarray, top: float | None) -> int | None:
    """Index of the first value past `top` or not finite: where a diverged run is cut."""
    bad = ~np.isfinite(y) if top is None else ~np.isfinite(y) | (y > top)
    if top is None or not bad.any():
        return None
    return int(np.argmax(bad))


def _same(a: pd.Series, b: pd.Series) -> str | None:
    """'identical' when two series are equal, '≈' when within 0.1% everywhere, else None."""
    if not a.index.equals(b.index):
        return None
    a, b = a.to_numpy(float), b.to_numpy(float)
    if np.array_equal(a, b, equal_nan=True):
        return "identical"
    return "≈" if np.allclose(a, b, rtol=1e-3, atol=0, equal_nan=True) else None


def _coincidence(label: str, drawn: dict[tuple[str, str], pd.Series]) -> str:
    """' (identical to X)' when, in every panel where both were drawn, this label's series equals an earlier
    label's exactly; ' (≈ X)' when within 0.1% in all of them. A line that is one value throughout says so
    instead (' (exactly 0 throughout)': a run equal to its reference in a difference plot), whatever else
    is that value too: two flat lines of different runs say nothing about each other."""
    labels = list(dict.fromkeys(lab for _, lab in drawn))
    mine = {key: s for (key, lab), s in drawn.items() if lab == label}
    values = np.concatenate([s.to_numpy(float) for s in mine.values()]) if mine else np.array([])
    if len(values) > 1 and np.isfinite(values).all() and (values == values[0]).all():
        return f" (exactly {short_number(float(values[0]))} throughout)"
    for other in labels[: labels.index(label)]:
        common = [key for key in mine if (key, other) in drawn]
        verdicts = {_same(mine[key], drawn[key, other]) for key in common}
        if common and None not in verdicts:
            return f" (≈ {other})" if "≈" in verdicts else f" (identical to {other})"
    return ""


def _panel_note(series: list[pd.Series]) -> str | None:
    """'all N lines identical' (or ≈) when every line of a panel coincides with its first."""
    if len(series) < 2:
        return None
    verdicts = {_same(series[0], other) for other in series[1:]}
    if None in verdicts:
        return None
    lines = "both lines" if len(series) == 2 else f"all {len(series)} lines"
    return f"{lines} {'≈ equal' if '≈' in verdicts else 'identical'}"


def _label(r, runs: pd.DataFrame) -> str:
    """What tells this run apart from the others of its setup: scale, fix, and c_eff where it is not the
    scale (fix off, or several world sizes); lr when a setup has several; the seed when its setup has several."""
    parts = []
    if runs.scale.nunique() > 1 or runs.c_eff.nunique() == 1:
        parts.append(f"scale={short_number(r.scale)}")
    if runs.fix.nunique() > 1:
        parts.append(f"fix={'on' if r.fix else 'off'}")
    if not np.allclose(runs.c_eff, runs.scale):
        parts.append(f"c_eff={short_number(r.c_eff)}")
    if runs.groupby("setup").lr.nunique().max() > 1:
        parts.append(f"lr={short_number(r.lr)}")
    if runs.seed[runs.setup == r.setup].nunique() > 1:  # else the seed repeats of a reference share one label
        parts.append(f"seed={r.seed}")
    return " ".join(parts)


def _run_label(r, runs: pd.DataFrame, with_setup: bool) -> str:
    """A run's legend label: its setup first where the figure draws several (each run has its own look, so the
    legend names each run, not what it shares with other setups' runs)."""
    return " ".join(filter(None, (r.setup if with_setup else "", _label(r, runs))))


def _diverged(r, series: pd.Series) -> bool:
    return r.status == "diverged" or not np.isfinite(series.to_numpy(float)).all()


def _top(values: list[np.ndarray], factor: float) -> float | None:
    """The largest finite value of the runs that did not diverge, times `factor`: the axis' top."""
    finite = [v[np.isfinite(v)] for v in values]
    finite = [v for v in finite if len(v)]
    return float(max(v.max() for v in finite)) * factor if finite else None


def loss_curves(runs: pd.DataFrame, curves: pd.DataFrame, metric: str = TRAIN_LOSS):
    """Training loss per setup, one line per scale/fix (and lr when the sweep has several)."""
    series = {r.run: curve(curves, r.run, metric) for r in runs.itertuples()}
    kept = [series[r.run].to_numpy(float) for r in runs.itertuples() if not _diverged(r, series[r.run])]
    lows = [v[np.isfinite(v)].min() for v in kept if np.isfinite(v).any()]
    top = _top(kept, 1.0)
    # runs that blow up without diverging span decades: a log axis then shows them and keeps the rest apart
    log_y = top is not None and bool(lows) and min(lows) > 0 and top / min(lows) > 4
    if top is not None:  # a little headroom for the x of a diverged run
        top = top * 1.5 if log_y else top + (0.08 * (top - min(lows)) if lows else 0.0)
    plot = CurveFigure(runs.setup, f"{metric} by setup" + (" (log y: some runs blow up)" if log_y else ""),
                       RunLooks(runs), log_y=log_y)
    several_setups = runs.setup.nunique() > 1
    for r in runs.itertuples():
        plot.draw(r.setup, series[r.run], _run_label(r, runs, several_setups), r.run, top=top)
    return plot.finish("step", metric)


def _paired(runs: pd.DataFrame):
    """(run, its reference) for runs with a reference (same config at scale 1, fix on): the pairs the divergence
    and grad-norm-ratio figures draw. Only token_frequency reads runs against the wider compared_references."""
    references = pair_references(runs)
    return [(r, references[i]) for i, r in zip(runs.index, runs.itertuples())
            if references[i] is not None and references[i] != r.run]


def divergence(runs: pd.DataFrame, curves: pd.DataFrame):
    """|loss(run) - loss(reference)| vs step, log y shared by the panels; reference = same run at scale 1
    with the fix on."""
    pairs = [(r, (curve(curves, r.run, TRAIN_LOSS) - curve(curves, ref, TRAIN_LOSS)).abs())
             for r, ref in _paired(runs)]
    top = _top([d.to_numpy() for r, d in pairs if not _diverged(r, d)], 3.0)
    plot = CurveFigure([r.setup for r, _ in pairs] or runs.setup, "|loss - loss(reference: scale 1, fix on)|",
                       RunLooks(runs), log_y=True)
    several_setups = len({r.setup for r, _ in pairs}) > 1
    for r, delta in pairs:  # in the run's own look: the reference is what every line is measured against
        plot.draw(r.setup, delta, _run_label(r, runs, several_setups), r.run, top=top)
    return plot.finish("step", "|Δ loss|")


def grad_norm_ratio(runs: pd.DataFrame, curves: pd.DataFrame):
    """grad_norm(run) / grad_norm(reference) vs step, log y shared by the panels: flat at exactly c_eff
    (dotted, in the line's colour) until the trajectories part."""
    pairs = [(r, curve(curves, r.run, GRAD_NORM) / curve(curves, ref, GRAD_NORM))
             for r, ref in _paired(runs)]
    top = _top([q.to_numpy() for r, q in pairs if not _diverged(r, q)] + [np.array([r.c_eff]) for r, _ in pairs], 3.0)
    plot = CurveFigure([r.setup for r, _ in pairs] or runs.setup, "grad norm / grad norm(reference)", RunLooks(runs),
                       log_y=True)
    several_setups = len({r.setup for r, _ in pairs}) > 1
    for r, ratio in pairs:
        line = plot.draw(r.setup, ratio, _run_label(r, runs, several_setups), r.run, top=top)
        if line is not None:
            plot.axes[r.setup].axhline(r.c_eff, color=line.get_color(), ls=":", lw=0.8, gid="predicted")
    predicted = Line2D([], [], color="0.3", ls=":", lw=0.8, label="dotted: c_eff (predicted ratio)")
    parted = _note("a line that leaves its dotted c_eff: the two runs' weights have parted (SGD moves with c_eff), "
                   "not a scaling error")
    return plot.finish("step", "ratio", extra_handles=[predicted, parted])


def breakdown(runs: pd.DataFrame, curves: pd.DataFrame, bands: dict[str, tuple[float, float]] | None = None,
              onsets: dict[str, float] | None = None):
    """Max |Δ loss| vs c_eff (log x), a line per setup (and lr); grey dash-dot: 1% of the reference's final
    loss, the threshold the report judges by; shaded in the line's colour: where the theory predicts that
    setup stops being invariant (bands: setup -> (c_start, c_end), from measured sqrt(v_hat) quantiles, or
    the clipping band for a clipped setup); dashed: where the risk advisor predicts a 1% update cut
    (onsets: setup -> c); diverged runs as x at the top. One panel per optimizer when an optimizer has
    several setups, else one panel for all. The x-range spans the runs and what is drawn within a decade of
    them: a band or onset further out is named in the legend, as text without a swatch, not drawn (a sweep of a
    few c values is not a figure of empty band). An exact 0 (the reference itself, or a run equal to it) is a
    hollow marker on the floor line, joined to no other point: a line down to it would read as a measured dip."""
    deltas = max_divergence(runs, curves)
    table = runs.assign(delta=runs.run.map(deltas)).dropna(subset=["delta"])
    one_panel = (table.optimizer.nunique() <= 1 or table.groupby("optimizer").setup.nunique().max() <= 1
                 if len(table) else True)
    title = "Where scale invariance breaks down"
    if one_panel:
        fig, ax = _single(title, size=(6.4, 3.6))
        axes = {"all": ax}
    else:
        fig, axes = _panels(table.optimizer, title, sharey=True, size=(3.9, 3.2))
    several_lrs = table.groupby("setup").lr.nunique().max() > 1 if len(table) else False
    finite_deltas = table.delta[np.isfinite(table.delta)]
    top = max(finite_deltas.max() * 3, 1.0) if len(finite_deltas) else 1.0
    looks, handles, colors = RunLooks(runs), [], {}
    xs = list(table.c_eff)
    zeros = diverged_any = False
    for (setup, lr), group in table.groupby(["setup", "lr"], sort=False):
        group = group.sort_values("c_eff")
        ax = axes["all" if one_panel else group.optimizer.iloc[0]]
        label = setup + (f" lr={short_number(lr)}" if several_lrs else "")
        style = looks.of(group.run)
        finite = group[np.isfinite(group.delta)]
        x, y = finite.c_eff.to_numpy(), finite.delta.to_numpy(float)
        y, on_floor = _floor_points(ax, x, y, style, ms=6)
        zeros |= on_floor
        ax.plot(x, y, color=style["color"], ls=style["ls"], marker=style["marker"], ms=6, lw=1.3)
        joined = bool((np.isfinite(y[:-1]) & np.isfinite(y[1:])).any())  # else points only: the swatch says so
        handles.append(_handle(label, style if joined else {**style, "ls": ""}))
        diverged = group[~np.isfinite(group.delta)]
        if len(diverged):
            ax.plot(diverged.c_eff, [top] * len(diverged), "x", color=style["color"], ms=9, mew=2)
            diverged_any = True
        colors.setdefault(setup, (ax, style["color"]))
    thresholds = one_percent_thresholds(runs)
    for name, ax in axes.items():
        values = [t for (setup, _), t in thresholds.items() if one_panel or setup.split()[0] == name]
        if values:
            ax.axhline(float(np.median(values)), color="0.35", ls="-.", lw=1.0, gid="threshold")
    if thresholds:
        spread = max(thresholds.values()) / min(thresholds.values())
        what = f"{short_number(float(np.median(list(thresholds.values()))))}" + (
            f", median of {short_number(min(thresholds.values()))}..{short_number(max(thresholds.values()))}"
            if spread > 1.05 else "")
        handles.append(Line2D([], [], color="0.35", ls="-.", lw=1.0, label=f"1% of the reference's loss ({what})"))
    clipped = set(runs.setup[runs["clip"].notna()])
    positive = [x for x in xs if x > 0]
    reach = (min(positive) / 10, max(positive) * 10) if positive else (0.0, np.inf)  # a decade beyond the runs

    def where(low: float, high: float | None = None) -> str:  # a band or onset the runs do not reach, said in words
        high = low if high is None else high
        span = short_number(low, 2) + ("" if high == low else f"..{short_number(high, 2)}")
        side = "below" if high < reach[0] else "above"
        return f"at c = {span}, {side} this sweep's c_eff: not drawn"

    sources = {}
    for setup, (low, high) in (bands or {}).items():
        if setup in colors:
            ax, color = colors[setup]
            low, high = min(low, high), max(low, high)
            inside = high >= reach[0] and low <= reach[1]
            if inside:
                low, high = max(low, reach[0]), min(high, reach[1])
                ax.axvspan(low, high, alpha=0.13, color=color)
                positive += [low, high]
            label = f"{setup}: predicted band" + ("" if inside else f" {where(low, high)}")
            # a swatch only for a band drawn: the legend lists what the figure shows
            handles.append(Line2D([], [], color=color, alpha=0.35, lw=8, label=label) if inside else _note(label))
            sources["clip" if setup in clipped else "eps"] = None
    notes = {"eps": "bands: eps / sqrt(v_hat), sqrt(v_hat) from q90 to q10 of the reference",
             "clip": "clipping bands: max_norm / grad norm of the reference, max to min"}
    handles += [_note(notes[kind]) for kind in sources]
    drawn_onsets = [(setup, c) for setup, c in (onsets or {}).items()
                    if setup in colors and reach[0] <= c <= reach[1]]
    for setup, c in (onsets or {}).items():
        if setup in colors:
            ax, color = colors[setup]
            inside = (setup, c) in drawn_onsets
            if inside:  # onsets within 1% (one line on a log axis: a reference in two precisions) take turns on it
                same = [name for name, other in drawn_onsets
                        if colors[name][0] is ax and np.isclose(other, c, rtol=0.01)]
                turn, n = same.index(setup), len(same)
                ax.axvline(c, color=color, ls=(4 * turn, (4, 4 * (n - 1))) if n > 1 else "--", lw=1.2)
                positive.append(c)
            label = f"{setup}: advisor's 1% update cut " + (f"(c={short_number(c, 2)})" if inside else where(c))
            handles.append(Line2D([], [], color=color, ls="--", lw=1.2, label=label) if inside else _note(label))
    if zeros:
        handles.append(_floor_handle())
    if diverged_any:
        handles.append(Line2D([], [], color="k", marker="x", ls="", ms=8, mew=2, label="diverged (drawn at the top)"))
    for name, ax in axes.items():
        ax.set(title="" if one_panel else name, xscale="log", yscale="log",
               xlabel="c_eff (effective gradient multiplier)")
        if zeros:
            _floor_line(ax)
        if positive:
            ax.set_xlim(min(positive) / 2.5, max(positive) * 2.5)
        plain_ticks(ax)
    list(axes.values())[0].set_ylabel("max |Δ loss| vs reference")
    _legend(fig, handles)
    return fig


def eps_collapse(runs: pd.DataFrame):
    """Final loss vs c_eff / eps, one line per eps: AdamW(c, eps) == AdamW(1, eps/c) says every run's
    outcome depends on c / eps alone, so the lines fall on one curve (docs/design.md physics 3). Plotted
    against the outcome itself, not a deviation from each eps's own c = 1 run, which moves with eps. One data
    order: repeats at other seeds are left out (they move the outcome at equal c / eps); one line per precision."""
    fig, ax = _single("AdamW trades c for eps: one curve in c / eps")
    table = runs[runs.eps.notna() & (runs.status == "completed")]
    table = table[table.seed == table.seed.min()]
    looks, handles = RunLooks(runs), []
    several_precisions = table.precision.nunique() > 1  # a precision moves the outcome at equal c / eps too
    for (optimizer, eps, precision), group in table.groupby(["optimizer", "eps", "precision"]):
        group = group.sort_values("c_eff")
        label = f"{optimizer} eps={short_number(eps)}" + (f" {precision}" if several_precisions else "")
        style = looks.of(group.run)
        ax.plot(group.c_eff / eps, group.final_loss, color=style["color"], ls=style["ls"], marker=style["marker"],
                ms=7 - 0.7 * (len(handles) % 4), lw=1.2)
        handles.append(_handle(label, style))
    ax.set(xscale="log", xlabel="c_eff / eps", ylabel="final loss")
    plain_ticks(ax)
    _legend(fig, handles)
    return fig


def clipping(runs: pd.DataFrame, curves: pd.DataFrame):
    """Share of steps clipped vs c_eff, per clipped setup: measured (dots) and predicted from the reference
    run's grad norms at c = 1 (line: share of its logged steps with c * ||g|| > max_norm)."""
    fig, ax = _single("Clipping: which steps are clipped at each c")
    references = pair_references(runs)
    clipped = runs[runs["clip"].notna() & runs.clipped_steps.notna()]
    looks, handles = RunLooks(runs), []
    for setup, group in clipped.groupby("setup", sort=False):
        group = group.sort_values("c_eff")
        style = looks.of(group.run)
        size = max(10 - 2.5 * (len(handles) // 2), 4)  # shrinking, so that coinciding points all show
        ax.plot(group.c_eff, group.clipped_steps / group.steps_done, style["marker"], color=style["color"], ms=size)
        handles.append(Line2D([], [], color=style["color"], marker=style["marker"], ls="", ms=size,
                              label=f"{setup}: measured"))
        reference = references[group.index[0]]
        if reference is not None:
            norms = curve(curves, reference, GRAD_NORM).to_numpy()
            grid = np.logspace(np.log10(group.c_eff.min()), np.log10(group.c_eff.max()), 200)
            predicted = [clipped_share(c, norms, float(group["clip"].iloc[0])) for c in grid]
            ax.plot(grid, predicted, color=style["color"], ls=style["ls"], lw=1)
            handles.append(Line2D([], [], color=style["color"], ls=style["ls"], label=f"{setup}: predicted"))
    ax.set(xscale="log", xlabel="c_eff", ylabel="share of steps clipped", ylim=(-0.03, 1.03))
    plain_ticks(ax)
    _legend(fig, handles)
    return fig


def clipped_steps_label(run) -> str:
    """'n of N steps (p%)' from the run's summary (every step, not only the logged ones); a share that is neither 0
    nor 1 never reads as 0% or 100%."""
    if pd.isna(run.clipped_steps):
        return "? steps (no summary.json: the run has not finished)"
    if not run.steps_done:
        return "no steps"
    share = run.clipped_steps / run.steps_done
    percent = f"{share:.0%}" if share in (0, 1) or 0.01 <= share <= 0.99 else f"{share:.1%}"
    return f"{run.clipped_steps:.0f} of {run.steps_done:.0f} steps ({percent})"


def clip_coefficient(runs: pd.DataFrame, curves: pd.DataFrame):
    """What clipping multiplied each logged step's gradient by (train/clip_coef, 1: not clipped), a panel per
    clipped setup, a line per run; the legend gives each run's share of clipped steps over all its steps."""
    clipped = runs[runs["clip"].notna()]
    plot = CurveFigure(clipped.setup, "Clip coefficient min(1, max_norm / (||g|| + 1e-6)) at each logged step",
                       RunLooks(runs), log_y=True)
    for r in clipped.itertuples():
        label = _run_label(r, clipped, with_setup=True) + f": clipped at {clipped_steps_label(r)}"
        plot.draw(r.setup, curve(curves, r.run, CLIP_COEF), label, r.run)
    fig = plot.finish("step", "clip coefficient")
    for ax in plot.axes.values():
        ax.set_ylim(top=1.25)  # nothing lies above 1
    return fig


def lr_separation(runs: pd.DataFrame, curves: pd.DataFrame):
    """Max |Δ loss| against the reference vs lr, a line per setup and c_eff: how a higher learning rate
    amplifies the same gradient multiplier (docs/design.md physics 6); diverged runs as x at the top."""
    fig, ax = _single("A higher lr amplifies the same multiplier")
    deltas = max_divergence(runs, curves)
    table = runs.assign(delta=runs.run.map(deltas)).dropna(subset=["delta"])
    table = table[table.delta > 0]  # the references themselves
    finite = table.delta[np.isfinite(table.delta)]
    top = max(finite.max() * 3, 1.0) if len(finite) else 1.0
    looks, handles = RunLooks(runs), []
    for (setup, c_eff), group in table.groupby(["setup", "c_eff"], sort=False):
        group = group.sort_values("lr")
        label = f"{setup} c_eff={short_number(c_eff)}"
        style = looks.of(group.run)
        ok = group[np.isfinite(group.delta)]
        ax.plot(ok.lr, ok.delta, color=style["color"], ls=style["ls"], marker=style["marker"], ms=6, lw=1.3)
        bad = group[~np.isfinite(group.delta)]
        ax.plot(bad.lr, [top] * len(bad), "x", color=style["color"], ms=9, mew=2)
        handles.append(_handle(label, style))
    if not np.isfinite(table.delta).all():
        handles.append(Line2D([], [], color="k", marker="x", ls="", ms=8, mew=2, label="diverged (drawn at the top)"))
    ax.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="max |Δ loss| vs reference (c = 1)")
    plain_ticks(ax)
    _legend(fig, handles)
    return fig


def final_loss_heatmap(runs: pd.DataFrame):
    """Final loss over (lr, c_eff) per setup, each cell labelled: SGD's contours run diagonal, AdamW's
    vertical. One colour scale for all panels; diverged cells blank and marked."""
    fig, axes = _panels(runs.setup, "final loss over (lr, c_eff)", size=(3.9, 3.1))
    finite = runs.final_loss.astype(float)
    finite = finite[np.isfinite(finite)]
    # a run that blew up would leave every other cell one colour: the scale stops at twice the median
    # (the colour bar says so with its arrow) and each cell carries its value
    limits = (finite.min(), min(finite.max(), 2 * finite.median())) if len(finite) else (0.0, 1.0)
    for setup, ax in axes.items():
        mine = runs[runs.setup == setup]
        grid = mine.pivot_table(index="lr", columns="c_eff", values="final_loss", aggfunc="mean", dropna=False)
        status = mine.pivot_table(index="lr", columns="c_eff", values="status", aggfunc="first", dropna=False)
        values = grid.to_numpy(dtype=float)
        image = ax.imshow(values, origin="lower", aspect="auto", cmap="viridis", vmin=limits[0], vmax=limits[1])
        for (i, j), value in np.ndenumerate(values):
            text = short_number(value) if np.isfinite(value) else (
                "diverged" if status.iloc[i, j] == "diverged" else "-")
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="w" if np.isfinite(value) and value < np.mean(limits) else "k")
        ax.set_xticks(range(grid.shape[1]), [short_number(c) for c in grid.columns], rotation=45)
        ax.set_yticks(range(grid.shape[0]), [short_number(lr) for lr in grid.index])
        ax.set(title=setup, xlabel="c_eff", ylabel="lr")
    fig.colorbar(image, ax=list(axes.values()), label="final loss",
                 extend="max" if len(finite) and finite.max() > limits[1] else "neither")
    return fig


def adam_state(runs: pd.DataFrame, curves: pd.DataFrame):
    """eps-dominated share of coordinates and update RMS vs step, for Adam-type runs. The share panel is left
    out, and the title says so, when no run has an eps-dominated coordinate at any logged step (the default
    sweep's tiny model: its sqrt(v_hat) all lie far above eps): a panel of lines on 0 would show nothing."""
    adam = runs[[not curve(curves, r.run, EPS_DOMINATED).empty for r in runs.itertuples()]]
    shares = {r.run: curve(curves, r.run, EPS_DOMINATED) for r in adam.itertuples()}
    any_share = any((s.to_numpy(float) > 0).any() for s in shares.values())
    share_key = "eps-dominated share"
    title = "Adam's state per run" + ("" if any_share else
                                      "\n(no coordinate eps-dominated in any run: that share's panel left out)")
    several_setups = adam.setup.nunique() > 1
    plot = CurveFigure([share_key, "update RMS"] if any_share else ["update RMS"], title, RunLooks(runs),
                       sharey=False)
    for r in adam.itertuples():
        label = _run_label(r, adam, several_setups)
        if any_share:
            plot.draw(share_key, shares[r.run], label, r.run)
        plot.draw("update RMS", curve(curves, r.run, UPDATE_RMS), label, r.run)
    fig = plot.finish("step", "")
    if any_share:  # from 0 to the largest share: a share of 1e-4 shows as a curve, not as a line along 0
        share_ax = plot.axes[share_key]
        share_ax.set_ylim(0, 1.1 * max(float(s.max()) for s in shares.values()))
        share_ax.yaxis.set_major_formatter(ticker.PercentFormatter(1.0, decimals=None))
        share_ax.set_ylabel("coordinates with sqrt(v_hat) < eps")
    rms_ax = plot.axes["update RMS"]
    rms_ax.set(ylabel="update RMS", yscale="log")
    plain_ticks(rms_ax)
    return fig


def lr_axis(runs: pd.DataFrame):
    """Final loss vs lr per setup and c_eff; diverged runs marked with x at the top."""
    fig, ax = _single("final loss vs lr")
    finite = runs.final_loss.astype(float)
    top = np.nanmax(finite.where(np.isfinite(finite))) if np.isfinite(finite).any() else 1.0
    looks, handles = RunLooks(runs), []
    for (setup, c_eff), group in runs.groupby(["setup", "c_eff"], sort=False):
        group = group.sort_values("lr")
        label = f"{setup} c_eff={short_number(c_eff)}"
        style = looks.of(group.run)
        ok = group[group.status == "completed"]
        ax.plot(ok.lr, ok.final_loss, color=style["color"], ls=style["ls"], marker=style["marker"], ms=6, lw=1.3)
        bad = group[group.status == "diverged"]
        ax.plot(bad.lr, [top * 1.05] * len(bad), "x", color=style["color"], ms=9, mew=2)
        handles.append(_handle(label, style))
    if (runs.status == "diverged").any():
        handles.append(Line2D([], [], color="k", marker="x", ls="", ms=8, mew=2, label="diverged (drawn at the top)"))
    ax.set(xscale="log", xlabel="learning rate", ylabel="final loss")
    plain_ticks(ax)
    _legend(fig, handles)
    return fig


def token_frequency(runs: pd.DataFrame, curves: pd.DataFrame, what: str = "loss"):
    """By token-frequency bucket (gradscale/frequency.py), one panel each, each run against the fixed run it is
    compared with (tables.compared_references: its reference, scale 1 with the fix on, or the run it stands for):
    the held-out loss of the bucket's targets minus the reference's (what="loss"), or the RMS of the
    update of the bucket's output-matrix rows over the reference's, at the eval steps (what="update"). With
    several optimizers, four panels per optimizer, sharing a y-axis only with each other: SGD's differences
    are orders larger than AdamW's, and on one axis would flatten AdamW's lines onto the reference's level."""
    from gradscale.records import BUCKET_EDGES, BUCKETS

    low, mid, high = BUCKET_EDGES
    ranges = {"unseen": "0", "rare": f"{low}-{mid - 1}", "middle": f"{mid}-{high - 1}", "frequent": f">= {high}"}
    metric, title, ylabel, level = {
        "loss": (eval_loss_of, "held-out loss by how often the target token is trained: run minus reference",
                 "Δ held-out loss (nats)", 0.0),
        "update": (output_update_rms_of, "update RMS of the output-matrix rows by how often the token is "
                   "trained: run over reference", "update RMS / reference's", 1.0),
    }[what]
    by_name, against = runs.set_index("run"), compared_references(runs)
    compared = [(r, *against[r.run]) for r in runs.itertuples() if r.run in against]
    optimizers = list(dict.fromkeys(r.optimizer for r, _, _ in compared)) or list(dict.fromkeys(runs.optimizer))
    several_optimizers = len(optimizers) > 1

    def panel(optimizer: str, bucket: str) -> str:  # short enough for a panel's width with the optimizer's name
        return (f"{optimizer}: " if several_optimizers else "") + f"{bucket} ({ranges[bucket]} times)"

    keys = {panel(o, b): o for o in optimizers for b in BUCKETS}
    several_setups = len({r.setup for r, _, _ in compared}) > 1
    plot = CurveFigure(keys, title, RunLooks(runs), share_by=keys)
    siblings, banded = seed_siblings(runs), {}
    for r, reference, key in compared:
        label = (f"{key}={getattr(r, key)} against {key}={by_name.loc[reference, key]}, the same seed" if key else
                 _run_label(r, runs, several_setups))
        for bucket in BUCKETS:
            run_curve, ref_curve = (curve(curves, name, metric(bucket)) for name in (r.run, reference))
            series = run_curve - ref_curve if what == "loss" else run_curve / ref_curve
            plot.draw(panel(r.optimizer, bucket), series.dropna(), label, r.run)  # the compared run's look
        seeds = siblings.get(reference, [])
        optimizer = by_name.loc[reference, "optimizer"]
        if what == "loss" and len(seeds) >= 2 and reference not in banded:  # what the data order alone does
            look = SEED_BAND_LOOKS[len(banded) % len(SEED_BAND_LOOKS)]  # bands that overlap stay told apart
            banded[reference] = (len(seeds), look)
            for bucket in BUCKETS:
                spread = seed_curves(curves, seeds, metric(bucket)).std(axis=1, ddof=1)
                plot.axes[panel(optimizer, bucket)].fill_between(spread.index, -2 * spread, 2 * spread, lw=0,
                                                                 zorder=0, gid="seed band", **look)
    for ax in plot.axes.values():
        ax.axhline(level, color="0.5", lw=0.8, ls=":", gid="level")
    around = {reference: "the reference" if len(banded) == 1 else by_name.loc[reference, "setup"]
              for reference in banded}
    band = [Patch(**look, label=f"±2 seed standard deviations around {around[reference]} ({n} seeds: the data "
                                "order alone)") for reference, (n, look) in banded.items()]
    return plot.finish("step", ylabel, band)


# the seed bands' fills, in the order they are drawn: grey, then hatched, so that overlapping bands stay apart
SEED_BAND_LOOKS = ({"facecolor": "0.88"}, {"facecolor": "none", "edgecolor": "0.6", "hatch": "////"},
                   {"facecolor": "none", "edgecolor": "0.6", "hatch": "\\\\"})


def advisor_along_run(advisor: pd.DataFrame, runs: pd.DataFrame):
    """The risk advisor along whole runs: at every recorded step, AdamW's update-RMS ratio to its reference as
    predicted from the reference's sqrt(v_hat) histogram of that step (dashed) and as measured (solid), each run
    in its look (RunLooks of `runs`) (gradscale.analysis.advise.advisor_vs_measured's table)."""
    fig, ax = _single("The advisor along the run: predicted (dashed), measured (solid)")
    looks, handles, by_name = RunLooks(runs), [], runs.set_index("run", drop=False)
    for run, group in advisor.groupby("run", sort=False):
        group = group.sort_values("step")
        label = _run_label(by_name.loc[run], runs, with_setup=True)  # one panel: no panel title names the setup
        style = looks(run)
        ax.plot(group.step, group.measured, color=style["color"], marker=style["marker"], ms=4.5, lw=1.3, label=run)
        ax.plot(group.step, group.predicted, color=style["color"], ls="--", lw=1.2)
        worst = float(group.error.abs().max())
        handles.append(_handle(f"{label}: largest |predicted / measured - 1| {short_number(worst, 2)}",
                               {**style, "ls": "-"}))
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel="update RMS / reference's")
    plain_ticks(ax)
    _legend(fig, handles)
    return fig
