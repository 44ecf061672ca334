"""The risk advisor: from one c = 1 run's sqrt(v_hat) histograms, predict what a gradient multiplier c does
to AdamW's update, before anyone runs at c.

    python -m gradscale.analysis.advise RUN_DIR [--world-sizes 8,64,1024] [--scales 1e-4,1e-5] [--eps 1e-8] [--json F]

Per coordinate, AdamW's update at multiplier c is m_hat / (s + eps / c), s = sqrt(v_hat) at c = 1: it
shrinks by r = (s + eps) / (s + eps / c) against c = 1. The run's records (gradscale.optimizer_stats.sqrt_v_histograms)
hold, per tensor and bin of s, the coordinate count and the energy E_b of the unscaled update at c = 1, so

    update_rms_ratio(c)^2 = sum_b E_b r(s_b, c)^2 / sum_b E_b

to bin resolution (1/8 decade), for every tensor group and the whole model. A world size N stands for the
bug's c = 1/N. With --eps another eps than the run's is predicted for: the bins' m_hat^2 = E_b (s_b + eps)^2
are reweighted by it (s is eps-independent at c = 1 to first order).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from gradscale.advice import BROKEN, DEFAULT_WORLD_SIZES, WITHIN, AdviseError, check_options
from gradscale.analysis.load import curve, read_jsonl
from gradscale.analysis.tables import compared_references, same_number
from gradscale.checks import CommandParser, installed
from gradscale.optimizers import advisable
from gradscale.optimizers import entry as optimizer_entry
from gradscale.records import GRAD_NORM, UPDATE_RMS
from gradscale.runs import render_table, short_number
from gradscale.theory import (
    Histogram,
    clipped_share,
    clipped_update_ratio,
    clipping_case,
    eps_dominated_share,
    handed_multiplier,
    histogram_of,
    tensor_group,
    update_rms_ratio,
)

GROUPS = ("embeddings / output", "attention", "MLP", "norms", "other")
def largest_safe_eps(h: Histogram, c: float, run_eps: float, weighting: float = 1.0) -> float | None:
    """The largest eps at which the update at c, times clipping's norm weighting, stays within 1% of that at
    c = 1 (bisection in log eps); None where the weighting alone cuts it by more (no eps does)."""
    def within(log_eps: float) -> bool:
        return weighting * update_rms_ratio(h, c, 10**log_eps, run_eps) >= WITHIN

    low, high = -30.0, 0.0
    if within(high):
        return 10**high
    if not within(low):
        return None
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if within(mid) else (low, mid)
    return 10**low


def verdict(ratio: float) -> str:
    return "within 1%" if ratio >= WITHIN else "noticeable" if ratio >= BROKEN else "broken"


def load_histograms(run_dir: Path) -> tuple[float, dict[int, dict[str, Histogram]]]:
    """(the run's eps, {step: {tensor group and "all": Histogram}}) from adam_stats.jsonl's records."""
    if not run_dir.is_dir():
        raise AdviseError(f"error: run folder {str(run_dir)!r} does not exist")
    optimizer = _optimizer_name(run_dir)
    if optimizer is not None and optimizer not in advisable():
        raise AdviseError(f"error: {run_dir} trained with optimizer={optimizer}; the advisor predicts eps's effect "
                          f"on Adam's update (optimizer={' or '.join(advisable())}): {optimizer}'s scale rule is "
                          f"{optimizer_entry(optimizer).scale_rule.kind} (docs/design.md)")
    records = [r for r in read_jsonl(run_dir / "adam_stats.jsonl") if "hist_bins" in r]
    if not records:
        raise AdviseError(f"error: {run_dir} has no sqrt(v_hat) histograms in adam_stats.jsonl (an AdamW run with "
                          "adam_stats_every set, by this version); gradscale-advise runs one")
    steps: dict[int, dict[str, Histogram]] = {}
    for r in records:
        groups = steps.setdefault(int(r["step"]), {})
        h = histogram_of(r)
        for key in (tensor_group(r["tensor"]), "all"):
            groups[key] = groups[key] + h if key in groups else h
    return float(records[0]["eps"]), dict(sorted(steps.items()))


def _config_value(run_dir: Path, key: str):
    config = run_dir / ".hydra" / "config.yaml"
    return OmegaConf.select(OmegaConf.load(config), key) if config.is_file() else None


def _optimizer_name(run_dir: Path) -> str | None:
    return _config_value(run_dir, "optimizer.name")


def clipping(run_dir: Path, scales: list[float]) -> dict | None:
    """Where the run clips (clip_grad_norm = M): for each multiplier c, physics 13's case from the run's grad norms
    at c = 1 (every logged step; step 0 alone from --gradient-only), the share of steps clipped in the fixed run
    and at c, and Adam's norm weighting at c over the fixed run's at the last step (theory.clipped_update_ratio).
    None when the run does not clip."""
    max_norm = _config_value(run_dir, "clip_grad_norm")
    if max_norm is None:
        return None
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if GRAD_NORM in r]
    if not records:
        raise AdviseError(f"error: {run_dir} clips (clip_grad_norm={max_norm}) but logged no grad norm in "
                          "metrics.jsonl; gradscale-advise records one")
    steps, norms = [int(r["step"]) for r in records], np.array([r[GRAD_NORM] for r in records])
    early, late = norms[: max(1, len(norms) // 4)], norms[-max(1, len(norms) // 4):]
    clip = {"max_norm": float(max_norm), "steps": steps, "grad_norms": norms.tolist(),
            "early_median": float(np.median(early)), "late_median": float(np.median(late))}
    clip["predictions"] = [{"c": c, "case": clipping_case(norms, c, max_norm, steps_per_norm=logged_gaps(steps)),
                            "clipped_share_fixed": clipped_share(1.0, norms, max_norm),
                            "clipped_share": clipped_share(c, norms, max_norm),
                            "update_ratio_at_last_step": multipliers(clip, c, steps[-1])[1]} for c in scales]
    return clip


def multipliers(clip: dict | None, c: float, step: int) -> tuple[float, float]:
    """(the multiplier Adam's sqrt(v_hat) carries, the norm weighting) at multiplier c and this step: (c, 1) where
    the run does not clip; where it does, from the grad norms logged up to the step (physics 13): Adam's update
    ratio is the weighting times update_rms_ratio at that multiplier."""
    if clip is None:
        return c, 1.0
    upto = max(1, bisect.bisect_right(clip["steps"], step))
    norms, shape = clip["grad_norms"][:upto], {"steps_per_norm": logged_gaps(clip["steps"][:upto])}
    return (float(handed_multiplier(norms, c, clip["max_norm"], **shape)[-1]),
            float(clipped_update_ratio(norms, c, clip["max_norm"], **shape)[-1]))


def handed_multipliers(run_dir: str | Path, scales: list[float], step: int) -> list[float] | None:
    """For each multiplier c, the multiplier the run's sqrt(v_hat) would carry by this step: that of the gradient
    clipping hands Adam (multipliers), c where the run does not clip; None where it clips but logged no grad norm."""
    try:
        clip = clipping(Path(run_dir), [])
    except AdviseError:
        return None
    return [multipliers(clip, c, step)[0] for c in scales]


def logged_gaps(steps: list[int]) -> np.ndarray:
    """How many optimizer steps each logged grad norm stands for (a run logs every log_every-th step, and its
    last): the norm at a logged step is taken for the steps since the one logged before."""
    return np.diff(np.asarray(steps), prepend=-1)


CASE_MEANS = {
    "a": "both runs clip at (nearly) every step: the bug vanishes (to float rounding in fp32, into the seed band in "
         "bf16)",
    "b": "the fixed run clips at (nearly) every step, the bug's at (almost) none: Adam weights the steps differently",
    "c": "neither run clips (or almost never): the unclipped answer above holds",
    "mixed": "the runs clip on different steps: Adam weights those steps differently",
}


def format_clipping(clip: dict, labels: list[str], eps: float) -> str:
    """One line per N (or c): physics 13's case, the clipped shares, and what to do."""
    norms, max_norm = clip["grad_norms"], clip["max_norm"]
    if len(norms) == 1:
        head = (f"clipping at max_norm {short_number(max_norm)}, at step 0 only (one gradient, grad norm "
                f"{short_number(norms[0], 3)}): the cases below are step 0's; a fine-tune's norms fall after its "
                "first steps, so later steps clip less than step 0 says")
    else:
        head = (f"clipping at max_norm {short_number(max_norm)}, from the grad norms of {len(norms)} logged steps "
                f"({short_number(min(norms), 3)}-{short_number(max(norms), 3)}; median "
                f"{short_number(clip['early_median'], 3)} in the first quarter, {short_number(clip['late_median'], 3)}"
                " in the last" + (": early norms run higher, so over a longer run later steps clip less)"
                                  if clip["early_median"] > clip["late_median"] else ")"))
    lines = [head]
    for label, p in zip(labels, clip["predictions"]):
        c = p["c"]
        shares = (f"fixed run clipped at {p['clipped_share_fixed']:.0%} of the steps, the bug's at "
                  f"{p['clipped_share']:.0%}")
        if p["case"] == "a":
            todo = "nothing to do while the norms stay above N x max_norm (the fix is still right)"
        elif p["case"] == "c":
            todo = f"as without clipping: the fix, or eps = {eps * c:g}"
        else:
            todo = (f"the fix, or both eps = {eps * c:g} and max_norm = {max_norm * c:g} "
                    "(eps alone repairs nothing here)")
        update = ("" if p["case"] in ("a", "c") or len(norms) == 1 else
                  f"; the norm weighting alone makes Adam's update {p['update_ratio_at_last_step']:.3f} of the "
                  "fixed run's at the last step")
        lines.append(f"{label}: case ({p['case']}): {CASE_MEANS[p['case']]} ({shares}{update}). Do: {todo}")
    return "\n".join(lines)


def advise(run_dir: Path, scales: list[float], eps: float | None = None) -> dict:
    """The JSON contract: {"eps", "steps": [{"step", "predictions": [{"c", "update_rms_ratio",
    "eps_dominated_share", "groups": {group: {...}}, "largest_eps_within_1pct", "handed_multiplier",
    "norm_weighting"}]}], "clipping": None or
    {"max_norm", "grad_norms", "predictions": [{"c", "case", "clipped_share_fixed", "clipped_share", ...}]}}."""
    run_eps, steps = load_histograms(run_dir)
    eps = run_eps if eps is None else eps
    out = {"run": str(run_dir), "eps": eps, "run_eps": run_eps, "steps": [], "clipping": clipping(run_dir, scales)}
    for step, groups in steps.items():
        predictions = []
        for c in scales:
            seen, weighting = multipliers(out["clipping"], c, step)
            whole = groups["all"]
            predictions.append({
                "c": c, "update_rms_ratio": weighting * update_rms_ratio(whole, seen, eps, run_eps),
                "eps_dominated_share": eps_dominated_share(whole, seen, eps),
                "largest_eps_within_1pct": largest_safe_eps(whole, seen, run_eps, weighting),
                "handed_multiplier": seen, "norm_weighting": weighting,
                "groups": {g: {"update_rms_ratio": weighting * update_rms_ratio(groups[g], seen, eps, run_eps),
                               "eps_dominated_share": eps_dominated_share(groups[g], seen, eps),
                               "coordinates": int(groups[g].counts.sum())}
                           for g in GROUPS if g in groups},
            })
        out["steps"].append({"step": step, "predictions": predictions})
    return out


def predicted_onset(h: Histogram, eps: float) -> float:
    """The multiplier c below which the predicted update RMS falls more than 1% (bisection in log c)."""
    low, high = -15.0, 0.0
    if update_rms_ratio(h, 10**low, eps, eps) >= WITHIN:
        return 10**low
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if update_rms_ratio(h, 10**mid, eps, eps) >= WITHIN else (mid, high)
    return 10**high


def advisor_vs_measured(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """Step by step, for every AdamW run at c_eff != 1 whose reference (same setup at c = 1, or the fixed run it
    stands against at another world size: tables.compared_references) has histograms:
    the update-RMS ratio predicted from the reference's histogram of that step (and from its grad norms where it
    clips: multipliers), and the measured ratio of the two runs' train/update_rms. Columns: run, setup, c_eff,
    step, predicted, measured, error (relative)."""
    against, by_name = compared_references(runs), runs.set_index("run")
    paths = dict(zip(runs.run, runs.path))
    histograms: dict[str, tuple[float, dict, dict | None] | None] = {}
    rows = []
    for r in runs.itertuples():
        ref, _ = against.get(r.run, (None, None))
        if (ref is None or r.optimizer not in advisable(whole_model=True) or np.isclose(r.c_eff, 1.0)
                or not _same_optimizer_settings(r, by_name.loc[ref])):
            continue
        if ref not in histograms:
            try:
                histograms[ref] = (*load_histograms(Path(paths[ref])), clipping(Path(paths[ref]), []))
            except AdviseError:
                histograms[ref] = None
        if histograms[ref] is None:
            continue
        eps, steps, clip = histograms[ref]
        mine, theirs = curve(curves, r.run, UPDATE_RMS), curve(curves, ref, UPDATE_RMS)
        for step, groups in steps.items():
            if step in mine.index and step in theirs.index and theirs[step] > 0:
                seen, weighting = multipliers(clip, r.c_eff, step)
                predicted = weighting * update_rms_ratio(groups["all"], seen, eps, eps)
                measured = mine[step] / theirs[step]
                rows.append({"run": r.run, "setup": r.setup, "c_eff": r.c_eff, "step": step, "predicted": predicted,
                             "measured": measured, "error": predicted / measured - 1})
    return pd.DataFrame(rows, columns=["run", "setup", "c_eff", "step", "predicted", "measured", "error"])


def _same_optimizer_settings(run, reference) -> bool:
    """The advisor predicts the bug at the reference's eps and max_norm: not a repair that changes them."""
    # reference is a row, whose .clip is pandas' method: index it
    return same_number(run.eps, reference["eps"]) and same_number(run.clip, reference["clip"])


TRUSTED = 0.05  # relative error of the predicted update ratio the comparison calls agreement


def advisor_summary(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per run: prediction and measurement at the first and last compared step, the largest relative error,
    and the first step whose error passes 5% (where the prediction stops being trustworthy)."""
    rows = []
    for run, group in comparison.groupby("run", sort=False):
        group = group.sort_values("step")
        first, last = group.iloc[0], group.iloc[-1]
        off = group[group.error.abs() > TRUSTED]
        rows.append({"setup": first.setup, "c_eff": first.c_eff, "first step": int(first.step),
                     "predicted": first.predicted, "measured": first.measured, "error": first.error,
                     "last step": int(last.step), "predicted at last": last.predicted,
                     "measured at last": last.measured, "error at last": last.error,
                     "max abs error": group.error.abs().max(),
                     "first step off by > 5%": int(off.step.iloc[0]) if len(off) else None, "run": run})
    return pd.DataFrame(rows)


def predicted_onsets(runs: pd.DataFrame) -> dict[str, float]:
    """setup -> c where the advisor, from its c = 1 reference's first recorded histogram, predicts a 1% update
    cut: the mark on the breakdown figure."""
    onsets = {}
    for r in runs[runs.optimizer.isin(advisable(whole_model=True)) & np.isclose(runs.c_eff, 1.0)].itertuples():
        try:
            eps, steps = load_histograms(Path(r.path))
        except AdviseError:
            continue
        onsets.setdefault(r.setup, predicted_onset(next(iter(steps.values()))["all"], eps))
    return onsets


def format_advice(advice: dict, labels: list[str]) -> str:
    """The table for the last recorded step: one row per c (labelled by N or c), the groups that go first."""
    last = advice["steps"][-1]
    rows = []
    for label, p in zip(labels, last["predictions"]):
        first = sorted((g for g in p["groups"].items() if g[1]["update_rms_ratio"] < WITHIN),
                       key=lambda g: g[1]["update_rms_ratio"])
        rows.append((label, f"{p['update_rms_ratio']:.4f}", f"{p['eps_dominated_share']:.2%}",
                     verdict(p["update_rms_ratio"]), "none" if p["largest_eps_within_1pct"] is None
                     else short_number(p["largest_eps_within_1pct"], 2),
                     ", ".join(f"{g} {v['update_rms_ratio']:.3f}" for g, v in first) or "-"))
    header = ("", "update ratio", "eps-dominated", "verdict", "eps within 1%", "goes first (group update ratio)")
    repairs = ", ".join(f"{label}: {short_number(advice['eps'] * p['c'], 3)}"
                        for label, p in zip(labels, last["predictions"], strict=True))
    clipped = "" if advice.get("clipping") is None else (
        f"\nclipped at max_norm {short_number(advice['clipping']['max_norm'])}: Adam is handed min(c ||g||, "
        "max_norm), so eps meets the multiplier sqrt(v_hat) carries (" + ", ".join(
            f"{label}: {short_number(p['handed_multiplier'], 2)}"
            for label, p in zip(labels, last["predictions"], strict=True))
        + ") and the update ratio includes the norm weighting of the clipping lines below (docs/design.md physics 13);"
          " eps within 1% is 'none' where that weighting alone cuts the update by more than 1%")
    step_zero = ("\nstep 0 (gradient-only) understates the cut: the rare rows' sqrt(v_hat) falls as steps go by "
                 "without their tokens; the 20-step mode gives the number" if last["step"] == 0 else "")
    return (f"{advice['run']}: AdamW, eps = {short_number(advice['eps'])}, predicted from the sqrt(v_hat) histograms "
            f"of step {last['step']} (the last of {len(advice['steps'])} recorded)\n"
            f"verdict: update ratio >= {WITHIN} within 1%, >= {BROKEN} noticeable, below broken\n"
            f"eps within 1%: a tolerance, the largest eps that keeps the update within 1% of the fixed run's at step "
            f"{last['step']}; the exact repair without the fix is eps x c (eps / N for the world-size bug: {repairs}), "
            f"which gives the fixed run's update at every step (with max_norm x c where the loop clips)"
            f"{clipped}{step_zero}\n\n" + render_table(header, rows))


def plot_advice(advice: dict, labels_n: list[float], measured: list[tuple[float, float, str]] | None = None):
    """Predicted update-RMS ratio against N (c = 1/N), a line per tensor group at the last recorded step and the
    whole model at step 0; measured (N, ratio, label) points on top."""
    import matplotlib.pyplot as plt

    first, last = advice["steps"][0], advice["steps"][-1]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    styles = dict(zip(GROUPS, ("-o", "-s", "-^", "-v", "-x")))
    for group in GROUPS:
        if group in last["predictions"][0]["groups"]:
            ax.plot(labels_n, [p["groups"][group]["update_rms_ratio"] for p in last["predictions"]],
                    styles[group], ms=3.5, label=f"{group} (step {last['step']})")
    ax.plot(labels_n, [p["update_rms_ratio"] for p in last["predictions"]], "k-", lw=2.2,
            label=f"whole model (step {last['step']})")
    if first is not last:
        ax.plot(labels_n, [p["update_rms_ratio"] for p in first["predictions"]], "k--", lw=1.2,
                label=f"whole model (step {first['step']})")
    for n, ratio, label in measured or []:
        ax.plot([n], [ratio], "r*", ms=11, zorder=5)
        ax.annotate(label, (n, ratio), textcoords="offset points", xytext=(6, -10), fontsize=7, color="r")
    ax.axhline(WITHIN, color="0.4", ls=":", lw=1, label="1% cut (verdict: within 1% above)")
    clip = advice.get("clipping")
    ax.set(xscale="log", xlabel="world size N of the bug (c = 1/N)", ylabel="update RMS / update RMS at c = 1",
           title=f"Predicted AdamW update cut, eps = {short_number(advice['eps'])}"
                 + ("" if clip is None else f", clipped at max_norm {short_number(clip['max_norm'])}"))
    ticks = [n for n in labels_n if math.log2(n) % 2 == 1 or len(labels_n) < 8]
    ax.set_xticks(ticks, [f"{n:g}" for n in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m gradscale.analysis.advise", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Verdicts: update-RMS ratio >= 0.99 within 1%, >= 0.90 noticeable, "
                                  "below broken.\n\nexample: python -m gradscale.analysis.advise RUN_DIR "
                                  "--world-sizes 8,64,1024 (RUN_DIR: gradscale-advise's)")
    parser.add_argument("run_dir", type=Path, help="an AdamW run folder with sqrt(v_hat) histograms "
                        "(adam_stats_every set; gradscale-advise makes one)")
    parser.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                        help="comma-separated N: predict the bug's c = 1/N (default 2,4,...,4096)")
    parser.add_argument("--scales", help="comma-separated multipliers c instead of world sizes, e.g. 1e-4,1e-5")
    parser.add_argument("--eps", type=float, help="predict for this eps (default: the run's)")
    parser.add_argument("--json", type=Path, help="also write every recorded step's predictions here")
    parser.add_argument("--figure", type=Path, help="the figure's file (default RUN_DIR/advice.png)")
    args = parser.parse_args(argv)
    try:
        scales, labels = check_options(args.world_sizes, args.scales, args.eps, args.json, args.figure)
        advice = advise(args.run_dir, scales, args.eps)
    except AdviseError as e:
        print(e, file=sys.stderr)
        return 2
    print(format_advice(advice, labels))
    if advice["clipping"] is not None:
        print("\n" + format_clipping(advice["clipping"], labels, advice["eps"]))
    if args.json:
        args.json.write_text(json.dumps(advice, indent=1))
        print(f"json: {args.json}")
    if not installed("matplotlib"):
        print("figure: none (matplotlib is not installed: pip install 'gradscale[report]')")
        return 0
    import matplotlib

    matplotlib.use("Agg")
    figure = args.figure or args.run_dir / "advice.png"
    plot_advice(advice, [1 / c for c in scales]).savefig(figure, dpi=200)
    print(f"figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
