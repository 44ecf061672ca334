"""Optimizer factory: an explicit name -> constructor table, and the optimizer-state statistics.

Each constructor takes the optimizer's own config section and the parameters to train.
"""

from __future__ import annotations

import torch

from experiments.parallel import Ranks, local


def build_sgd(cfg, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def build_adamw(cfg, params) -> torch.optim.Optimizer:
    # foreach=True everywhere: the fused and for-loop kernels round differently, and equal
    # arithmetic on every machine is what makes AdamW(c, eps) == AdamW(1, eps/c) testable.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True
    )


OPTIMIZERS = {
    "sgd": build_sgd,
    "adamw": build_adamw,
}


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"error: optimizer.name={cfg.name!r} is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.name](cfg, params)


def adam_states(optimizer: torch.optim.Optimizer):
    """(param, local exp_avg_sq, bias correction 1 - beta2^t, eps) for every Adam-type state.

    v_hat = exp_avg_sq / (1 - beta2^t); under FSDP2 exp_avg_sq is this rank's shard."""
    for group in optimizer.param_groups:
        if "eps" not in group or "betas" not in group:
            continue
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "exp_avg_sq" in state:
                yield p, local(state["exp_avg_sq"]), 1 - group["betas"][1] ** float(state["step"]), group["eps"]


QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
MAX_QUANTILE_SAMPLE = 1 << 20  # torch.quantile's input limit is 2^24; a strided sample is plenty


@torch.no_grad()
def sqrt_v_quantiles(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str], step: int) -> list[dict]:
    """Per-tensor quantiles of sqrt(v_hat): the measured s in the theory's c* = eps / s (analysis.theory)."""
    records = []
    for p, v, bias_correction2, eps in adam_states(optimizer):
        v = v.flatten()[:: max(1, v.numel() // MAX_QUANTILE_SAMPLE)].float()
        sqrt_v = (v / bias_correction2).sqrt()
        q = torch.quantile(sqrt_v, torch.tensor(QUANTILES, device=sqrt_v.device)).tolist()
        records.append({"step": step, "tensor": names.get(p, "?"), "numel": p.numel(), "eps": eps,
                        **{f"q{round(100 * k):02d}": value for k, value in zip(QUANTILES, q)}})
    return records


@torch.no_grad()
def adam_state_stats(optimizer: torch.optim.Optimizer, ranks: Ranks | None = None) -> dict[str, torch.Tensor]:
    """RMS of sqrt(v_hat) over all coordinates, and the share whose sqrt(v_hat) < eps.

    Where sqrt(v_hat) < eps, eps dominates Adam's denominator and the update is no longer invariant to
    the gradient's scale (DESIGN.md, physics 3-4). Returns 0-d tensors (no host sync here); empty dict
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
    return {"adam/sqrt_v_rms": torch.sqrt(totals[0] / totals[2]), "adam/eps_dominated_frac": totals[1] / totals[2]}
