"""W&B dashboards (analysis.dashboard): the specs' metrics, groups and filters against what the runs really log
and really hand to wandb.init; bad input in one line; and WANDB_MODE=disabled switching W&B off."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OFFLINE_ENV, ROOT, TINY

pytest.importorskip("wandb_workspaces")

# gradscale.run as the CLI runs it, with wandb.init wrapped: each call's keyword arguments land in the run
# folder as wandb_init.json, then a disabled W&B run stands in (no wandb-core, no files, no network)
RECORD_WANDB_INIT = """
import json, runpy, sys
from pathlib import Path
import wandb
real_init = wandb.init
def init(**kwargs):
    Path(kwargs["dir"], "wandb_init.json").write_text(json.dumps({k: v for k, v in kwargs.items() if k != "settings"}))
    return real_init(**{**kwargs, "mode": "disabled"})
wandb.init = init
sys.argv = ["gradscale.run", *sys.argv[1:]]
runpy.run_module("gradscale.run", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, cache_dir) -> Path:
    """A four-job sweep (sgd, adamw x scale 1, 8; the fix pinned on) whose runs asked for W&B, and gradscale-report's
    output."""
    sweep = tmp_path_factory.mktemp("dashboard") / "dash_sweep"
    args = ["-m", "optimizer=sgd,adamw", "scale=1,8", "fix=true", *TINY, "wandb.mode=offline",
            f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, **OFFLINE_ENV, "WANDB_MODE": "offline", "GRADSCALE_CACHE": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", RECORD_WANDB_INIT, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from gradscale.analysis.report import main as report

    assert report([str(sweep)]) == 0
    return sweep


def run_folders(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/wandb_init.json"))


def logged_keys(sweep: Path) -> set[str]:
    return {key for run in run_folders(sweep) for line in (run / "metrics.jsonl").read_text().splitlines()
            for key in json.loads(line)}


def spec_panels(spec: dict) -> list[dict]:
    """Every panel of a workspace spec, or of a report spec's panel grids."""
    if "section" in spec["spec"]:
        return [p for s in spec["spec"]["section"]["panelBankConfig"]["sections"] for p in s["panels"]]
    return [p for b in spec["spec"]["blocks"] if b["type"] == "panel-grid"
            for p in b["metadata"]["panelBankSectionConfig"]["panels"]]


def panel_metrics(panel: dict) -> set[str]:
    """The logged keys a panel reads (line and bar: history keys; scatter: summary keys, i.e. last values)."""
    config = panel["config"]
    names = set(config.get("metrics", []))
    names |= {config[axis].removeprefix("summary:") for axis in ("xAxis", "yAxis")
              if str(config.get(axis, "")).startswith("summary:")}
    if panel["viewType"] == "Run History Line Plot":
        names.add(config["xAxis"])
    return names


def config_value(config: dict, backend_key: str):
    """A W&B grouping key (config section, e.g. optimizer.value.name) looked up in the dict given to wandb.init."""
    value = config
    for part in backend_key.split("."):
        if part != "value":
            value = value[part]  # KeyError: the runs have no such key
    return value


def dry_run(sweep: Path, *extra: str) -> int:
    from gradscale.analysis.dashboard import main

    return main([str(sweep), "--entity", "placeholder-entity", "--dry-run", *extra])


def test_workspace_panels_read_keys_the_runs_log(sweep, capsys):
    assert dry_run(sweep) == 0
    out = sweep / "wandb_workspace.json"
    assert capsys.readouterr().out.startswith(f"wrote {out} (workspace: 6 sections, 17 panels;")
    spec = json.loads(out.read_text())
    used = set().union(*(panel_metrics(p) for p in spec_panels(spec)))
    logged = logged_keys(sweep)
    assert used <= logged, used - logged
    # the views the study needs are all there
    assert {"train/loss", "train/grad_norm", "train/update_rms", "adam/eps_dominated_frac", "eval/loss",
            "eval/loss_rare", "train/output_update_rms_rare"} <= used
    # the x axis is the logged step (W&B's own _step counts log calls: eval records would sit apart)
    assert spec["spec"]["section"]["settings"]["xAxis"] == "step"


def test_workspace_groups_by_config_keys_wandb_got_and_filters_this_sweeps_group(sweep):
    assert dry_run(sweep) == 0
    runset = json.loads((sweep / "wandb_workspace.json").read_text())["spec"]["section"]["runSets"][0]
    inits = [json.loads((run / "wandb_init.json").read_text()) for run in run_folders(sweep)]
    assert len(inits) == 4
    grouping = [key["name"] for key in runset["grouping"]]
    assert {key["section"] for key in runset["grouping"]} == {"config"}
    assert grouping == ["optimizer.value.name", "scale.value"]  # lr etc. follow from the optimizer preset
    groups = {tuple(config_value(init["config"], key) for key in grouping) for init in inits}
    assert groups == {("sgd", 1.0), ("sgd", 8.0), ("adamw", 1.0), ("adamw", 8.0)}  # one group per setup
    filters = {(f["key"]["section"], f["key"]["name"]): (f["op"], f["value"]) for f in runset["filters"]["filters"]}
    assert filters == {("run", "group"): ("=", inits[0]["group"]), ("run", "jobType"): ("=", "train")}
    assert {i["job_type"] for i in inits} == {"train"}
    # the group says what the sweep runs (its command's overrides, W&B keys aside) and where, not the time
    group, = {init["group"] for init in inits}
    assert group.startswith("optimizer:sgd,adamw scale:1,8 fix:true model.init:random steps:4 ")
    assert group.endswith(" @ " + "/".join(sweep.parts[-2:])) and "wandb" not in group and len(group) <= 128
    workspace = json.loads((sweep / "wandb_workspace.json").read_text())
    assert workspace["displayName"] == f"gradscale {group}"[:128]


def test_report_holds_panels_figures_and_tables(sweep, capsys):
    assert dry_run(sweep, "--report") == 0
    group = json.loads((run_folders(sweep)[0] / "wandb_init.json").read_text())["group"]
    out = sweep / "wandb_report.json"
    assert f"wrote {out} (report:" in capsys.readouterr().out
    spec = json.loads(out.read_text())
    blocks = spec["spec"]["blocks"]
    figures = {p.stem for p in (sweep / "report").glob("*.png")}
    media = [p for p in spec_panels(spec) if p["viewType"] == "Media Browser"]
    assert figures and {key for p in media for key in p["config"]["mediaKeys"]} == {f"figures/{f}" for f in figures}
    charts = [p for p in spec_panels(spec) if p["viewType"] != "Media Browser"]
    assert set().union(*map(panel_metrics, charts)) <= logged_keys(sweep)
    grids = [b["metadata"]["runSets"][0] for b in blocks if b["type"] == "panel-grid"]
    assert [{f["key"]["name"]: f["value"] for f in g["filters"]["filters"]} for g in grids] == [
        {"group": group, "jobType": "train"}, {"group": group, "jobType": "analysis"}]
    assert all("project" not in g for g in grids)  # offline: no project lookup
    tables = [b["content"] for b in blocks if b["type"] == "markdown-block"][-1]
    report_md = (sweep / "report" / "report.md").read_text()
    assert "| setup | lr | scale |" in tables and "## Per setup and scale" in report_md
    assert ".png)" not in tables and ".png)" in report_md  # local images do not travel


def test_dry_run_touches_no_network(sweep, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run opened a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", "offline")
    out, report_out = tmp_path / "ws.json", tmp_path / "report.json"
    assert dry_run(sweep, "--report", "--out", str(out), "--report-out", str(report_out)) == 0
    assert json.loads(out.read_text())["entity"] == "placeholder-entity" and report_out.exists()


def files_under(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case, says", [
    ("missing", "does not exist"),
    ("empty", "error: no run folders"),
    ("no_workspaces", "error: wandb-workspaces is not installed"),
    ("out_in_missing_folder", "is not a folder"),
])
def test_bad_input_is_one_line_and_exit_2_writing_nothing(sweep, tmp_path, monkeypatch, capsys, case, says):
    from gradscale.analysis.dashboard import main

    path = {"missing": tmp_path / "nope", "empty": tmp_path}.get(case, sweep)
    extra = ["--out", str(tmp_path / "no" / "ws.json")] if case == "out_in_missing_folder" else []
    if case == "no_workspaces":
        monkeypatch.setitem(sys.modules, "wandb_workspaces", None)  # import fails as if not installed
        monkeypatch.setitem(sys.modules, "wandb_workspaces.workspaces", None)
    before = files_under(sweep)
    assert main([str(path), "--entity", "e", "--dry-run", "--report", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and says in err[0], err
    if case == "no_workspaces":
        assert "pip install wandb-workspaces" in err[0]
    assert files_under(sweep) == before and not list(tmp_path.rglob("*.json"))


def test_online_save_without_an_api_key_says_so_and_suggests_dry_run(sweep, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "WANDB_BASE_URL": "http://127.0.0.1:9"}  # nothing listens there
    env.pop("WANDB_API_KEY", None)
    before = files_under(sweep)
    proc = subprocess.run([sys.executable, "-m", "gradscale.analysis.dashboard", str(sweep), "--entity", "e",
                           "--report"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: saving the W&B workspace to e/gradscale failed"), err
    assert "API key" in err[0] and "--dry-run" in err[0]
    assert files_under(sweep) == before


def test_every_option_has_help(capsys):
    from gradscale.analysis.dashboard import build_parser, main

    assert all(action.help for action in build_parser()._actions)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--dry-run" in capsys.readouterr().out


def test_wandb_mode_disabled_in_the_environment_wins_over_wandb_mode_offline(tmp_path, monkeypatch):
    """Before, wandb.init(mode="offline") won over the variable: wandb-core started and wrote run_dir/wandb."""
    from gradscale.config import WandbConfig
    from gradscale.metrics import RunLog

    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_log = RunLog(tmp_path, WandbConfig(mode="offline"), name="t", group="g", tags=[], config={})
    assert run_log._wandb is None
    run_log.log({"step": 0, "train/loss": 1.0})
    run_log.finish({"status": "completed"})
    assert not (tmp_path / "wandb").exists() and (tmp_path / "summary.json").exists()


def test_report_wandb_logging_is_skipped_when_the_environment_disables_wandb(tmp_path, monkeypatch, capsys):
    from gradscale.analysis.report import log_to_wandb

    monkeypatch.setenv("WANDB_MODE", "disabled")
    log_to_wandb([tmp_path], tmp_path, [], "offline", "gradscale")
    assert "WANDB_MODE=disabled" in capsys.readouterr().err and not (tmp_path / "wandb").exists()


def test_a_dry_run_needs_no_entity_and_saving_does_in_one_line(sweep, tmp_path, capsys):
    from gradscale.analysis.dashboard import main

    out = tmp_path / "ws.json"
    assert main([str(sweep), "--dry-run", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["entity"] == "ENTITY"
    assert main([str(sweep)]) == 2
    assert capsys.readouterr().err.strip() == ("error: --entity is needed to save to W&B (your user or team); "
                                               "--dry-run writes the specs without it")


def test_a_sweeps_wandb_group_says_what_it_runs_and_where():
    from gradscale.sweep import wandb_group

    where = Path("multirun/2026-12-06/08-10-00")
    assert wandb_group(["optimizer=sgd,adamw", "scale=1,8"], {"fix": "true,false"}, None, where, []) == \
        "optimizer:sgd,adamw scale:1,8 fix:true,false @ 2026-12-06/08-10-00"  # the user's command, fix swept
    assert wandb_group(["experiment=scale_sweep", "smoke=on", "wandb.mode=offline", "data.path=/x"],
                       {"scale": "1e-8,1"}, "scale_sweep", Path("runs/mine"), ["data.path"]) == \
        "experiment:scale_sweep smoke:on @ runs/mine"  # a preset: its name says what it sweeps
    long = wandb_group([f"model.hidden_size={'1' * 200}"], {}, None, where, [])
    assert len(long) == 128 and long.endswith(" @ 2026-12-06/08-10-00")  # what gives way, not where
