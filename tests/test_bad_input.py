"""The bad-input table of docs/outputs.md, the rows not covered elsewhere (config values: test_cli.py; model.path:
test_model.py; another sweep's folder: test_resume.py; every command's bad flags: test_help.py): data files
and output folders. Each gets one line on stderr naming the value, a non-zero exit, and nothing written."""

from __future__ import annotations

import json
import re

import pytest

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
    from gradscale.checks import ConfigError
    from gradscale.hydra_glue import to_object
    from gradscale.run import run_job
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

    from gradscale import config, probes
    from gradscale.checks import ConfigError
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


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_anything_loads(cli, tmp_path):
    """Llama 3.2 3B at 512 x 8192 tokens: terabytes of activations on any machine. One line with the estimate
    and what is free, exit 1, and nothing fetched, built or pretrained (the run's cache stays empty)."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    cache.mkdir()
    proc = cli(["model=llama3_2_3b", "batch_size=512", "seq_len=8192", "steps=1", f"hydra.run.dir={run_dir}"],
               extra_env={"GRADSCALE_CACHE": str(cache)})
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.match(r"error: this run needs about \d+ GiB \(weights 12, gradients 12, optimizer state 37, "
                    r"activations \d+, framework 0.5\) on cpu, and 1.1 times that free; this machine has [\d.]+ GiB "
                    r"available \(this process holds [\d.]+\): .*check_memory=false to go on", lines[0]), lines[0]
    assert list(cache.iterdir()) == []
    assert "parameters" not in (run_dir / "run.log").read_text()  # the model-built line never came
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_the_memory_check_counts_the_jobs_that_start_together_and_check_memory_false_goes_on(tmp_path, monkeypatch):
    """The same estimate as the advisor's; a parallel launcher's first wave counts n_jobs copies, a later job one;
    check_memory=false runs what the check refuses."""
    from omegaconf import OmegaConf

    from gradscale import memory
    from gradscale.checks import ConfigError
    from gradscale.hydra_glue import to_object
    from gradscale.run import check_memory, jobs_side_by_side
    from tests.conftest import TINY, compose, run_in_process

    def hydra_cfg(n_jobs, num):
        return OmegaConf.create({"launcher": {} if n_jobs is None else {"n_jobs": n_jobs}, "job": {"num": num},
                                 "mode": "RunMode.MULTIRUN"})

    cases = [(None, 0), (2, 0), (2, 1), (2, 2), (4, 3)]
    assert [jobs_side_by_side(hydra_cfg(n_jobs, num)) for n_jobs, num in cases] == [1, 2, 2, 1, 4]
    single_run = OmegaConf.create({"launcher": {"n_jobs": 2}, "job": {}, "mode": "RunMode.RUN"})
    assert jobs_side_by_side(single_run) == 1
    cfg = to_object(compose(TINY))
    needed = memory.run_estimate(cfg, "cpu", 1).total
    assert needed == memory.estimate(cfg, "cpu", optimizer_state=True, sequences_per_forward=cfg.batch_size).total
    monkeypatch.setattr(memory, "free_memory", lambda device_type: (int(1.5 * needed), "1.5 estimates free"))
    check_memory(cfg, side_by_side=1)  # fits
    monkeypatch.setattr(memory, "free_memory", lambda device_type: (int(1.05 * needed), "1.05 estimates free"))
    with pytest.raises(ConfigError, match=r"and 1.1 times that free; 1.05 estimates free"):
        check_memory(cfg, side_by_side=1)  # the estimate fits, its margin does not
    monkeypatch.setattr(memory, "free_memory", lambda device_type: (int(2.0 * needed), "2 estimates free"))
    side_by_side = r"^error: this run needs about [\d.]+ GiB, 2 processes side by side of [\d.]+ GiB \(weights "
    with pytest.raises(ConfigError, match=side_by_side):
        check_memory(cfg, side_by_side=2)
    monkeypatch.setattr(memory, "free_memory", lambda device_type: (1 << 20, "1 MiB free"))
    with pytest.raises(ConfigError, match=r"^error: this run needs about .* times that free; 1 MiB free: "):
        run_in_process(tmp_path / "refused", [])
    result, _ = run_in_process(tmp_path / "anyway", ["check_memory=false"])
    assert result["steps_done"] == 4
