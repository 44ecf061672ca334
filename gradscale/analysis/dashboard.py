"""`python -m gradscale.analysis.dashboard SWEEP_DIR [--entity E] [--project P] [--group G] [--dry-run] [--out FILE]
[--report] [--report-dir DIR] [--report-out FILE]`

Builds the W&B workspace a reader of one sweep needs: loss by optimizer and scale, grad norm (the ratio between
scales reads as a constant gap on its log axis), update RMS, Adam's eps-dominated share and eval loss, over the
sweep's training runs (filtered by the W&B group the runs logged under), grouped by optimizer, the other config
keys the sweep varies, and scale. --report adds a W&B Report: the same panels, the figures that
`gradscale-report SWEEP_DIR --wandb` logged, and the tables of its report.md.

Saving needs a W&B API key (`wandb login` or WANDB_API_KEY) and the network. --dry-run needs neither: it writes
the specs as JSON (what would be saved; a saved report's run sets also name the project, looked up on save).
docs/dashboards.md has the details.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gradscale.analysis.load import logged_group, read_jsonl, run_dirs
from gradscale.checks import CommandParser
from gradscale.metrics import write_text_atomic
from gradscale.records import (
    BUCKETS,
    EPS_DOMINATED,
    EVAL_LOSS,
    GRAD_NORM,
    SQRT_V_RMS,
    TRAIN_LOSS,
    UPDATE_RMS,
    eval_loss_of,
    output_update_rms_of,
)

# The views, in order: (section, [(kind, metric, log_y)]). A panel whose metric no run of the sweep logs
# (adam/* in an SGD-only sweep) is left out. Metric names are the keys of metrics.jsonl (gradscale/train.py).
VIEWS = (
    ("Loss by optimizer and scale", [("line", TRAIN_LOSS, False), ("scatter", TRAIN_LOSS, False)]),
    ("Grad norm: the ratio between scales is the gap on the log axis",
     [("line", GRAD_NORM, True), ("scatter", GRAD_NORM, True)]),
    ("Update RMS", [("line", UPDATE_RMS, True)]),
    ("Adam: eps-dominated share", [("line", EPS_DOMINATED, False), ("line", SQRT_V_RMS, True)]),
    ("Eval loss", [("line", EVAL_LOSS, False), ("bar", EVAL_LOSS, False)]),
    ("Where the cut lands: held-out loss and output-row updates by token frequency",
     [("line", eval_loss_of(bucket), False) for bucket in BUCKETS]
     + [("line", output_update_rms_of(bucket), True) for bucket in BUCKETS]),
)
STEP = "step"  # every record carries it; RunLog makes it W&B's step metric (W&B's own _step counts log calls)
GROUP_FIRST, GROUP_LAST = "optimizer.name", "scale"  # the study's two axes, in every run's config
NOT_A_SETUP = ("wandb.", "seed")  # varying these does not make another setup: runs differing only here are averaged
INSTALL = "pip install wandb-workspaces (or: make install)"


class DashboardError(Exception):
    """A one-line reason, starting with 'error:'."""


@dataclass
class Sweep:
    path: Path
    runs: list[Path]
    group: str  # the W&B group of its training runs
    project: str  # the W&B project they logged to (wandb.project)
    logged: set[str]  # every key in the runs' metrics.jsonl
    groupby: list[str]  # config keys (dotted) the workspace groups by
    figures: list[str]  # figure names in report.md (gradscale.analysis.report logs each as figures/NAME)
    tables: str | None  # report.md without its title and figure lines; None without a report.md


def read_sweep(path: Path, group: str | None = None, report_dir: Path | None = None) -> Sweep:
    try:
        runs = run_dirs([path])
    except FileNotFoundError as e:
        raise DashboardError(str(e)) from None
    configs = [OmegaConf.to_container(OmegaConf.load(r / ".hydra" / "config.yaml"), resolve=False) for r in runs]
    if group is None:
        groups = {logged_group(r, c) for r, c in zip(runs, configs)}
        if None in groups:
            raise DashboardError(f"error: the runs under {path} logged no W&B group (single runs get none): pass "
                                 "--group, or run them as a sweep (-m) or with wandb.group=NAME")
        if len(groups) > 1:
            raise DashboardError(f"error: the runs under {path} logged under {len(groups)} W&B groups "
                                 f"({', '.join(sorted(groups))}); pass --group, or one sweep folder")
        group = groups.pop()
    logged = {key for r in runs for record in read_jsonl(r / "metrics.jsonl") for key in record}
    if not logged:
        raise DashboardError(f"error: no run under {path} has logged metrics (metrics.jsonl) yet")
    tables, figures = read_report_md((report_dir or path / "report") / "report.md")
    return Sweep(path, runs, group, str(configs[0]["wandb"]["project"]), logged, grouping_keys(configs), figures,
                 tables)


def grouping_keys(configs: list[dict]) -> list[str]:
    """optimizer.name, each other config key (in config order) that tells runs apart which the keys before it do
    not (optimizer.lr differs between sgd and adamw presets, but optimizer.name already says so), then scale."""
    flat = [{k: json.dumps(v, sort_keys=True) for k, v in flatten(c).items()} for c in configs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    chosen = [GROUP_FIRST]
    for key in keys:
        if key in (GROUP_FIRST, GROUP_LAST) or key.startswith(NOT_A_SETUP):
            continue
        seen: dict[tuple, str | None] = {}
        for f in flat:
            setup = tuple(f.get(k) for k in chosen)
            if seen.setdefault(setup, f.get(key)) != f.get(key):  # the same setup so far, another value
                chosen.append(key)
                break
    return [*chosen, GROUP_LAST]


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


FIGURE_LINE = re.compile(r"^!\[[^\]]*\]\(([^)]+)\.png\)\s*$")


def read_report_md(path: Path) -> tuple[str | None, list[str]]:
    """report.md's tables (its title and figure lines dropped: a W&B Report cannot show local PNGs) and the
    names of its figures."""
    if not path.exists():
        return None, []
    kept, figures = [], []
    for line in path.read_text().splitlines():
        match = FIGURE_LINE.match(line)
        if match:
            figures.append(Path(match.group(1)).name)
        elif not line.startswith("# "):
            kept.append(line)
    if figures:
        kept = [line if line != "## Figures" else "## Figures\n\nIn the panel grid \"Figures\" above." for line in kept]
    return "\n".join(kept).strip() + "\n", figures


def _import_wandb_workspaces():
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:
        raise DashboardError(f"error: wandb-workspaces is not installed ({e}); {INSTALL}") from None
    return ws, wr


def panels(sweep: Sweep) -> list:
    """The VIEWS' panels for the metrics this sweep logged, as (section name, [panel])."""
    _, wr = _import_wandb_workspaces()
    sections = []
    for name, specs in VIEWS:
        made = [_panel(wr, kind, metric, log_y) for kind, metric, log_y in specs if metric in sweep.logged]
        if made:
            sections.append((name, made))
    return sections


def _panel(wr, kind: str, metric: str, log_y: bool):
    if kind == "line":
        return wr.LinePlot(title=metric, x=STEP, y=[metric], log_y=log_y or None, title_x=STEP)
    if kind == "scatter":  # one point per run: its last value against its scale
        return wr.ScatterPlot(title=f"last {metric} vs scale", x=wr.Config("scale"), y=wr.SummaryMetric(metric),
                              log_x=True, log_y=log_y or None)
    return wr.BarPlot(title=f"last {metric}", metrics=[metric])


def view_name(text: str) -> str:
    """A workspace or report name W&B accepts: at most 128 characters, and none of the symbol categories
    wandb-workspaces refuses as emoji (math symbols included: `=` reads `:`, `+` and `~` are dropped)."""
    symbols = ("So", "Sk", "Sm", "Sc", "Cs")
    text = text.replace("=", ":")
    return "".join(c for c in text if not unicodedata.category(c).startswith(symbols))[:128]


def run_filters(ws, group: str, job_type: str):
    """This sweep's runs of one job type: training runs (gradscale.run) or the analysis run (gradscale-report)."""
    return ws.And(ws.Metric("Group") == group, ws.Metric("JobType") == job_type)


def build_workspace(sweep: Sweep, entity: str, project: str):
    ws, _ = _import_wandb_workspaces()
    sections = [ws.Section(name=name, panels=made, is_open=True, panel_settings=ws.SectionPanelSettings(x_axis=STEP))
                for name, made in panels(sweep)]
    return ws.Workspace(
        entity=entity, project=project, name=view_name(f"gradscale {sweep.group}"), sections=sections,
        settings=ws.WorkspaceSettings(x_axis=STEP, max_runs=max(10, len(sweep.runs))),  # every run, not W&B's 10
        runset_settings=ws.RunsetSettings(filters=run_filters(ws, sweep.group, "train"),
                                          groupby=[ws.Config(key) for key in sweep.groupby]),
    )


def build_report(sweep: Sweep, entity: str, project: str, *, name_project: bool):
    """name_project: the run sets name entity/project, which wandb-workspaces turns into the project's id with
    an API call; without it (--dry-run) they are left to the report's own project."""
    ws, wr = _import_wandb_workspaces()
    where = {"entity": entity, "project": project} if name_project else {}
    train_runs = wr.Runset(name="training runs", filters=run_filters(ws, sweep.group, "train"),
                           groupby=[f"config.{key}" for key in sweep.groupby], **where)
    blocks = [
        wr.MarkdownBlock(text=f"Sweep folder `{sweep.path}`, W&B group `{sweep.group}`: {len(sweep.runs)} runs, "
                              f"grouped by {', '.join(sweep.groupby)}."),
        wr.H2(text="Curves"),
        wr.PanelGrid(runsets=[train_runs], panels=[p for _, made in panels(sweep) for p in made]),
    ]
    if sweep.figures:  # gradscale.analysis.report --wandb logs its run in the training runs' group
        analysis_run = wr.Runset(name="analysis run", filters=run_filters(ws, sweep.group, "analysis"), **where)
        blocks += [
            wr.H2(text="Figures"),
            wr.PanelGrid(runsets=[analysis_run], panels=[wr.MediaBrowser(title=name, media_keys=[f"figures/{name}"])
                                                         for name in sweep.figures]),
        ]
    if sweep.tables is not None:
        blocks.append(wr.MarkdownBlock(text=sweep.tables))
    return wr.Report(entity=entity, project=project, title=view_name(f"gradscale sweep {sweep.group}"),
                     description="Curves, figures and tables of one sweep (gradscale.analysis.dashboard --report)",
                     blocks=blocks)


def spec_json(view) -> str:
    """The spec as the W&B API would receive it (offline: _to_model only builds pydantic models)."""
    return json.dumps(view._to_model().model_dump(mode="json", by_alias=True, exclude_none=True), indent=1) + "\n"


def save_online(workspace, report, entity: str, project: str) -> list[str]:
    """Saves the workspace (and report); returns their URLs."""
    what = "workspace"
    try:
        import wandb

        wandb.Api()  # no key: fails here, before anything is sent
        workspace.save()
        urls = [workspace.url]
        if report is not None:
            what = "report (the workspace is saved: " + urls[0] + ")"
            report.save()
            urls.append(report.url)
        return urls
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise DashboardError(f"error: saving the W&B {what} to {entity}/{project} failed ({type(e).__name__}: "
                             f"{reason}); needs an API key (wandb login, or WANDB_API_KEY) and the network, or "
                             "write the specs offline with --dry-run") from None


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m gradscale.analysis.dashboard", description=__doc__.split("\n\n")[1])
    parser.add_argument("sweep", type=Path, help="sweep folder (the hydra.sweep.dir of python -m gradscale.run -m)")
    parser.add_argument("--entity", help="W&B entity (user or team) that owns the project; needed to save, not "
                                         f"for --dry-run (whose specs then name {PLACEHOLDER_ENTITY!r})")
    parser.add_argument("--project", help="W&B project (default: the one the runs logged to, wandb.project)")
    parser.add_argument("--group", help="W&B group of the training runs (default: the one they logged under: "
                                        "wandb.group, else the sweep folder's name)")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the specs as JSON, no network and no API key needed")
    parser.add_argument("--out", type=Path, help="--dry-run: workspace spec file (default: SWEEP/wandb_workspace.json)")
    parser.add_argument("--report", action="store_true",
                        help="also a W&B Report: the panels, the figures that gradscale.analysis.report --wandb logged "
                             "(panels of that run; local PNGs are not uploaded) and report.md's tables")
    parser.add_argument("--report-dir", type=Path, help="gradscale-report's output folder (default: SWEEP/report)")
    parser.add_argument("--report-out", type=Path,
                        help="--dry-run --report: report spec file (default: SWEEP/wandb_report.json)")
    return parser


PLACEHOLDER_ENTITY = "ENTITY"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.entity is None and not args.dry_run:
        print("error: --entity is needed to save to W&B (your user or team); --dry-run writes the specs without it",
              file=sys.stderr)
        return 2
    args.entity = args.entity or PLACEHOLDER_ENTITY
    try:
        _import_wandb_workspaces()
        sweep = read_sweep(args.sweep, args.group, args.report_dir)
        project = args.project or sweep.project
        workspace = build_workspace(sweep, args.entity, project)
        report = build_report(sweep, args.entity, project, name_project=not args.dry_run) if args.report else None
        if sweep.tables is None and args.report:
            print(f"note: no {(args.report_dir or args.sweep / 'report') / 'report.md'}: the report holds the panels "
                  f"only (gradscale-report {args.sweep} --wandb adds tables and figures)", file=sys.stderr)
        if args.dry_run:
            written = [(args.out or args.sweep / "wandb_workspace.json", spec_json(workspace))]
            if report is not None:
                written.append((args.report_out or args.sweep / "wandb_report.json", spec_json(report)))
            for path, _ in written:  # every spec is built before the first file is written
                if not path.parent.is_dir():
                    raise DashboardError(f"error: {path.parent} is not a folder")
            for path, text in written:
                write_text_atomic(path, text)
            n_panels = sum(len(section.panels) for section in workspace.sections)
            print(f"wrote {written[0][0]} (workspace: {len(workspace.sections)} sections, {n_panels} panels; "
                  f"runs of group {sweep.group!r} grouped by {', '.join(sweep.groupby)})")
            if report is not None:
                print(f"wrote {written[1][0]} (report: {len(report.blocks)} blocks, {len(sweep.figures)} figures)")
            return 0
        for url in save_online(workspace, report, args.entity, project):
            print(url)
    except DashboardError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
