"""The bad-input table of docs/outputs.md, the rows not covered elsewhere (config values: test_cli.py; model.path:
test_model.py; another sweep's folder: test_resume.py): data files and output folders; and every command's bad
flags. Each gets one line on stderr naming the value, a non-zero exit, and nothing written."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT

GOOD = json.dumps({"prompt": "What is 1 + 1?", "response": "2."}) + "\n"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "it holds no records"),
        (b"prompt,response\nq,a\n", "line 1 is not JSON"),
        ((GOOD * 3 + '{"prompt": "q", "resp').encode() + b"\n" + GOOD.encode(), "line 4 is not JSON"),
        (GOOD.encode() + b'["a list"]\n', "line 2 is not a JSON object"),
        (GOOD.encode() + json.dumps({"prompt": "q"}).encode() + b"\n", "line 2 has no text field 'response'"),
        (GOOD.encode() + b'{"prompt": "caf\xe9", "response": "x"}\n', "line 2 is not UTF-8"),
    ],
    ids=["empty", "not-jsonl", "corrupt-line", "not-an-object", "missing-field", "invalid-utf8"],
)
def test_bad_data_file_is_refused_before_any_work(cli, tmp_path, content, expected):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    run_dir = tmp_path / "run"
    proc = cli(["data=jsonl", f"data.path={path}", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    prefix = f"error: data.path={str(path)!r} is not allowed: must be a JSONL file of records: "
    assert len(lines) == 1 and lines[0].startswith(prefix + expected), proc.stderr
    assert not run_dir.exists()


def test_every_example_longer_than_seq_len_fails_the_run_in_one_line(cli, tmp_path):
    """Only tokenizing tells, so the run starts; it ends failed, saying why, in one line."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i} " * 40, "response": "yes"}) + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    proc = cli(["data=jsonl", f"data.path={path}", "model.init=random", "seq_len=16", "batch_size=8",
                f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: seq_len=16 leaves no sequence with a trained token")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_unwritable_output_folder_is_refused(cli, tmp_path, mode):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    target = blocker / "out"
    args = [f"hydra.run.dir={target}"] if mode == "run" else ["-m", "scale=1,2", f"hydra.sweep.dir={target}"]
    proc = cli(args)
    assert proc.returncode == 2
    key = "hydra.run.dir" if mode == "run" else "hydra.sweep.dir"
    expected = f"error: {key}={str(target)!r} cannot be written: {blocker} is not a folder"
    assert proc.stderr.strip().splitlines() == [expected]
    assert blocker.read_text() == "not a folder"


def test_a_python_caller_of_run_job_gets_the_same_checks(tmp_path):
    """The checks live where a job starts, not only in the command line's callback and sweeper."""
    from experiments.checks import ConfigError
    from experiments.hydra_glue import to_object
    from experiments.run import run_job
    from tests.conftest import TINY, compose

    with pytest.raises(ConfigError, match=r"^error: optimizer.lr=-1.0 is not allowed: must be a finite number > 0$"):
        run_job(to_object(compose([*TINY, "optimizer.lr=-1"])), None)
    missing = tmp_path / "none.jsonl"
    with pytest.raises(ConfigError, match="must be an existing JSONL file"):
        run_job(to_object(compose([*TINY, "data=jsonl", f"data.path={missing}"])), None)


def test_each_data_file_is_read_once_while_it_stays_the_same(tmp_path, monkeypatch):
    """A sweep checks every job's config; the JSONL file all of them name is read once, and again once it
    changes."""
    import functools

    from experiments import config, probes
    from experiments.checks import ConfigError
    from tests.conftest import TINY, compose

    path = tmp_path / "train.jsonl"
    path.write_text(GOOD * 3)
    reads = []
    probe = probes.jsonl_problem

    @functools.wraps(probe)
    def counted(*args):
        reads.append(args[0])
        return probe(*args)

    monkeypatch.setattr(probes, "jsonl_problem", counted)
    for scale in (1, 2, 8):
        config.validate(compose([*TINY, "data=jsonl", f"data.path={path}", f"scale={scale}"]), overrides=[])
    assert reads == [str(path)]
    path.write_text(GOOD * 3 + "not json\n")
    with pytest.raises(ConfigError, match="line 4 is not JSON"):
        config.validate(compose([*TINY, "data=jsonl", f"data.path={path}"]), overrides=[])
    assert len(reads) == 2



def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


# every command (experiments.run's config values: test_cli.py), each bad flag: (command, argv, what the line says);
# MISSING is a path that does not exist, OUT a folder that must not appear, BLOCKED a path under a plain file
COMMANDS = {
    "analysis.report": "analysis.report", "analysis.dashboard": "analysis.dashboard",
    "analysis.scaling": "analysis.scaling", "analysis.notebook": "analysis.notebook",
    "analysis.advise": "analysis.advise", "experiments.advise": "experiments.advise",
    "experiments.audit": "experiments.audit.__main__", "experiments.parity": "experiments.parity",
    "experiments.pretrain": "experiments.pretrain",
}
BAD_FLAGS = [
    ("analysis.report", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("analysis.report", ["MISSING"], "MISSING does not exist"),
    ("analysis.report", ["SWEEP", "--out", "BLOCKED"], "--out='BLOCKED' cannot be written"),
    ("analysis.report", ["SWEEP", "--wandb-mode", "sometimes"], "--wandb-mode: invalid choice: 'sometimes'"),
    ("analysis.dashboard", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("analysis.dashboard", ["MISSING", "--dry-run"], "MISSING does not exist"),
    ("analysis.scaling", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("analysis.scaling", ["MISSING"], "sweep folder 'MISSING' does not exist"),
    ("analysis.scaling", ["SWEEP", "--eps=-1"], "--eps=-1.0 must be > 0"),
    ("analysis.scaling", ["SWEEP", "--out", "BLOCKED"], "--out='BLOCKED' cannot be written"),
    ("analysis.scaling", ["SWEEP", "--point", "MISSING"], "--point='MISSING' is not a run folder"),
    ("analysis.notebook", ["NOTEBOOK", "SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("analysis.notebook", ["MISSING", "SWEEP"], "MISSING is not a notebook"),
    ("analysis.advise", ["SWEEP", "--bogus"], "unrecognized arguments: --bogus"),
    ("analysis.advise", ["MISSING"], "run folder 'MISSING' does not exist"),
    ("experiments.advise", ["--bogus"], "unrecognized arguments: --bogus"),
    ("experiments.advise", ["--world-sizes", "8,abc"], "--world-sizes='8,abc' is not a comma-separated list"),
    ("experiments.advise", ["--eps=0"], "--eps=0.0 must be > 0"),
    ("experiments.advise", ["--json", "BLOCKED"], "--json='BLOCKED'"),
    ("experiments.advise", ["scale=8"], "scale=8 is not allowed"),
    ("experiments.advise", ["optimizer=sgd"], "optimizer=sgd is not allowed"),
    ("experiments.advise", ["--gradient-only", "optimizer=bogus"], "optimizer=bogus is not allowed"),
    ("experiments.advise", ["--gradient-only", "steps=0"], "steps=0 is not allowed"),
    ("experiments.advise", ["--gradient-only", "model=gpt2"], "model=gpt2 is not allowed: one of"),
    ("experiments.audit", ["global_token_mean", "--bogus"], "unrecognized arguments: --bogus"),
    ("experiments.audit", ["nope"], "target 'nope' is neither a built-in target"),
    ("experiments.audit", ["global_token_mean", "--world-sizes", "3"], "--world-sizes 3: each must be one of"),
    ("experiments.parity", ["--bogus"], "unrecognized arguments: --bogus"),
    ("experiments.parity", ["--world-size", "1"], "--world-size: invalid choice: 1"),
    ("experiments.pretrain", ["--bogus"], "--bogus"),
    ("experiments.pretrain", ["model.pretrain.steps=-1"], "model.pretrain.steps=-1 is not allowed"),
    ("scripts/bench.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("scripts/bench.py", ["--steps", "0"], "--steps=0 must be >= 1"),
    ("scripts/profile_step.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("scripts/device_carry.py", ["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(("command", "argv", "says"), BAD_FLAGS, ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD_FLAGS])
def test_every_command_refuses_each_bad_flag_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, command,
                                                                         argv, says):
    import importlib

    sweep, out = tmp_path / "sweep", tmp_path / "out"
    sweep.mkdir()
    (tmp_path / "a_file").write_text("")
    paths = {"MISSING": str(tmp_path / "missing"), "SWEEP": str(sweep), "BLOCKED": str(tmp_path / "a_file" / "x"),
             "NOTEBOOK": str(ROOT / "analysis" / "notebooks" / "01_world_size_fix.py")}
    argv = [paths.get(a, a) for a in argv] + (["--out", str(out)] if command == "analysis.dashboard" else [])
    if command.startswith("experiments.") and command not in ("experiments.audit", "experiments.parity"):
        argv.append(f"hydra.run.dir={out}")
    says = paths["MISSING"].join(paths["BLOCKED"].join(says.split("BLOCKED")).split("MISSING"))
    monkeypatch.chdir(tmp_path)  # anything a command would write by default lands here, where it is looked for
    main = _script(command.split("/")[1][:-3]) if command.startswith("scripts/") else \
        importlib.import_module(COMMANDS[command]).main
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, (code, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "sweep"]
    assert not any(sweep.iterdir())
