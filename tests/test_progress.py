"""The console's progress lines (gradscale/progress.py): a line every tenth of the steps or every SILENCE_S,
whichever comes first, with the pace and the time left; a heartbeat while one step or eval outlasts SILENCE_S.
SILENCE_S is shrunk to a fraction of a second and a step made slow with a sleep: the tests count lines, never
time anything."""

from __future__ import annotations

import logging
import re
import time

import pytest

from gradscale import progress, train
from tests.conftest import run_in_process

LOG = logging.getLogger("tests.progress")


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_a_line_every_tenth_of_the_steps_with_the_pace_and_time_left(caplog, monkeypatch):
    monkeypatch.setattr(progress, "SILENCE_S", 3600.0)  # fast steps: only the tenths speak
    with caplog.at_level(logging.INFO, logger=LOG.name), progress.Progress(20, 0, LOG) as p:
        for step in range(20):
            p.step_started(step)
            p.step_done(step, "loss 1.0000" if step % 5 == 0 else None)
    said = lines(caplog)
    assert [int(re.match(r"step (\d+)/20 \| ", s)[1]) for s in said] == [*range(0, 20, 2), 19]
    assert all(re.search(r"\| [\d.]+ steps/s, \d+ s left$", s) for s in said), said
    assert said[0].startswith("step 0/20 | loss 1.0000 | ") and " loss " not in said[1]
    assert said[-1].endswith(" 0 s left")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOG.name), progress.Progress(600, 100, LOG, log_every=50) as p:
        for step in range(100, 600):
            p.step_done(step)
    # a resumed run's first step speaks; the tenths (60 steps) fall on the logged steps (multiples of 50)
    steps = [int(re.match(r"step (\d+)/600", s)[1]) for s in lines(caplog)]
    assert steps == [100, 150, 200, 250, 300, 350, 400, 450, 500, 550, 599]


def test_a_slow_step_and_a_slow_eval_are_never_silent(caplog, monkeypatch):
    monkeypatch.setattr(progress, "SILENCE_S", 0.3)
    with caplog.at_level(logging.INFO, logger=LOG.name), progress.Progress(1000, 0, LOG) as p:
        for step in range(22):  # the tenths at 0, 100, ...: the others speak only when SILENCE_S has passed
            p.step_started(step)
            time.sleep(0.8 if step == 1 else 0.03)
            p.step_done(step)
        p.eval_start(21, 16, 128)
        time.sleep(0.8)
        p.eval_done(21, 2.5)
        quiet_from = len(lines(caplog))
    time.sleep(0.5)
    assert not p.heartbeat.is_alive() and len(lines(caplog)) == quiet_from  # stopped with the loop
    said = [re.sub(r"[\d.]+ steps/s, .* left$", "PACE", re.sub(r"\(\d+ s so far\)", "(T)", s)) for s in lines(caplog)]
    assert said[0] == "step 0/1000 | PACE"
    step_1 = said.index("step 1/1000 | PACE")  # its own line, heartbeats or not
    assert said[1:step_1] and set(said[1:step_1]) == {"still in step 1/1000 (T)"}  # during the step
    fast = [s for s in said if re.fullmatch(r"step ([2-9]|1\d|2[01])/1000 \| PACE", s)]
    assert 1 <= len(fast) < 20, said  # 20 steps of 0.03 s: a line once 0.3 s have passed, not one a step
    eval_start = said.index("step 21/1000 | eval: 16 sequences of 128 tokens")
    assert said[eval_start + 1] == "still in the eval at step 21/1000 (T)"
    assert re.fullmatch(r"step 21/1000 \| eval loss 2\.5000 \| done in [\d.]+ s", lines(caplog)[-1])


def test_the_loop_says_the_eval_size_and_a_slow_step_gets_a_heartbeat(tmp_path, cache_dir, caplog, monkeypatch):
    """Through the loop itself (a tiny run, TINY: 4 steps, an eval every 2 of 1 batch of 8 x 64 tokens), its step 1
    made slow."""
    monkeypatch.setattr(progress, "SILENCE_S", 0.3)
    accumulate, calls = train.accumulate_gradients, []

    def slow_second_step(*args):
        calls.append(1)
        time.sleep(0.8 if len(calls) == 2 else 0)
        return accumulate(*args)

    monkeypatch.setattr(train, "accumulate_gradients", slow_second_step)
    with caplog.at_level(logging.INFO, logger="gradscale.train"):
        result, _ = run_in_process(tmp_path, [])
    assert result["status"] == "completed"
    said = [r.getMessage() for r in caplog.records if r.name == "gradscale.train"]
    assert any(s.startswith("still in step 1/4 (") for s in said), said
    for step in (1, 3):
        assert f"step {step}/4 | eval: 8 sequences of 64 tokens" in said
        assert any(re.fullmatch(rf"step {step}/4 \| eval loss [\d.]+ \| done in [\d.]+ s", s) for s in said)
    assert [s.split(" |")[0] for s in said if "steps/s" in s] == [f"step {i}/4" for i in range(4)]


@pytest.mark.parametrize("seconds, said", [(0.4, "0 s"), (59.6, "1 min 00 s"), (200, "3 min 20 s"),
                                           (7500, "2 h 05 min")])
def test_durations_read_as_a_person_says_them(seconds, said):
    assert progress.duration(seconds) == said
