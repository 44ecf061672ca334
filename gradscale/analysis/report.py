"""`gradscale-report SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--wandb]`

Writes every standard figure that applies to the sweep (PNG, 200 dpi) and report.md: the runs table and,
per setup and scale, final loss, max |Δ loss| vs the reference run, grad-norm ratio at step 0 and
status. Figures that do not apply are skipped with a one-line reason.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from gradscale.analysis.advise import advisor_summary, advisor_vs_measured, handed_multipliers, predicted_onsets
from gradscale.analysis.load import load, logged_group
from gradscale.analysis.tables import (
    compared_references,
    eps_share_table,
    equivalence_table,
    measured_bands,
    pair_references,
    seed_band_table,
    summary_table,
    theory_table,
)
from gradscale.checks import CommandParser
from gradscale.records import BUCKETS, CLIP_COEF, EPS_DOMINATED, EVAL_LOSS, eval_loss_of
from gradscale.runs import short_number

log = logging.getLogger(__name__)
DPI = 200


def _figures(runs: pd.DataFrame, curves: pd.DataFrame, advisor: pd.DataFrame) -> list[tuple[str, Callable | None, str]]:
    """(file stem, figure maker or None, reason when None) for every standard figure; advisor: the table of
    advisor_vs_measured."""
    from gradscale.analysis import plots  # matplotlib: the report extra
    paired = pair_references(runs)
    has_pairs = any(ref is not None and ref != run for ref, run in zip(paired, runs.run))
    compared = bool(compared_references(runs))  # pairs, and the runs read against a twin, contrast or stand-in
    adam = (curves.metric == EPS_DOMINATED).any()
    lrs_per_opt = runs.groupby("setup").lr.nunique().max()
    c_per_opt = runs.groupby("setup").c_eff.nunique().max()
    several_eps = runs[runs.eps.notna()].groupby("optimizer").eps.nunique().max() > 1
    clipped = runs["clip"].notna().any() and runs.clipped_steps.notna().any()
    no_ref = "no run pairs with a reference (same config at scale 1, fix on)"
    buckets = (curves.metric == eval_loss_of("rare")).any()
    no_buckets = "no run logged the token-frequency buckets (gradscale/frequency.py)"
    return [
        ("loss_curves", lambda: plots.loss_curves(runs, curves), ""),
        ("divergence", (lambda: plots.divergence(runs, curves)) if has_pairs else None, no_ref),
        ("grad_norm_ratio", (lambda: plots.grad_norm_ratio(runs, curves)) if has_pairs else None, no_ref),
        ("breakdown", (lambda: plots.breakdown(runs, curves, measured_bands(runs, curves), predicted_onsets(runs)))
         if has_pairs else None, no_ref),
        ("eps_collapse", (lambda: plots.eps_collapse(runs)) if several_eps else None,
         "needs runs at several eps for one optimizer"),
        ("clipping", (lambda: plots.clipping(runs, curves)) if clipped else None, "no run with clipping"),
        ("clip_coefficient", (lambda: plots.clip_coefficient(runs, curves)) if (curves.metric == CLIP_COEF).any()
         else None, "no run logged train/clip_coef (clip_grad_norm set)"),
        ("lr_separation", (lambda: plots.lr_separation(runs, curves)) if has_pairs and lrs_per_opt > 1 else None,
         "needs pairs with a reference at several learning rates"),
        ("final_loss_heatmap", (lambda: plots.final_loss_heatmap(runs)) if lrs_per_opt > 1 and c_per_opt > 1
         else None, "needs at least 2 learning rates and 2 values of c_eff for one setup"),
        ("adam_state", (lambda: plots.adam_state(runs, curves)) if adam else None, "no Adam-type runs"),
        ("lr_axis", (lambda: plots.lr_axis(runs)) if lrs_per_opt > 1 else None, "no lr axis: one lr per setup"),
        ("token_frequency_loss", (lambda: plots.token_frequency(runs, curves, "loss")) if buckets and compared
         else None, no_buckets if not buckets else no_ref),
        ("token_frequency_update", (lambda: plots.token_frequency(runs, curves, "update")) if buckets and compared
         else None, no_buckets if not buckets else no_ref),
        ("advisor_along_run", (lambda: plots.advisor_along_run(advisor, runs)) if len(advisor) else None,
         "no AdamW run beside a reference with sqrt(v_hat) histograms (adam_stats_every)"),
    ]


def _markdown(table: pd.DataFrame) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else short_number(value, 4)
        return "-" if value is None else str(value)

    header = "| " + " | ".join(table.columns) + " |"
    rule = "|" + "|".join("---" for _ in table.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body])


def write_report(paths: list[str | Path], out: Path) -> tuple[Path, list[Path]]:
    runs, curves = load(paths)
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    advisor = advisor_vs_measured(runs, curves)
    for stem, make, reason in _figures(runs, curves, advisor):
        if make is None:
            skipped.append(f"- `{stem}`: skipped, {reason}")
            print(f"skipped {stem}: {reason}")
            continue
        fig = make()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
        print(f"wrote {path}")
    summary = summary_table(runs, curves)
    theory, equivalences = theory_table(runs, curves), equivalence_table(runs, curves)
    eps_shares = eps_share_table(runs, handed_multipliers)
    band = seed_band_table(runs, curves, [EVAL_LOSS, *(eval_loss_of(b) for b in BUCKETS)])
    run_columns = ["run", "model", "setup", "lr", "eps", "scale", "fix", "world_size", "c_eff", "status", "final_loss",
                   "best_eval_loss", "steps_done"]
    lines = [
        "# gradscale report", "", f"Sweeps: {', '.join(str(p) for p in paths)}", "",
        "## Per setup and scale", "",
        "max abs Δloss is over logged steps, against the run identical but for scale 1 with the fix on.", "",
        _markdown(summary.drop(columns=["reference"])), "",
        "## Breakdown against theory", "",
        "Where max |Δ loss| passes 1% of the reference's final loss (a diverged run counts as past it), "
        "against the predicted band: eps/s for s between the q90 and q10 of the reference's sqrt(v_hat) "
        "(Adam), or max_norm/max ||g|| .. max_norm/min ||g|| of its grad norms (clipping).", "",
        _markdown(theory) if len(theory) else "No setup with a reference and two values of c_eff.", "",
        "## eps-dominated share by tensor group", "",
        "Share of coordinates with c * sqrt(v_hat) < eps at the reference's last recorded step, for c = 1 and the "
        "world-size bug at N = 8, 64, 1024 (interpolated between each tensor's measured quantiles; 0.01 reads "
        "'at most 1%', 0.99 'at least 99%')." + (
            " Where the loop clips, sqrt(v_hat) carries not 1/N but the multiplier of the clipped gradient Adam "
            "is handed, from the reference's grad norms up to that step (docs/design.md physics 13, 'Where eps "
            "comes in'): the c= columns are read at it, and the last column gives it per N."
            if runs["clip"].notna().any() else ""), "",
        _markdown(eps_shares) if len(eps_shares) else "No Adam-type reference run with statistics.", "",
        "## Advisor vs measured", "",
        "AdamW's update-RMS ratio to its c = 1 reference: predicted by the risk advisor (analysis.advise) from the "
        "reference's sqrt(v_hat) histogram of each step, against the measured ratio of the two runs' "
        "train/update_rms; error = predicted / measured - 1. Step by step in advisor_vs_measured.csv.", "",
        _markdown(advisor_summary(advisor)) if len(advisor) else
        "No AdamW run beside a reference with sqrt(v_hat) histograms (adam_stats_every).", "",
        "## Against the seed band", "",
        "Each run's held-out loss (overall and by token-frequency bucket) minus its reference's (the fixed run it "
        "pairs with, is called equal to, contrasts with or would be repaired to), at the last eval, "
        "in units of the sample standard deviation over the reference's repeats at other seeds (runs identical "
        "but for the data order): what changing nothing but the seed does. Also in seed_band.csv.", "",
        _markdown(band) if len(band) else "No reference repeated at two or more seeds.", "",
        "## Equivalences the theory calls exact", "",
        "SGD(lr, c) == SGD(lr*c, 1), AdamW(c, eps) == AdamW(1, eps/c) (where the loop clips at M, the twin clips at "
        "M/c), and a run at c_eff = 1 by another scale and fix == its reference (the bug is a pure rescale), for the "
        "pairs this sweep holds.", "",
        _markdown(equivalences) if len(equivalences) else "No such pair in this sweep.", "",
        "## Figures", "", *[f"![{p.stem}]({p.name})" for p in written], "", *skipped, "",
        "## Runs", "", _markdown(runs[run_columns]), "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    summary.to_csv(out / "summary.csv", index=False)
    if len(advisor):
        advisor.to_csv(out / "advisor_vs_measured.csv", index=False)
    if len(band):
        band.to_csv(out / "seed_band.csv", index=False)
    return report, written


def log_to_wandb(paths: list[Path], out: Path, figures: list[Path], mode: str, project: str) -> None:
    """One W&B run of job_type `analysis` in the sweep's group: the figures and the runs table."""
    from gradscale.metrics import wandb_disabled_by_env

    if wandb_disabled_by_env():  # the environment switches W&B off, as it does for training runs
        print("W&B logging skipped: WANDB_MODE=disabled in the environment", file=sys.stderr)
        return
    try:
        import wandb

        runs, _ = load(paths)
        first = Path(runs.path.iloc[0])
        group = logged_group(first, OmegaConf.to_container(OmegaConf.load(first / ".hydra" / "config.yaml")))
        run = wandb.init(project=project, group=group or Path(paths[0]).name, job_type="analysis", name="report",
                         mode=mode, dir=str(out), settings=wandb.Settings(init_timeout=60, console="off"))
        run.log({f"figures/{p.stem}": wandb.Image(str(p)) for p in figures})
        run.log({"runs": wandb.Table(dataframe=runs.astype({"clip": str}))})
        run.finish()
        print(f"W&B analysis run logged ({mode}) under {out / 'wandb'}")
    except Exception as e:  # the report on disk is what counts
        print(f"warning: W&B logging failed ({type(e).__name__}: {e}); the report on disk is complete",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="gradscale-report", description=__doc__.split("\n\n")[1])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep folders or run folders")
    parser.add_argument("--out", type=Path, help="output folder (default: FIRST_SWEEP/report)")
    parser.add_argument("--wandb", action="store_true", help="also log figures and runs table to W&B")
    parser.add_argument("--wandb-mode", choices=("offline", "online"), default="offline",
                        help="with --wandb: offline (a local run under OUT/wandb, sync later) or online "
                             "(default: offline)")
    parser.add_argument("--wandb-project", default="gradscale",
                        help="with --wandb: the W&B project to log to (default: gradscale)")
    args = parser.parse_args(argv)
    out = args.out or args.sweeps[0] / "report"
    from gradscale.checks import ConfigError, check_writable, require

    try:
        require("matplotlib", "report", "gradscale-report")
        check_writable("--out", out)  # before the figures, not after them
        report, figures = write_report(args.sweeps, out)
    except (FileNotFoundError, ConfigError) as e:
        print(str(e) if str(e).startswith("error:") else f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    if args.wandb:
        log_to_wandb(args.sweeps, out, figures, args.wandb_mode, args.wandb_project)
    return 0


if __name__ == "__main__":
    sys.exit(main())
