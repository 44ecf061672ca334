"""What the theory predicts (docs/design.md, physics 2-4), as plain functions of measured quantities.

Notation: c = effective gradient multiplier, s = a coordinate's sqrt(v_hat) at c = 1, eps = Adam's eps.
c_eff itself is experiments.recipes' (Recipe.c_eff), the one rule the trainer and the analysis share.
"""

from __future__ import annotations

import numpy as np


def update_ratio(c, s, eps):
    """Adam's per-coordinate update at multiplier c relative to c = 1 with eps -> 0: r = c*s / (c*s + eps)."""
    c, s = np.asarray(c, dtype=float), np.asarray(s, dtype=float)
    return c * s / (c * s + eps)


def critical_scale(s, eps):
    """c* = eps / s: below it, eps dominates that coordinate's denominator (r < 1/2)."""
    return eps / np.asarray(s, dtype=float)


def twin_value(value: float, c: float, power: int) -> float:
    """The twin run's value of a key (experiments.optimizers.base.ScaleRule.twin): value * c**power, e.g.
    SGD(lr, c) == SGD(lr * c, 1), AdamW(c, eps) == AdamW(1, eps / c) exactly."""
    return value * c if power == 1 else value / c if power == -1 else value * c**power


def eps_dominated_share(c: float, s, eps: float, weights=None) -> float:
    """Share of coordinates with c*s < eps (weights: coordinates each s stands for)."""
    s = np.asarray(s, dtype=float)
    weights = np.ones_like(s) if weights is None else np.asarray(weights, dtype=float)
    return float(weights[c * s < eps].sum() / weights.sum())


def breakdown_band(sqrt_v_quantiles: dict[str, float], eps: float, low: str = "q10", high: str = "q90"):
    """(c_start, c_all): the multiplier range where Adam's invariance breaks down, from measured sqrt(v_hat)
    quantiles. Below c_start = eps/s_low the most rarely updated tenth of coordinates is eps-dominated;
    below c_all = eps/s_high nine tenths are."""
    return float(eps / sqrt_v_quantiles[low]), float(eps / sqrt_v_quantiles[high])


def clipped_share(c: float, grad_norms, max_norm: float) -> float:
    """Share of steps that clipping scales at multiplier c, given the grad norms measured at c = 1."""
    return float((c * np.asarray(grad_norms, dtype=float) > max_norm).mean())


def clipping_band(grad_norms, max_norm: float) -> tuple[float, float]:
    """(c_first, c_every): from c_first on the step with the largest grad norm is clipped, so runs start to
    differ; from c_every on every step is, each gradient has norm max_norm whatever c is, and the
    deviation plateaus (docs/design.md physics 5)."""
    norms = np.asarray(grad_norms, dtype=float)
    return float(max_norm / norms.max()), float(max_norm / norms.min())


def crossing(c_values, deviations, threshold: float, side: str = "below") -> float:
    """The multiplier where the deviation from c = 1 first exceeds `threshold`, walking away from c = 1
    (side "below" or "above"), interpolated in log-log (deviations grow like a power of c; linearly in log c
    from an exact zero); NaN when it never does on the grid."""
    c, d = np.asarray(c_values, dtype=float), np.asarray(deviations, dtype=float)
    order = np.argsort(-c) if side == "below" else np.argsort(c)
    keep = (c[order] <= 1.0) if side == "below" else (c[order] >= 1.0)
    c, d = c[order][keep], d[order][keep]
    for i in range(1, len(c)):
        if d[i] > threshold:
            if not np.isfinite(d[i]) or d[i - 1] > threshold:
                return float(c[i])
            if d[i - 1] > 0:
                t = (np.log(threshold) - np.log(d[i - 1])) / (np.log(d[i]) - np.log(d[i - 1]))
            else:
                t = (threshold - d[i - 1]) / (d[i] - d[i - 1])
            return float(np.exp(np.log(c[i - 1]) + t * (np.log(c[i]) - np.log(c[i - 1]))))
    return float("nan")


QUANTILE_LEVELS = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def share_below(quantiles: dict[str, float], threshold: float) -> float:
    """Share of coordinates with s < threshold, from measured quantiles of s: the distribution function
    interpolated linearly in log s between them. Outside [q01, q99] only a bound is known: the result is
    clipped to [0.01, 0.99] (read 0.01 as "at most 1%", 0.99 as "at least 99%")."""
    levels = [(quantiles[k], p) for k, p in QUANTILE_LEVELS.items() if quantiles.get(k, 0) > 0]
    if not levels:  # every quantile is an exact zero: every coordinate is below any positive threshold
        return 1.0
    s, p = zip(*sorted(levels))
    return float(np.interp(np.log(threshold), np.log(s), p))


def tensor_group(name: str) -> str:
    """The four groups the breakdown is reported by (LoRA adapters count with the layer they adapt)."""
    if "embed" in name or "lm_head" in name:
        return "embeddings / output"
    if "norm" in name:
        return "norms"
    if "attn" in name or any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    if "mlp" in name or any(k in name for k in ("gate_proj", "up_proj", "down_proj")):
        return "MLP"
    return "other"
