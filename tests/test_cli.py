"""The entry point as users type it: sweeps, per-run outputs, divergence, bad input, W&B offline."""

from __future__ import annotations

import json
import math
import re

import pytest

from gradscale.runs import job_dirs
from tests.conftest import CONF, TINY, compose, read_metrics, run_in_process, train_records

METRIC_KEYS = {
    "step", "train/loss", "train/grad_norm", "train/clipped", "train/lr", "train/update_rms", "train/param_norm",
    "train/tokens", "perf/tokens_per_s",
}
ADAM_KEYS = {"adam/sqrt_v_rms", "adam/eps_dominated_frac"}
SUMMARY_KEYS = {
    "status", "steps_done", "final_loss", "best_eval_loss", "diverged_at_step", "wall_s", "tokens_per_s",
    "overrides", "versions", "git_commit",
}


def test_default_sweep_command_runs_eight_jobs_with_and_without_the_fix(cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", "optimizer=sgd,adamw", "scale=1,8", *TINY, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    dirs = job_dirs(sweep_dir)
    assert len(dirs) == 8  # the user's command sweeps the fix too (gradscale/conf/sweep/fix_on_and_off.yaml)
    losses, first_grad_norm = {}, {}
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        assert SUMMARY_KEYS <= summary.keys()
        assert summary["status"] == "completed" and summary["steps_done"] == 4
        records = read_metrics(d)
        train = train_records(records)
        assert [r["step"] for r in train] == [0, 1, 2, 3]
        expected = METRIC_KEYS | (ADAM_KEYS if summary["optimizer"] == "adamw" else set())
        assert all(r.keys() == expected for r in train), train[0].keys() ^ expected
        assert [r["step"] for r in records if "eval/loss" in r] == [1, 3]
        assert summary["final_loss"] == train[-1]["train/loss"]
        assert (d / "run.log").stat().st_size > 0
        key = (summary["optimizer"], summary["scale"], summary["fix"])
        losses[key] = [r["train/loss"] for r in train]
        first_grad_norm[key] = train[0]["train/grad_norm"]
    assert {fix for *_, fix in losses} == {True, False}
    for opt in ("sgd", "adamw"):  # same weights and batch at step 0: the norm ratio is exactly c_eff
        reference = first_grad_norm[(opt, 1.0, True)]
        for (scale, fix), c_eff in {(8.0, True): 8.0, (1.0, False): 1 / 8, (8.0, False): 1.0}.items():
            assert first_grad_norm[(opt, scale, fix)] / reference == pytest.approx(c_eff, rel=1e-6)
        # the bug is a pure rescale: fix off at scale 8 (c_eff = 8 / 8) is fix on at scale 1, step for step
        assert losses[(opt, 8.0, False)] == losses[(opt, 1.0, True)]
    assert losses[("sgd", 1.0, False)] != losses[("sgd", 1.0, True)]  # SGD feels c_eff = 1/8
    # the sweep ends with a table of its runs
    assert "overrides" in proc.stdout and proc.stdout.count("completed") >= 8
    assert "fix=False optimizer=adamw scale=8" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("figures and report.md: gradscale-report ")
    assert "\r" not in proc.stdout + proc.stderr and "%|" not in proc.stderr  # no progress bars in a log


def test_a_sweep_runs_the_fix_on_and_off_unless_a_preset_says_what_it_sweeps():
    for overrides, fixes in (([], "true,false"), (["experiment=scale_sweep"], None),
                             (["experiment=world_size_fix"], "true,false")):  # world_size_fix sweeps it itself
        assert compose(overrides, with_hydra=True).hydra.sweeper.params.get("fix") == fixes, overrides
    assert compose([]).fix is True  # a single run: the fix is on


@pytest.mark.slow
def test_divergence_is_data_and_the_sweep_goes_on(cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", "optimizer=sgd", "optimizer.lr=0.05", "scale=1,1e30", "fix=true", *TINY, "steps=6",
                f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = {json.loads((d / "summary.json").read_text())["scale"]: json.loads((d / "summary.json").read_text())
                for d in job_dirs(sweep_dir)}
    assert statuses[1.0]["status"] == "completed"
    diverged = statuses[1e30]
    assert diverged["status"] == "diverged" and diverged["diverged_at_step"] is not None
    assert diverged["steps_done"] == diverged["diverged_at_step"] + 1 < 6
    assert "diverged" in proc.stdout


def test_non_finite_eval_loss_is_divergence_not_completion(tmp_path):
    """SGD at scale 1e4: every logged training loss is finite, but the last update leaves the weights
    non-finite, so only the final eval sees it."""
    result, records = run_in_process(tmp_path, ["optimizer=sgd", "scale=10000", "steps=3", "eval_every=3"])
    assert all(math.isfinite(r["train/loss"]) for r in train_records(records))
    assert records[-1]["eval/loss"] == "nan"  # metrics.jsonl spells non-finite numbers as strings
    assert result["status"] == "diverged" and result["diverged_at_step"] == 2 and result["best_eval_loss"] is None


def test_failed_run_is_recorded_and_the_sweep_goes_on(cli, tmp_path):
    """A run that crashes (here: a checkpoint whose weights file is corrupt, which only loading can
    tell) is recorded as failed; the other job still runs; the sweep exits non-zero, saying so."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    (broken / "tokenizer.json").write_text("{}")
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", f"model.path={broken},null", "fix=true", *TINY, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode != 0
    summaries = [json.loads((d / "summary.json").read_text()) for d in job_dirs(sweep_dir)]
    assert [s["status"] for s in summaries] == ["failed", "completed"]
    assert summaries[0]["error"]
    assert "error: 1 of 2 runs did not complete" in proc.stderr


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("scale=0", "scale=0.0"),
        ("scale=-1", "scale=-1.0"),
        ("scale=nan", "scale=nan"),
        ("scale=inf", "scale=inf"),
        ("optimizer.lr=0", "optimizer.lr=0.0"),
        ("optimizer.lr=nan", "optimizer.lr=nan"),
        ("world_size=0", "world_size=0"),
        ("steps=0", "steps=0"),
        ("batch_size=12", "batch_size=12"),
        ("seq_len=200000", "seq_len=200000"),
        ("data=jsonl", "data.path=None"),
        ("data.path=/nonexistent/train.jsonl", "data.name='pydoc'"),
        ("optimizer.eps=0", "optimizer.eps=0.0"),
        ("precision=fp8", "precision='fp8'"),
        ("wandb.mode=sometimes", "wandb.mode='sometimes'"),
        ("optimizer=adam_atan2 optimizer.a=0", "optimizer.a=0.0"),
        ("optimizer=lion optimizer.betas=[0.9,1.5]", "optimizer.betas=[0.9, 1.5]"),
        ("finetune=lora finetune.rank=0", "finetune.rank=0"),
        ("finetune=lora finetune.dropout=1", "finetune.dropout=1.0"),
        ("finetune=lora finetune.target_modules=[wq]", "finetune.target_modules=['wq']"),
        ("+model.recommended.lr.adamx=1e-5", "model.recommended.lr.adamx"),
        ("+model.recommended.warmup=10", "model.recommended.warmup"),
        ("fix=maybe", "fix=maybe is not allowed: Value 'maybe' is not a valid bool"),  # a typed key's bad value
        ("steps=abc", "steps=abc is not allowed: Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_bad_value_is_refused_with_one_line(cli, tmp_path, override, expected):
    run_dir = tmp_path / "run"
    data_path = override.startswith("data.path")
    args = ["data=jsonl", "data.path=/nonexistent/train.jsonl"] if data_path else override.split()
    if data_path:
        expected = "data.path='/nonexistent/train.jsonl'"
    proc = cli([*args, f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert not run_dir.exists()  # refused before anything is written


def test_bad_value_in_one_sweep_job_stops_the_sweep_before_any_job(cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", "optimizer=sgd,adamw", "scale=1,-8", *TINY, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode != 0
    assert "scale=-8.0" in proc.stderr and "job: fix=True optimizer=sgd scale=-8" in proc.stderr
    assert not sweep_dir.exists() or not job_dirs(sweep_dir)


@pytest.mark.parametrize(("args", "group"), [(["optimizer=rmsprop"], "optimizer"), (["model=gpt2"], "model"),
                                             (["data=c4"], "data"), (["finetune=qlora"], "finetune"),
                                             (["experiment=nope"], "experiment"),
                                             (["-m", "optimizer=sgd,rmsprop", "scale=1,8"], "optimizer")])
def test_unknown_group_choice_is_one_line_naming_the_choices(cli, tmp_path, args, group):
    """Hydra's own answer is 13 lines; this one names the value and the group's options, before any folder."""
    proc = cli([*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    bad = next(a for a in args if a.startswith(group)).split("=")[1].split(",")[-1]
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {group}={bad} is not allowed: one of {', '.join(options)}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


def test_wrong_type_names_the_type(cli, tmp_path):
    proc = cli(["scale=abc", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: scale=abc is not allowed: Value 'abc' of type "
                                                            "'str' could not be converted to Float")


@pytest.mark.parametrize(("args", "expected"), [
    (["+stpes=10"], "error: stpes is not a config key; did you mean steps?"),
    (["stpes=10"], "error: stpes is not a config key; did you mean steps?"),
    (["+optimizer.ep=1e-6"], "error: optimizer.ep is not a config key; did you mean optimizer.eps?"),
    (["optimizer=sgd", "++optimizer.eps=1e-6"], "error: optimizer.eps is not a config key"),
    (["no_such_key=1"], "error: no_such_key is not a config key"),
    (["-m", "optimizer=sgd,adamw", "optimizer.eps=1e-6"], "error: optimizer.eps is not a config key"),
])
def test_unknown_key_is_refused_with_one_line_with_or_without_plus(cli, tmp_path, args, expected):
    """Hydra's `+` adds any key: a typo would run with the key silently ignored. A sweep is refused before
    its first job when any job (here the sgd one) has no such key."""
    proc = cli([*args, *TINY, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [expected + " (docs/configuration.md lists every key)"], proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


def test_wandb_offline_writes_a_local_run(cli, tmp_path):
    run_dir = tmp_path / "run"
    # conftest's WANDB_MODE=disabled would switch W&B off (it wins over wandb.mode: test_dashboard.py)
    proc = cli([*TINY, "wandb.mode=offline", f"hydra.run.dir={run_dir}"], extra_env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb"))
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_wandb_online_without_a_key_falls_back_to_offline(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    run_dir = tmp_path / "run"
    proc = cli([*TINY, "wandb.mode=online", f"hydra.run.dir={run_dir}"], extra_env={"WANDB_MODE": "online"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back to offline" in proc.stdout + proc.stderr
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


def progress_tags(output: str) -> list[str | None]:
    """The job tag ('3 optimizer=adamw', None when untagged) of every `step ...` progress line."""
    lines = [line for line in output.splitlines() if re.search(r"\] - (\[[^\]]*\] )?step \d", line)]
    return [m.group(1) if (m := re.search(r"\] - \[([^\]]*)\] step \d", line)) else None for line in lines]


def old_style_name(job_dir, exclude_keys) -> str:
    """The folder name before folders left out the sweep's shared overrides: N_ and all of them."""
    from gradscale.runs import job_overrides

    lines = sorted(o for o in job_overrides(job_dir) if o.lstrip("+~").split("=")[0] not in exclude_keys)
    return f"{job_dir.name.split('_')[0]}_{','.join(lines)}"


@pytest.mark.slow
def test_parallel_sweep_folders_and_progress_lines_name_what_tells_the_jobs_apart(cli, tmp_path):
    """Side by side (joblib, 2 processes), every progress line carries its job's tag; folders and tags drop
    the overrides every job shares (smoke=on, the tiny config); the include job, which shares them all, is
    just its number. A re-run into folders named the old way resumes them in place."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=local_parallel", "smoke=on", "optimizer=sgd,adamw", "fix=true", *TINY, "steps=2",
            "hydra.sweeper.include=[['steps=2']]", f"hydra.sweep.dir={sweep_dir}"]
    proc = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [d.name for d in job_dirs(sweep_dir)] == ["0_optimizer=sgd", "1_optimizer=adamw", "2"]
    tags = progress_tags(proc.stdout + proc.stderr)
    assert None not in tags
    # two records (steps 0 and 1) and the eval's two lines (its size, its loss) per job, each line tagged as its
    # folder is named
    assert sorted(tags) == sorted(["0 optimizer=sgd"] * 4 + ["1 optimizer=adamw"] * 4 + ["2"] * 4)
    # the same sweep, its folders named as before (every override): finished jobs skipped where they are
    exclude_keys = compose([], with_hydra=True).hydra.job.config.override_dirname.exclude_keys
    for d in job_dirs(sweep_dir):
        d.rename(sweep_dir / old_style_name(d, exclude_keys))
    old = [d.name for d in job_dirs(sweep_dir)]
    assert old[0].startswith("0_batch_size=8,") and "smoke=on" in old[0]
    (job_dirs(sweep_dir)[1] / "summary.json").unlink()  # job 1 runs again, in its old folder
    again = cli(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [d.name for d in job_dirs(sweep_dir)] == old
    assert "already completed, skipped" in (job_dirs(sweep_dir)[0] / "run.log").read_text()
    assert json.loads((job_dirs(sweep_dir)[1] / "summary.json").read_text())["status"] == "completed"


def test_a_one_job_sweep_keeps_its_overrides_and_a_single_run_has_no_tag(cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = cli(["-m", "scale=8", "fix=true", *TINY, "steps=1", f"hydra.sweep.dir={sweep_dir}"])  # fix pinned
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = ("0_batch_size=8,eval_batches=1,eval_every=2,fix=True,log_every=1,model.init=random,scale=8,seq_len=64,"
            "steps=1")
    assert [d.name for d in job_dirs(sweep_dir)] == [name]
    assert set(progress_tags(proc.stdout + proc.stderr)) == {name.replace("_", " ", 1)}
    single = cli([*TINY, "steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert single.returncode == 0, single.stderr[-3000:]
    tags = progress_tags(single.stdout + single.stderr)
    assert tags and set(tags) == {None}


@pytest.mark.parametrize(("jobs", "expected"), [
    # shared keys join exclude_keys; a job left with none is its number alone
    ([["smoke=on", "optimizer=sgd"], ["smoke=on", "optimizer=adamw"], ["smoke=on"]],
     [["X=['wandb.mode','smoke']"], ["X=['wandb.mode','smoke']"], ["X=['wandb.mode','smoke']", "S=2"]]),
    ([["a=1", "+b=2"], ["a=1", "+b=3"]], [["X=['wandb.mode','a']"]] * 2),
    ([["a=1", "b=2"], ["a=2", "b=2", "c=[1,2]"]], [["X=['wandb.mode','b']"]] * 2),
    ([["a=1"], ["a=2"]], [[], []]),  # nothing shared: the names are as they were
    ([["a=1"]], [[]]),  # one job: its overrides name it
    ([[]], [["S=0"]]),  # one job without overrides: `0`, not `0_`
])
def test_folder_name_overrides(jobs, expected):
    from gradscale.sweep import folder_name_overrides

    short = [[o.replace("hydra.job.config.override_dirname.exclude_keys", "X").replace("hydra.sweep.subdir", "S")
              for o in job] for job in folder_name_overrides(jobs, ["wandb.mode"], {})]
    assert short == expected


def test_a_job_keeps_the_folder_it_has(tmp_path):
    from gradscale.sweep import folder_name_overrides

    jobs = [["smoke=on", "scale=1"], ["smoke=on", "scale=2"]]
    naming = folder_name_overrides(jobs, [], {("smoke=on", "scale=2"): tmp_path / "1_scale=2,smoke=on"})
    assert naming[1][-1] == "hydra.sweep.subdir='1_scale=2,smoke=on'" and len(naming[0]) == 1


@pytest.mark.parametrize("name", ["0_a=b,c=[1,2]", "1_data.hf_name='x y'", "2_a=${foo}", "3_a=b\\c", "4_a=\\'q",
                                  "5_ends\\"])
def test_a_kept_folder_name_reads_back_exactly(name):
    """Whatever an old folder is called, the override that keeps it reads back as exactly that name."""
    from gradscale.sweep import hydra_quoted

    cfg = compose([f"hydra.sweep.subdir={hydra_quoted(name)}"], with_hydra=True)
    assert cfg.hydra.sweep.subdir == name


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], ("adamw", 1e-3, 16, 128)),  # the tiny model: the suite's defaults
        (["model=smollm2_135m"], ("adamw", 1e-5, 8, 128)),  # the preset's own recipe
        (["model=smollm2_135m", "optimizer=sgd"], ("sgd", 1e-2, 8, 128)),  # its lr for each optimizer
        (["model=smollm2_135m", "optimizer=lion"], ("lion", 1e-6, 8, 128)),
        (["model=smollm2_135m", "optimizer.lr=3e-5", "batch_size=4"], ("adamw", 3e-5, 4, 128)),  # the user's win
        (["model=smollm2_135m", "experiment=smollm2_world_size_fix"], ("adamw", 1e-5, 8, 64)),  # a preset's win
        (["model=smollm2_135m", "smoke=on"], ("adamw", 1e-5, 8, 64)),
    ],
)
def test_a_model_preset_brings_its_recipe_unless_the_user_or_a_preset_sets_it(overrides, expected):
    from gradscale.hydra_glue import to_object

    cfg = to_object(compose(overrides))
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.batch_size, cfg.seq_len) == expected


@pytest.mark.parametrize(("recommended", "key"), [({"lr": {"adamx": 1e-5}}, "model.recommended.lr.adamx"),
                                                  ({"lr": {"sgd": -1.0}}, "model.recommended.lr.sgd"),
                                                  ({"warmup": 10}, "model.recommended")])
def test_a_model_presets_recommended_recipe_is_checked(recommended, key):
    from gradscale.checks import ConfigError
    from gradscale.config import ModelConfig

    with pytest.raises(ConfigError, match=re.escape(key)):
        ModelConfig(name="preset", init="random", recommended=recommended).check()


def test_the_same_sweep_twice_from_a_cold_cache_writes_the_same_bits(cli, tmp_path):
    """As `make sweep` runs it (two jobs side by side, one thread each), each time building the pretrained base
    into an empty cache: the bases and every metric record are identical, timings aside."""
    args = ["-m", "scale=1,8", "fix=true", "hydra/launcher=local_parallel", *TINY, "model.init=pretrained",
            "model.pretrain.steps=10", "model.pretrain.batch_size=8", "model.pretrain.seq_len=64"]
    from concurrent.futures import ThreadPoolExecutor

    def sweep(attempt: str):  # both at once: each job's thread count is set by the launcher, not the load
        return cli([*args, f"hydra.sweep.dir={tmp_path / attempt}"],
                   extra_env={"GRADSCALE_CACHE": str(tmp_path / f"cache_{attempt}")})

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(zip("ab", pool.map(sweep, "ab")))
    metrics, bases = [], []
    for attempt, proc in procs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        bases.append([p.read_bytes() for p in sorted((tmp_path / f"cache_{attempt}").rglob("model.safetensors"))])
        metrics.append({d.name: [{k: v for k, v in r.items() if k != "perf/tokens_per_s"} for r in read_metrics(d)]
                        for d in job_dirs(tmp_path / attempt)})
    assert len(bases[0]) == 1 and bases[0] == bases[1]
    assert len(metrics[0]) == 2 and metrics[0] == metrics[1]


def test_the_readme_quotes_the_default_sweeps_committed_report():
    """README's first screen against docs/figures/default_sweep, the user's command as `make sweep` runs it
    (scripts/make_figures.sh): every final loss in its table, and AdamW's deviations in its text."""
    import pandas as pd

    from gradscale.runs import short_number
    from tests.conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index(": 8 runs\noverrides"):readme.index("figures and report.md: gradscale-report")]
    summary = pd.read_csv(ROOT / "docs" / "figures" / "default_sweep" / "summary.csv")
    assert len(summary) == 8 and set(summary.c_eff) == {0.125, 1.0, 8.0}
    for row in summary.itertuples():
        line, = [line for line in table.splitlines() if line.startswith(f"fix={row.fix} optimizer={row.setup} "
                                                                        f"scale={row.scale:g} ")]
        assert line.split()[4] == f"{row._7:.4f}", line  # final loss
    adamw = summary[summary.setup == "adamw"].set_index("c_eff")["max abs Δloss vs ref"]
    assert f"max |Δ loss| {short_number(adamw[0.125], 2)} at 1/8, {short_number(adamw[8.0], 2)} at 8" in readme
    assert adamw[1.0].tolist() == [0.0, 0.0]  # fix off at scale 8 is fix on at scale 1, bit for bit


def test_the_readme_answers_does_it_matter_on_its_first_screen():
    """A reader who asks "does it matter for me?" finds the answer before the set-up and the sweep's transcript."""
    from tests.conftest import ROOT

    lines = (ROOT / "README.md").read_text().splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    answer = lines.index("## Will it matter for me?")
    assert answer == headings[0] and answer < 60
    assert next(i for i, line in enumerate(lines) if line.startswith("**In short**")) < 60
    assert answer < lines.index("## First steps")
