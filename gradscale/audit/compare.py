"""What a rank holds against the one-process float64 reference: the multiplier c, per tensor group, the residual, the
logged norm (Result), and what a uniform c means for SGD, AdamW and a clipping threshold."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

TOLERANCE = 1e-4  # fp32 steps against a float64 reference, summed in another order: about 1e-6 off


BF16_RESIDUAL = 2e-2  # below this, and fitting no suspect: a residual of the order of bf16's rounding (2^-8)


@dataclass
class Result:
    world_size: int
    accumulation: int
    tokens: list[list[int]]  # trained tokens per rank, per micro-batch
    sequences: int = 0  # in the global batch
    reference: str = "token-mean"  # what the gradient is compared with: the declared objective, or the layout's
    c: float = math.nan  # <g, g_ref> / <g_ref, g_ref>
    group_c: dict[str, float] = field(default_factory=dict)
    residual: float = math.nan  # ||g - c g_ref|| / ||c g_ref||
    norm: float = math.nan  # ||g||, the gradient the optimizer receives
    reference_norm: float = math.nan
    logged_norm: float | None = None
    replica_spread: float = 0.0  # max over ranks of ||g_r - g_0|| / ||g_0||
    # c and residual against the step's own gradient at N = 1, K = 1 (nan where that is the reference or missing)
    layout_c: float = math.nan
    layout_residual: float = math.nan
    fits: list[str] = field(default_factory=list)  # the suspects this gradient is (x its c), where it fails
    ok: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def logged_over_true(self) -> float | None:
        return None if self.logged_norm is None or not self.norm else self.logged_norm / self.norm

    def same_at_every_layout(self, tolerance: float) -> bool:
        """This gradient is the step's own N = 1, K = 1 gradient (so no reduction over ranks or micro-batches
        changed it), as far as it was measured."""
        return self.layout_residual <= tolerance and abs(self.layout_c - 1) <= tolerance


def reference_gradient(model, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, float64: the gradient of the global token-mean loss."""
    from gradscale.audit.objectives import OBJECTIVES, trained_mask, weighted_gradients

    weights = OBJECTIVES["token-mean"].weights(trained_mask(labels))
    return weighted_gradients(model, input_ids, labels, {"token-mean": weights})["token-mean"]


def flat(g: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([g[n].double().flatten() for n in names])


def fit(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(c, residual): the multiplier that brings ref closest to g, and what it leaves over ||c ref||."""
    if ref.norm() == 0:
        return math.nan, math.inf
    c = (g @ ref / (ref @ ref)).item()
    return c, ((g - c * ref).norm() / (abs(c) * ref.norm())).item() if c else math.inf


def compare(result: Result, grads: list[dict[str, torch.Tensor]], logged: list[float | None],
            reference: dict[str, torch.Tensor], tolerance: float, *, reference_name: str = "the global token-mean",
            baseline: dict[str, torch.Tensor] | None = None,
            suspects: dict[str, dict[str, torch.Tensor]] | None = None,
            slots: dict[tuple[int, int], dict[str, torch.Tensor]] | None = None) -> Result:
    """Fill result's numbers and verdict from every rank's gradient and logged norm, against `reference` (named
    `reference_name` in the reasons). baseline: the step's own N = 1, K = 1 gradient, to tell an objective other
    than the reference's (the same at every layout) from a layout bug. Where the gradient fails it is fitted
    against suspects ({what the step computes: its gradient at this layout}, each match named) and then against
    any weighting of the micro-batches (slots: {(rank, micro-batch): the gradient of its token sum over the global
    count}), which names a rank or micro-batch weighted apart."""
    from gradscale.theory import tensor_group

    for g in grads:
        if set(g) != set(reference):
            changed = sorted(set(g) ^ set(reference))[:3]
            result.reasons.append(f"the step changed the model's parameters ({', '.join(changed)}, ...): the audit "
                                  "compares the gradients of the model it hands over, in place")
            return result

    ref = flat(reference, reference)
    per_rank = [flat(g, reference) for g in grads]
    for rank, g in enumerate(per_rank):
        if not torch.isfinite(g).all():
            kind = "NaN" if torch.isnan(g).any() else "inf"
            empty = [f"rank {r} micro-batch {k}" for r, counts in enumerate(result.tokens)
                     for k, n in enumerate(counts) if n == 0]
            hint = f" ({', '.join(empty[:3])} had no trained token: a mean over zero tokens?)" if empty else ""
            result.reasons.append(f"{kind} in rank {rank}'s gradient{hint}")
            return result
    g = per_rank[0]
    result.norm, result.reference_norm = g.norm().item(), ref.norm().item()
    result.replica_spread = max(((x - g).norm() / g.norm()).item() if g.norm() > 0 else (x - g).norm().item()
                                for x in per_rank)
    result.c, result.residual = fit(g, ref)
    if baseline is not None:
        result.layout_c, result.layout_residual = fit(g, flat(baseline, reference))
    groups: dict[str, list[str]] = {}
    for name in reference:
        groups.setdefault(tensor_group(name), []).append(name)
    group_residuals = {}
    for group, names in groups.items():
        result.group_c[group], group_residuals[group] = fit(flat(grads[0], names), flat(reference, names))
    result.logged_norm = logged[0]
    failing = (result.residual > tolerance or abs(result.c - 1) > tolerance
               or any(abs(c / result.c - 1) > tolerance for c in result.group_c.values()))
    if failing and result.norm > 0:
        matched: list[torch.Tensor] = []
        for what, suspect in (suspects or {}).items():
            s = flat(suspect, reference)
            # skip what at this layout is only a multiple of the reference or of a suspect already named
            if all(fit(s, other)[1] > tolerance for other in [ref, *matched]):
                c, residual = fit(g, s)
                if residual <= tolerance:
                    result.fits.append(f"{what} x{c:.6g}")
                    matched.append(s)
        if not result.fits and slots and result.residual > tolerance:
            result.fits += _slot_weights(g, {key: flat(v, reference) for key, v in slots.items()}, tolerance)

    if result.norm == 0:
        last_empty = result.accumulation > 1 and result.tokens[0][-1] == 0
        result.reasons.append("the gradient is zero: did the step leave it in .grad?" + (
            " (rank 0's last micro-batch trains no token: a step that zeroes the gradients between micro-batches "
            "keeps only that one's)" if last_empty else ""))
        result.ok = False
        return result
    if result.replica_spread > tolerance:
        result.reasons.append(f"ranks hold different gradients (spread {result.replica_spread:.2g})")
    groups_differ = any(abs(c / result.c - 1) > tolerance for c in result.group_c.values()) if result.c else False
    scaled = ", ".join(f"{g} x{c:.6g}" for g, c in sorted(result.group_c.items(), key=lambda x: -abs(x[1] - 1)))
    if groups_differ and max(group_residuals.values()) <= tolerance:  # each group scaled, by its own factor
        odd = [g for g, c in result.group_c.items() if abs(c - _median(result.group_c.values())) > tolerance * abs(c)]
        result.reasons.append(f"tensor groups scaled unequally: {scaled}"
                              + (f" (the {odd[0]} group alone is off)" if len(odd) == 1 else ""))
    elif result.residual > tolerance:
        result.reasons.append(_residual_reason(result, reference_name, tolerance))
    elif groups_differ:  # a small group off, too small to move the overall residual past the tolerance
        result.reasons.append(f"tensor groups differ: {scaled}")
    elif abs(result.c - 1) > tolerance:
        result.reasons.append(f"gradient x{result.c:.6g} {reference_name}'s" + _multiplier_hint(result, tolerance))
    ratio = result.logged_over_true
    if ratio is not None and abs(ratio - 1) > tolerance:
        result.reasons.append(f"logged norm x{ratio:.4g} the gradient's (one shard's norm? logged before the "
                              "reduction?)")
    result.ok = not result.reasons
    return result


def _median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _slot_weights(g: torch.Tensor, slots: dict[tuple[int, int], torch.Tensor], tolerance: float) -> list[str]:
    """Where g is a weighted sum of the micro-batches' token-sum gradients (each over the global count): the
    weights that differ from 1 (the token mean's), as one line; else nothing."""
    keys = [key for key, v in slots.items() if v.norm() > 0]
    if not keys:
        return []
    a = torch.stack([slots[key] for key in keys], 1)
    weights = torch.linalg.lstsq(a, g[:, None]).solution[:, 0]
    if (g - a @ weights).norm() > tolerance * g.norm():
        return []
    by_rank: dict[int, list[float]] = {}
    for (rank, _), w in zip(keys, weights.tolist(), strict=True):
        by_rank.setdefault(rank, []).append(w)
    if all(max(ws) - min(ws) <= 10 * tolerance * max(abs(w) for w in ws) for ws in by_rank.values()):
        parts = {f"rank {rank}": ws[0] for rank, ws in by_rank.items()}
    else:
        parts = {f"rank {rank} micro-batch {k}": w for (rank, k), w in zip(keys, weights.tolist(), strict=True)}
    # the usual weight: the most common, ties to the one nearest 1 (the token mean's)
    values = list(parts.values())
    usual = max(values, key=lambda w: (sum(abs(v - w) <= 10 * tolerance * abs(w) for v in values), -abs(w - 1)))
    odd = [f"{where} x{w:.4g}" for where, w in parts.items() if abs(w - usual) > 10 * tolerance * abs(usual)]
    rest = f"the rest x{usual:.4g}" if len(odd) < len(parts) else ""
    return [f"the token mean with its tokens weighted by where they are: {', '.join([*odd, rest] if rest else odd)}"]


def _residual_reason(r: Result, reference_name: str, tolerance: float) -> str:
    head = f"residual {r.residual:.2g}"
    if r.fits:
        return f"{head}: the gradient is that of {' or of '.join(r.fits)}"
    if r.residual < BF16_RESIDUAL:
        return (f"{head}: of the order of bf16's rounding (2^-8 = 3.9e-3), not of a token weighting bug (0.05 and "
                f"more on this batch): a step in bf16 (it passes with --tolerance {BF16_RESIDUAL:g}), or a small term "
                "weighted by the layout, such as an auxiliary loss (the same residual at every K of a world size, "
                "none at N = 1)")
    if (r.world_size, r.accumulation) != (1, 1) and r.same_at_every_layout(tolerance):
        return (f"{head}, the same gradient as at N = 1, K = 1: not a reduction over ranks or micro-batches but an "
                f"objective other than {reference_name}")
    if (r.world_size, r.accumulation) == (1, 1):
        return (f"{head} at N = 1, K = 1, where no reduction over ranks or micro-batches acts: the step's objective "
                f"is not {reference_name} (--objective names another; --reference layout checks any)")
    return (f"{head}: tokens weighted unequally, by none of the per-rank, per-micro-batch or per-sequence means the "
            "audit knows")


def _multiplier_hint(r: Result, tolerance: float) -> str:
    """What a uniform c's signature says beyond its value: a norm clipped before the audit saw it, or the same
    factor at every layout."""
    rounded = float(f"{r.norm:.1g}")
    if r.c < 1 and abs(r.norm - rounded) <= tolerance * rounded:
        return (f" (||g|| = {rounded:g} exactly, where the reference's is {r.reference_norm:.4g}: clipped at "
                f"max_norm {rounded:g} before the optimizer was handed it? the audit wants the gradient before "
                "clipping)")
    tokens = sum(map(sum, r.tokens))
    if tokens >= 10 and abs(r.c - tokens / (tokens + 1)) <= tolerance:  # apart from 1/2, 1/N and the like
        return (f" (= {tokens} / {tokens + 1}: one token too many in the count, the label at position 0 that no "
                "position predicts, which the batch's first sequence has: a count on unshifted labels? count "
                "labels[:, 1:] != -100)")
    if abs(r.c - tokens) <= tolerance * tokens:
        return f" (= the global trained-token count, {tokens}: the token sum, never divided by the count)"
    if (r.world_size, r.accumulation) != (1, 1) and r.same_at_every_layout(tolerance):
        return " (the same at N = 1, K = 1: a count or divisor of the step's own, not its reduction over ranks)"
    return ""


def meaning(c: float, eps: float | None = None, by: float = 0.1) -> str:
    """What a uniform multiplier c does: SGD's lr times c; AdamW's update per coordinate times
    (s + eps) / (s + eps / c), off by more than `by` where sqrt(v_hat) = s is below the threshold (eps: AdamW's
    default unless given); and a clipping threshold max_norm acts as max_norm / c on the right gradient
    (docs/design.md physics 13)."""
    from gradscale.optimizers.adamw import AdamWConfig
    from gradscale.theory import departure_threshold

    eps = AdamWConfig().eps if eps is None else eps

    sgd = f"SGD: the lr is in effect x{c:.4g}"
    threshold = departure_threshold(c, eps, by)
    effect = ("steps it should clip go unclipped: AdamW feels that; without the fix, repair with eps and M both "
              f"x{c:.4g}" if c < 1 else "steps it should not clip get clipped: AdamW feels that")
    clip = f"; clipping at max_norm M clips the right gradient at M / {c:.4g} = {1 / c:.4g} M instead ({effect})"
    if threshold is None:
        return f"{sgd}; AdamW (eps {eps:g}): no coordinate's update moves by more than {by:.0%}{clip}"
    way = "cut" if c < 1 else "raised"
    return (f"{sgd}; AdamW (eps {eps:g}): a coordinate's update is {way} by more than {by:.0%} where "
            f"sqrt(v_hat) < {threshold:.2g} (the advisor measures that share on your model: "
            f"gradscale-advise){clip}")
