"""The audit's verdicts: the table, each failing configuration's reasons and what its c means, the JSON, and the
assertion a project's tests call."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict

from gradscale.audit.batch import SEQ_LEN
from gradscale.audit.compare import BF16_RESIDUAL, TOLERANCE, Result, meaning
from gradscale.audit.launch import audit


def is_uniform_multiplier(r: Result, tolerance: float) -> bool:
    """The gradient is c times the right one, c != 1: what c means is then the whole story."""
    return math.isfinite(r.c) and abs(r.c - 1) > tolerance and r.residual <= tolerance


def format_table(results: list[Result]) -> str:
    from gradscale.runs import render_table

    header = ("N", "K", "trained tokens per rank", "c", "groups' c", "residual", "logged/true", "verdict")
    lines = []
    for r in results:
        groups = (f"{min(r.group_c.values()):.6f}..{max(r.group_c.values()):.6f}" if r.group_c else "-")
        ratio = r.logged_over_true
        lines.append((str(r.world_size), str(r.accumulation), ",".join(str(sum(t)) for t in r.tokens),
                      f"{r.c:.6f}" if math.isfinite(r.c) else "-", groups,
                      f"{r.residual:.1e}" if math.isfinite(r.residual) else "-",
                      "-" if ratio is None else f"{ratio:.6f}", "ok" if r.ok else "FAIL"))
    return render_table(header, lines)


def report(target: str, results: list[Result], tolerance: float) -> str:
    """The table, then each failing configuration's reasons and what its c means."""
    lines = [format_table(results)]
    failed = [r for r in results if not r.ok]
    for r in failed:
        lines.append(f"N={r.world_size} K={r.accumulation}: " + "; ".join(r.reasons))
    uniform = {round(r.c, 6) for r in failed if is_uniform_multiplier(r, tolerance)}
    for c in sorted(uniform):
        lines.append(f"what c = {c:g} means: {meaning(c)}")
    lines.append(verdict(target, results, tolerance))
    return "\n".join(lines)


def verdict(target: str, results: list[Result], tolerance: float) -> str:
    """The last line: whether every configuration passes, and if not, whether the gradient depends on the layout
    (a bug whatever the objective) or is the same at every layout (an objective other than the declared one)."""
    reference = results[0].reference if results else "token-mean"
    failed = [r for r in results if not r.ok]
    if not failed:
        what = ("its own gradient at N = 1, K = 1 (the gradient does not depend on how the global batch is split)"
                if reference.startswith("layout") else
                f"the {'global token-mean' if reference == 'token-mean' else reference} gradient")
        return (f"{target}: every configuration gives {what} (c = 1, residual, groups and logged norm within "
                f"{tolerance:g})")
    head = f"{target}: {len(failed)} of {len(results)} configurations FAIL"
    if reference.startswith("layout"):
        return f"{head}: the gradient depends on the layout, a bug whatever the objective ({reference})"
    if all(tolerance < r.residual < BF16_RESIDUAL and not r.fits for r in failed):
        return (f"{head}, each by no more than bf16's rounding (residual < {BF16_RESIDUAL:g}): precision, not a "
                f"reduction bug; a bf16 step passes with --tolerance {BF16_RESIDUAL:g}")
    measured = [r for r in results if math.isfinite(r.layout_residual) and r.norm > 0]
    if measured and len(measured) == len(results) and all(r.same_at_every_layout(tolerance) for r in results):
        return (f"{head} against {reference}, with the same gradient at every layout (N = 1, K = 1 included): an "
                "objective or normalization other than the declared one, not a reduction bug (--objective names "
                "another; --reference layout checks only the layout)")
    dependent = [f"N={r.world_size} K={r.accumulation}" for r in measured if not r.same_at_every_layout(tolerance)]
    return head + (f": the gradient depends on the layout ({', '.join(dependent)} differ from N = 1, K = 1), a bug "
                   "whatever the objective" if dependent else "")


def as_json(target: str, results: list[Result], tolerance: float) -> dict:
    rows = []
    for r in results:
        row = asdict(r)
        row["logged_over_true"] = r.logged_over_true
        row["meaning"] = meaning(r.c) if is_uniform_multiplier(r, tolerance) else None
        rows.append(_finite_or_none(row))
    reference = results[0].reference if results else "token-mean"
    return {"target": target, "tolerance": tolerance, "seq_len": SEQ_LEN,
            "reference": reference if reference.startswith("layout") else
            f"one-process float64 gradient of the {reference} objective", "results": rows,
            "verdict": verdict(target, results, tolerance), "ok": all(r.ok for r in results)}


def _finite_or_none(value):
    """JSON has no NaN or inf: None in their place, at any depth."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def assert_gradient_matches(target: str, world_sizes: Sequence[int] = (1, 2, 4),
                            accumulations: Sequence[int] = (1, 4), tolerance: float = TOLERANCE,
                            objective: str = "token-mean", reference: str = "objective",
                            model_spec: str | None = None) -> list[Result]:
    """For a project's own tests: fails (AssertionError with the audit's table) unless every configuration
    gives the declared objective's gradient (reference="layout": the step's own at N = 1, K = 1)."""
    results = audit(target, world_sizes, accumulations, tolerance, objective=objective, reference=reference,
                    model_spec=model_spec)
    if not all(r.ok for r in results):
        raise AssertionError("\n" + report(target, results, tolerance))
    return results
