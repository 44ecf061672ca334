"""The optimizer-state statistics: Adam's sqrt(v_hat) as quantiles and histograms (adam_stats.jsonl), the
eps-dominated share and RMS logged every step, and the step-0 gradient's records the advisor reads.

Which optimizer a run builds, and how: the registry, gradscale/optimizers/.
"""

from __future__ import annotations

import numpy as np
import torch

from gradscale.parallel import Ranks, local
from gradscale.records import EPS_DOMINATED, HIST_BINS, HIST_BINS_PER_DECADE, HIST_LOG10_MIN, SQRT_V_RMS


def adam_states(optimizer: torch.optim.Optimizer):
    """(param, local exp_avg_sq, bias correction 1 - beta2^t, eps) for every Adam-type state.

    v_hat = exp_avg_sq / (1 - beta2^t); under FSDP2 exp_avg_sq is this rank's shard."""
    for p, _, v, _, bias_correction2, eps in adam_moments(optimizer):
        yield p, v, bias_correction2, eps


def adam_groups(optimizer: torch.optim.Optimizer):
    """The optimizer's Adam-type param groups (those with betas and eps: all of AdamW's, the Muon hybrid's AdamW
    part)."""
    return [group for group in optimizer.param_groups if "eps" in group and "betas" in group]


def adam_moments(optimizer: torch.optim.Optimizer):
    """(param, local exp_avg, local exp_avg_sq, 1 - beta1^t, 1 - beta2^t, eps) for every Adam-type state."""
    for group in adam_groups(optimizer):
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "exp_avg_sq" in state:
                t = float(state["step"])
                yield p, local(state["exp_avg"]), local(state["exp_avg_sq"]), 1 - beta1**t, 1 - beta2**t, group["eps"]


HIST_CHUNK = 1 << 20


@torch.no_grad()
def sqrt_v_histograms(optimizer: torch.optim.Optimizer, ranks: Ranks | None = None) -> torch.Tensor:
    """Per Adam-type tensor, over bins of s = sqrt(v_hat): the coordinate count and the energy, the sum of
    the squared unscaled update (m_hat / (s + eps))^2. Shape (tensors, 2, 1 + HIST_BINS), float64: index 0
    holds exact zeros, index 1 + b the bin [10^(MIN + b/8), 10^(MIN + (b+1)/8)). Under FSDP2 the shards are
    summed over ranks (every rank must call it). From it the update-RMS ratio at any multiplier c follows,
    to bin resolution: ratio(c)^2 = sum_b E_b r(s_b, c)^2 / sum_b E_b, r = (s + eps) / (s + eps / c)."""
    rows = []
    for _, m, v, bias_correction1, bias_correction2, eps in adam_moments(optimizer):
        # in chunks: the temporaries stay a few MB however large the tensor (a 3B model's embedding: 394M)
        chunks = ((m_chunk.float() / bias_correction1, (v_chunk.float() / bias_correction2).sqrt())
                  for m_chunk, v_chunk in zip(m.flatten().split(HIST_CHUNK), v.flatten().split(HIST_CHUNK)))
        rows.append(_histogram_row(chunks, eps, v.device))
    if not rows:
        return torch.zeros(0, 2, 1 + HIST_BINS, dtype=torch.float64)
    histograms = torch.stack(rows)
    return ranks.sum_if_sharded(histograms) if ranks is not None else histograms


def _histogram_row(chunks, eps: float, device) -> torch.Tensor:
    """(2, 1 + HIST_BINS) float64: coordinate count and energy (m_hat / (s + eps))^2 per bin of s, over
    chunks of (m_hat, s)."""
    row = torch.zeros(2, 1 + HIST_BINS, dtype=torch.float64, device=device)
    for m_hat, s in chunks:
        energy = (m_hat / (s + eps)).square()
        index = ((s.log10() - HIST_LOG10_MIN) * HIST_BINS_PER_DECADE).floor().clamp(0, HIST_BINS - 1) + 1
        index = torch.where(s > 0, index, 0).long()  # log10(0) = -inf: zeros get their own slot
        row[0] += torch.bincount(index, minlength=1 + HIST_BINS)
        row[1] += torch.bincount(index, weights=energy.double(), minlength=1 + HIST_BINS)
    return row


QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
MAX_QUANTILE_SAMPLE = 1 << 20  # torch.quantile's input limit is 2^24; a strided sample is plenty


def quantiles(values: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """torch.quantile's linear interpolation. On the CPU numpy's, whose selection is O(n) where
    torch.quantile sorts (docs/performance.md)."""
    if values.device.type == "cpu":
        return np.quantile(values.numpy(), qs).tolist()
    return torch.quantile(values, torch.tensor(qs, device=values.device)).tolist()


@torch.no_grad()
def sqrt_v_quantiles(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str], step: int,
                     ranks: Ranks | None = None) -> list[dict]:
    """Per-tensor quantiles of sqrt(v_hat) (the measured s in the theory's c* = eps / s, gradscale.theory; from
    this rank's shard under FSDP2) and its histogram (sqrt_v_histograms, all shards: every rank must call
    this), as adam_stats.jsonl records; the histogram's empty bins are left out."""
    histograms = sqrt_v_histograms(optimizer, ranks).cpu()
    records = []
    for (p, v, bias_correction2, eps), histogram in zip(adam_states(optimizer), histograms):
        v = v.flatten()[:: max(1, v.numel() // MAX_QUANTILE_SAMPLE)].float()
        records.append(_stats_record(step, names.get(p, "?"), p.numel(), eps, (v / bias_correction2).sqrt(),
                                     histogram))
    return records


@torch.no_grad()
def gradient_records(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str]) -> list[dict]:
    """sqrt_v_quantiles' records at step 0 from the gradients alone, before the first step: Adam's first
    step has m_hat = g and v_hat = g^2 exactly, so s = |g|, and no optimizer state is needed (one process,
    no shards)."""
    records = []
    for group in adam_groups(optimizer):
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.flatten()
            chunks = ((chunk.float(), chunk.float().abs()) for chunk in g.split(HIST_CHUNK))
            histogram = _histogram_row(chunks, group["eps"], g.device).cpu()
            sample = g[:: max(1, g.numel() // MAX_QUANTILE_SAMPLE)].float().abs()
            records.append(_stats_record(0, names.get(p, "?"), p.numel(), group["eps"], sample, histogram))
    return records


def _stats_record(step: int, tensor: str, numel: int, eps: float, s_sample: torch.Tensor,
                  histogram: torch.Tensor) -> dict:
    q = quantiles(s_sample, QUANTILES)
    counts, energies = histogram
    filled = counts[1:].nonzero().flatten()
    return {"step": step, "tensor": tensor, "numel": numel, "eps": eps,
            **{f"q{round(100 * k):02d}": value for k, value in zip(QUANTILES, q)},
            "hist_zeros": int(counts[0]), "hist_zeros_energy": float(energies[0]),
            "hist_bins": filled.tolist(), "hist_count": counts[1:][filled].long().tolist(),
            "hist_energy": energies[1:][filled].tolist()}


@torch.no_grad()
def adam_state_stats(optimizer: torch.optim.Optimizer, ranks: Ranks | None = None) -> dict[str, torch.Tensor]:
    """RMS of sqrt(v_hat) over all coordinates, and the share whose sqrt(v_hat) < eps.

    Where sqrt(v_hat) < eps, eps dominates Adam's denominator and the update is no longer invariant to
    the gradient's scale (docs/design.md, physics 3-4). Returns 0-d tensors (no host sync here); empty dict
    for optimizers without Adam state. Under FSDP2 the shards' sums are added over ranks.
    """
    sum_v, below, count = [], [], 0
    for _, v, bias_correction2, eps in adam_states(optimizer):
        sum_v.append(v.sum() / bias_correction2)
        # sqrt(v / bc2) < eps  <=>  v < eps^2 * bc2  (no sqrt over the whole state)
        below.append((v < eps * eps * bias_correction2).sum())
        count += v.numel()
    if not count:
        return {}
    totals = torch.stack([torch.stack(sum_v).sum(), torch.stack(below).sum().to(sum_v[0].dtype),
                          torch.tensor(float(count), device=sum_v[0].device)])
    if ranks is not None:
        totals = ranks.sum_if_sharded(totals)
    return {SQRT_V_RMS: torch.sqrt(totals[0] / totals[2]), EPS_DOMINATED: totals[1] / totals[2]}
