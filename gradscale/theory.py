"""What the theory predicts (docs/design.md, physics 2-4), as plain functions of measured quantities: the one
copy of each equation, which the advisor, the report and the tests all run.

Notation: c = effective gradient multiplier, s = a coordinate's sqrt(v_hat) at c = 1, eps = Adam's eps.
c_eff itself is gradscale.recipes' (Recipe.c_eff), the one rule the trainer and the analysis share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradscale.records import HIST_BINS, HIST_BINS_PER_DECADE, HIST_LOG10_MIN


def adam_denominator(s, eps: float, c=1.0):
    """Adam's denominator at multiplier c in units of the c = 1 gradient: c * sqrt(v_hat) + eps = c * (s + eps / c).
    The update m_hat / (sqrt(v_hat) + eps) at c is then (m_hat at c = 1) / (s + eps / c): the one equation
    behind every ratio below."""
    return np.asarray(s, dtype=float) + eps / np.asarray(c, dtype=float)


def update_ratio(c, s, eps):
    """Adam's per-coordinate update at multiplier c over that at c = 1 (same eps): (s + eps) / (s + eps / c);
    1 without eps, about c * s / eps once eps / c >> s."""
    return adam_denominator(s, eps) / adam_denominator(s, eps, c)


def departure_threshold(c: float, eps: float, by: float = 0.1) -> float | None:
    """The sqrt(v_hat) below which Adam's update at multiplier c is off by more than `by` (update_ratio
    outside 1 +- by), from (s + eps) / (s + eps / c) = q; None when none is (the ratio lies between 1 and c)."""
    q = 1 - by if c < 1 else 1 + by
    if (c < 1 and c >= q) or (c >= 1 and c <= q):
        return None
    return eps * (q / c - 1) / (1 - q)


def critical_scale(s, eps):
    """c* = eps / s: below it, eps dominates that coordinate's denominator (r < 1/2)."""
    return eps / np.asarray(s, dtype=float)


def twin_value(value: float, c: float, power: int) -> float:
    """The twin run's value of a key (gradscale.optimizers.base.ScaleRule.twin): value * c**power, e.g.
    SGD(lr, c) == SGD(lr * c, 1), AdamW(c, eps) == AdamW(1, eps / c) exactly."""
    return value * c if power == 1 else value / c if power == -1 else value * c**power


# A sqrt(v_hat) histogram (gradscale/records.py has its layout): index 0 the exact zeros, then bins of
# 1/8 decade. The geometric centre of each bin stands for its coordinates' s.
BIN_S = np.concatenate([[0.0], 10.0 ** (HIST_LOG10_MIN + (np.arange(HIST_BINS) + 0.5) / HIST_BINS_PER_DECADE)])
BIN_LOW = np.concatenate([[0.0], 10.0 ** (HIST_LOG10_MIN + np.arange(HIST_BINS) / HIST_BINS_PER_DECADE)])


@dataclass
class Histogram:
    """One step's histogram of a set of coordinates (a tensor, a group or the model), over 1 + HIST_BINS:
    counts, and energy, the sum of the squared unscaled update (m_hat / (s + eps))^2 at c = 1."""
    counts: np.ndarray
    energy: np.ndarray

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(self.counts + other.counts, self.energy + other.energy)


def histogram_of(record: dict) -> Histogram:
    """The Histogram of one adam_stats.jsonl record (its empty bins left out there)."""
    counts, energy = np.zeros(1 + HIST_BINS), np.zeros(1 + HIST_BINS)
    bins = np.asarray(record["hist_bins"], dtype=int) + 1
    counts[0], energy[0] = record["hist_zeros"], record["hist_zeros_energy"]
    counts[bins], energy[bins] = record["hist_count"], record["hist_energy"]
    return Histogram(counts, energy)


def update_rms_ratio(h: Histogram, c: float, eps: float, run_eps: float) -> float:
    """Predicted RMS of Adam's update at multiplier c over that at c = 1, both with `eps`, to bin resolution:
    ratio^2 = sum_b m_b^2 / D(s_b, c)^2 / sum_b m_b^2 / D(s_b, 1)^2, D = adam_denominator. The bins' m_hat^2
    come from the run's own eps: m_b^2 = E_b * D(s_b, 1; run_eps)^2 (exact for eps == run_eps)."""
    m_sq = h.energy * adam_denominator(BIN_S, run_eps) ** 2
    at_one = (m_sq / adam_denominator(BIN_S, eps) ** 2).sum()
    if at_one == 0:
        return 1.0
    return float(math.sqrt((m_sq / adam_denominator(BIN_S, eps, c) ** 2).sum() / at_one))


def eps_dominated_share(h: Histogram, c: float, eps: float) -> float:
    """Share of coordinates with c * s < eps (eps dominates their denominator); the bin holding the threshold
    counts pro rata in log s."""
    total = h.counts.sum()
    if total == 0:
        return 0.0
    threshold = eps / c
    below = h.counts[0] + h.counts[1:][BIN_LOW[1:] * 10 ** (1 / HIST_BINS_PER_DECADE) <= threshold].sum()
    inside = (BIN_LOW[1:] <= threshold) & (threshold < BIN_LOW[1:] * 10 ** (1 / HIST_BINS_PER_DECADE))
    if inside.any():
        b = int(np.flatnonzero(inside)[0])
        below += h.counts[1 + b] * (math.log10(threshold / BIN_LOW[1 + b]) * HIST_BINS_PER_DECADE)
    return float(min(below / total, 1.0))


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


def handed_norms(grad_norms, c: float, max_norm: float | None):
    """The norm of the gradient Adam is handed at multiplier c, step by step, from the grad norms measured at
    c = 1: c * ||g_t||, clipped to max_norm (min(c ||g_t||, max_norm); torch's 1e-6 aside)."""
    norms = c * np.asarray(grad_norms, dtype=float)
    return norms if max_norm is None else np.minimum(norms, max_norm)


def _adam_moments(norms, betas: tuple[float, float], steps_per_norm):
    """Adam's bias-corrected EMA_beta1(h) and EMA_beta2(h^2) of the handed norms h, per entry of `norms`, each
    standing for steps_per_norm steps (an int, or one count per entry: a run logged every 5th step has
    np.diff(steps, prepend=-1)), so that Adam's step count t is the logged step + 1."""
    b1, b2 = betas
    m = v = 0.0
    t, first, second = 0, [], []
    norms = np.asarray(norms, dtype=float)
    for h, k in zip(norms, np.broadcast_to(steps_per_norm, norms.shape)):
        for _ in range(int(k)):
            t += 1
            m, v = b1 * m + (1 - b1) * h, b2 * v + (1 - b2) * h * h
        first.append(m / (1 - b1**t))
        second.append(v / (1 - b2**t))
    return np.asarray(first), np.asarray(second)


def _ratio(a, b):
    """a / b, and 1 where both are 0 (no gradient yet: nothing to weigh)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return np.divide(a, b, out=np.ones_like(a), where=(a != 0) | (b != 0))


def adam_norm_weighting(norms, betas: tuple[float, float] = (0.9, 0.999), steps_per_norm=1):
    """Adam's update size as a function of the handed norms h_t alone: EMA_beta1(h)_t / sqrt(EMA_beta2(h^2)_t),
    both bias-corrected, per entry of `norms` (each standing for steps_per_norm steps: _adam_moments).
    It is the norm-weighting approximation (docs/design.md physics 13): each step's gradient is its norm
    times a direction that clipping does not change, and that norm is the same factor on every coordinate.
    A constant factor on h cancels (scale invariance); a factor that varies from step to step does not."""
    first, second = _adam_moments(norms, betas, steps_per_norm)
    return _ratio(first, np.sqrt(second))


def clipped_update_ratio(grad_norms, c: float, max_norm: float | None, c_ref: float = 1.0,
                         betas: tuple[float, float] = (0.9, 0.999), steps_per_norm=1):
    """Predicted ratio of Adam's update size at multiplier c to that at c_ref, both clipped at max_norm, step by
    step, from the grad norms measured at c = 1 (eps negligible: handed_multiplier brings it in). 1 where both
    runs clip at every step so far (case a) or neither does (case c); EMA(n) / sqrt(EMA(n^2)) where only the
    reference clips (case b: the clipped run's handed norm is constant, the other's is not)."""
    return _ratio(adam_norm_weighting(handed_norms(grad_norms, c, max_norm), betas, steps_per_norm),
                  adam_norm_weighting(handed_norms(grad_norms, c_ref, max_norm), betas, steps_per_norm))


def handed_multiplier(grad_norms, c: float, max_norm: float | None, c_ref: float = 1.0,
                      betas: tuple[float, float] = (0.9, 0.999), steps_per_norm=1):
    """The multiplier that Adam's sqrt(v_hat) carries at c against c_ref, both clipped at max_norm, step by step:
    sqrt(EMA_beta2(h_c^2) / EMA_beta2(h_ref^2)) of the handed norms (the norm-weighting approximation). It is
    c / c_ref where neither run clips and 1 where both clip at every step so far: eps (physics 3) meets this
    multiplier, not c. Adam's update at c over c_ref's is clipped_update_ratio times update_rms_ratio at it."""
    return np.sqrt(_ratio(_adam_moments(handed_norms(grad_norms, c, max_norm), betas, steps_per_norm)[1],
                          _adam_moments(handed_norms(grad_norms, c_ref, max_norm), betas, steps_per_norm)[1]))


NEARLY = 0.1  # a share of clipped steps this close to 0 or 1 may name the case it nearly is (shares said beside)
WITHIN_1PCT = 0.01  # ... when the norm weighting and the multiplier eps meets are within this of the exact case's


def clipping_case(grad_norms, c: float, max_norm: float, c_ref: float = 1.0, steps_per_norm=1) -> str:
    """Which of physics 13's cases a run at multiplier c is in against its reference at c_ref, both clipped at
    max_norm, from the reference's grad norms at c = 1: "a" both clip at every step, "b" one run at every step
    and the other at none, "c" neither clips, "mixed" otherwise. "Every" and "none" are to within NEARLY of
    the steps: one early step of 20 clipped in a run whose norms then fall is case (b), not a mix. Cases (a) and
    (c) promise what the exact case does (the bug vanishes; the unclipped answer holds), so they also need the
    last step's norm weighting within 1% of 1 and eps's multiplier within 1% of 1 or c / c_ref: a few large
    early norms clipped stay in sqrt(v_hat) for about 1 / (1 - beta2) steps."""
    run, ref = (clipped_share(m, grad_norms, max_norm) for m in (c, c_ref))
    shape = {"c_ref": c_ref, "steps_per_norm": steps_per_norm}
    weighting = float(clipped_update_ratio(grad_norms, c, max_norm, **shape)[-1])
    seen = float(handed_multiplier(grad_norms, c, max_norm, **shape)[-1])
    every = [share >= 1 - NEARLY for share in (run, ref)]
    none = [share <= NEARLY for share in (run, ref)]
    unweighted = abs(weighting - 1) <= WITHIN_1PCT
    if all(every) and unweighted and abs(seen - 1) <= WITHIN_1PCT:
        return "a"
    if all(none) and unweighted and abs(seen / (c / c_ref) - 1) <= WITHIN_1PCT:
        return "c"
    if (every[1] and none[0]) or (every[0] and none[1]):
        return "b"
    return "mixed"


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
