"""What a rank holds against the one-process float64 reference: the multiplier c, per tensor group, the residual, the
logged norm (Result), and what a uniform c means for SGD, AdamW and a clipping threshold."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradscale.audit.contract import IGNORE_INDEX

TOLERANCE = 1e-4  # fp32 steps against a float64 reference, summed in another order: about 1e-6 off


@dataclass
class Result:
    world_size: int
    accumulation: int
    tokens: list[list[int]]  # trained tokens per rank, per micro-batch
    sequences: int = 0  # in the global batch
    c: float = math.nan  # <g, g_ref> / <g_ref, g_ref>
    group_c: dict[str, float] = field(default_factory=dict)
    residual: float = math.nan  # ||g - c g_ref|| / ||c g_ref||
    norm: float = math.nan  # ||g||, the gradient the optimizer receives
    reference_norm: float = math.nan
    logged_norm: float | None = None
    replica_spread: float = 0.0  # max over ranks of ||g_r - g_0|| / ||g_0||
    ok: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def logged_over_true(self) -> float | None:
        return None if self.logged_norm is None or not self.norm else self.logged_norm / self.norm


def reference_gradient(model, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, float64: the gradient of the global token-mean loss."""
    model = model.double()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                      ignore_index=IGNORE_INDEX).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.float()
    return grads


def compare(result: Result, grads: list[dict[str, torch.Tensor]], logged: list[float | None],
            reference: dict[str, torch.Tensor], tolerance: float) -> Result:
    """Fill result's numbers and verdict from every rank's gradient and logged norm."""
    from gradscale.theory import tensor_group

    def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g[n].double().flatten() for n in reference])

    for g in grads:
        if set(g) != set(reference):
            changed = sorted(set(g) ^ set(reference))[:3]
            result.reasons.append(f"the step changed the model's parameters ({', '.join(changed)}, ...): the audit "
                                  "compares the gradients of the model it hands over, in place")
            return result

    ref = flat(reference)
    per_rank = [flat(g) for g in grads]
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
    result.c = (g @ ref / (ref @ ref)).item()
    result.residual = ((g - result.c * ref).norm() / (abs(result.c) * ref.norm())).item() if result.c else math.inf
    groups: dict[str, list[str]] = {}
    for name in reference:
        groups.setdefault(tensor_group(name), []).append(name)
    group_residuals = {}
    for group, names in groups.items():
        g_group = torch.cat([grads[0][n].double().flatten() for n in names])
        r_group = torch.cat([reference[n].flatten() for n in names])
        c = result.group_c[group] = (g_group @ r_group / (r_group @ r_group)).item()
        group_residuals[group] = ((g_group - c * r_group).norm() / (abs(c) * r_group.norm())).item() if c else math.inf
    result.logged_norm = logged[0]

    if result.norm == 0:
        result.reasons.append("the gradient is zero: did the step leave it in .grad?")
    if result.replica_spread > tolerance:
        result.reasons.append(f"ranks hold different gradients (spread {result.replica_spread:.2g})")
    groups_differ = any(abs(c / result.c - 1) > tolerance for c in result.group_c.values()) if result.c else False
    scaled = ", ".join(f"{g} x{c:.6g}" for g, c in sorted(result.group_c.items(), key=lambda x: -abs(x[1] - 1)))
    if groups_differ and max(group_residuals.values()) <= tolerance:  # each group scaled, by its own factor
        result.reasons.append(f"tensor groups scaled unequally: {scaled}")
    elif result.residual > tolerance:
        result.reasons.append(f"residual {result.residual:.2g}: tokens weighted unequally (per-rank or "
                              "per-micro-batch means?)")
    elif groups_differ:  # a small group off, too small to move the overall residual past the tolerance
        result.reasons.append(f"tensor groups differ: {scaled}")
    elif abs(result.c - 1) > tolerance:
        result.reasons.append(f"gradient x{result.c:.6g} the global token-mean's")
    ratio = result.logged_over_true
    if ratio is not None and abs(ratio - 1) > tolerance:
        result.reasons.append(f"logged norm x{ratio:.4g} the gradient's (one shard's norm? logged before the "
                              "reduction?)")
    result.ok = not result.reasons
    return result


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
