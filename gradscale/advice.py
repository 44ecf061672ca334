"""The advisor's vocabulary, which its command (gradscale.advise, the training side) and its reading
(gradscale.analysis.advise) share: the verdicts' thresholds, the multipliers asked for on the command line, and
the one-line error of a bad flag. No torch, no Hydra."""

from __future__ import annotations

import math
from pathlib import Path

from gradscale.checks import output_file_problem
from gradscale.runs import short_number

WITHIN = 0.99  # update-RMS ratio at or above: "within 1%"
BROKEN = 0.90  # below: "broken"; in between: "noticeable"
DEFAULT_WORLD_SIZES = tuple(2**k for k in range(1, 13))  # 2 .. 4096


class AdviseError(Exception):
    """Bad input: one line for the user, exit 2."""


def _floats(text: str, key: str, integer: bool = False) -> list[float]:
    try:
        values = [int(v) if integer else float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise AdviseError(f"error: {key}={text!r} is not a comma-separated list of "
                          f"{'integers' if integer else 'numbers'}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values) or (integer and min(values) < 1):
        raise AdviseError(f"error: {key}={text!r}: every value must be {'an integer >= 1' if integer else '> 0'}")
    return values


def check_options(world_sizes: str | None, scales: str | None, eps: float | None, json_file: Path | None,
                  figure: Path | None) -> tuple[list[float], list[str]]:
    """The multipliers and their labels from the flags, every flag checked (AdviseError, one line): before
    gradscale-advise starts its reference run, and before this command reads one."""
    if eps is not None and not (math.isfinite(eps) and eps > 0):
        raise AdviseError(f"error: --eps={eps!r} must be > 0")
    for flag, path in (("--json", json_file), ("--figure", figure)):
        if path is not None and (problem := output_file_problem(path)):
            raise AdviseError(f"error: {flag}={str(path)!r} {problem}")
    if scales:
        values = _floats(scales, "--scales")
        return values, [f"c={short_number(c)}" for c in values]
    sizes = _floats(world_sizes or ",".join(map(str, DEFAULT_WORLD_SIZES)), "--world-sizes", integer=True)
    return [1 / n for n in sizes], [f"N={n}" for n in sizes]
