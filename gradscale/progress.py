"""The training loop's console lines: long work is never silent (issue 41).

A step's line comes when the step ends and a tenth of the run's steps, or SILENCE_S of wall time, has passed
since the last line; it says the steps per second so far and the time left at that rate. Where one step or
one eval takes longer than SILENCE_S (SmolLM2 on 2 CPU cores, an eval of hundreds of sequences), a thread
says what is still running, every SILENCE_S. An eval says its size when it starts and its time when it ends.
"""

from __future__ import annotations

import logging
import threading
import time

SILENCE_S = 30.0  # the longest the console stays quiet while the loop works
LINES_PER_RUN = 10  # a line at least every tenth of the run's steps, however fast they are


class Progress:
    """The loop's progress lines, for `steps` steps from `first_step` (a resumed run's), logged to `log`; the
    tenths fall on steps that log their loss (multiples of log_every) where those come often enough.

    A context manager: the heartbeat thread runs inside it. Lines go through `say`, which both threads call:
    a lock keeps the clock of the last line and the activity the heartbeat reports consistent."""

    def __init__(self, steps: int, first_step: int, log: logging.Logger, log_every: int = 1):
        self.steps, self.first_step, self.log = steps, first_step, log
        tenth = max(1, steps // LINES_PER_RUN)
        self.every = tenth - tenth % log_every if log_every <= tenth else tenth
        self.started = self.last_line = self.last_pace = time.monotonic()  # any line; the last step's line
        self.activity: tuple[str, float] | None = None  # what runs now, since when: for the heartbeat
        self.step_activity: tuple[str, float] | None = None  # the step an eval runs in: restored after it
        self.eval_started = 0.0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)

    def __enter__(self) -> Progress:
        self.heartbeat.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.heartbeat.join()

    def say(self, message: str, *args) -> None:
        with self.lock:
            self.last_line = time.monotonic()
            self.log.info(message, *args)

    def _doing(self, what: str) -> tuple[str, float]:
        with self.lock:
            self.activity = (what, time.monotonic())
            return self.activity

    def step_started(self, step: int) -> None:
        self.step_activity = self._doing(f"step {step}/{self.steps}")

    def step_done(self, step: int, measured: str | None = None) -> None:
        """The step's line, when one is due: `measured` (loss, grad norm: a logged step's) and the pace."""
        now = time.monotonic()
        if not (step % self.every == 0 or step in (self.first_step, self.steps - 1)
                or now - self.last_pace >= SILENCE_S):  # a heartbeat has no pace: a slow step still gets its line
            return
        self.last_pace = now
        rate = (step + 1 - self.first_step) / max(now - self.started, 1e-9)  # the run so far, evals included
        pace = f"{rate:.2f} steps/s, {duration((self.steps - step - 1) / rate)} left"
        self.say("step %d/%d | %s", step, self.steps, f"{measured} | {pace}" if measured else pace)

    def eval_start(self, step: int, sequences: int, seq_len: int) -> None:
        self.say("step %d/%d | eval: %d sequences of %d tokens", step, self.steps, sequences, seq_len)
        self.eval_started = self._doing(f"the eval at step {step}/{self.steps}")[1]

    def eval_done(self, step: int, loss: float) -> None:
        took = time.monotonic() - self.eval_started
        with self.lock:
            self.activity = self.step_activity  # the step goes on: Adam statistics, a checkpoint
        self.say("step %d/%d | eval loss %.4f | done in %.1f s", step, self.steps, loss, took)

    def _beat(self) -> None:
        while not self.stopped.wait(SILENCE_S / 10):  # a line at most a tenth of SILENCE_S late
            with self.lock:
                now = time.monotonic()
                if self.activity is None or now - max(self.last_line, self.activity[1]) < SILENCE_S:
                    continue
                what, since = self.activity
                self.last_line = now
                self.log.info("still in %s (%s so far)", what, duration(now - since))


def duration(seconds: float) -> str:
    """'45 s', '3 min 20 s', '2 h 05 min': a time left or taken, as a person reads it."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
