"""What a step's gradient is compared with: the objectives a step may declare (how its cross-entropy is aggregated
over the global batch), the suspects a failing row is fitted against (the reductions that shipped as bugs), and
their one-process float64 gradients.

Every objective and every suspect is a weighting of the same per-token losses: loss = sum over trained tokens of
w[s, t] * ce[s, t] (t over the shifted positions: position t predicts labels[t + 1]). So one float64 forward gives
them all, each by its own backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradscale.audit.contract import IGNORE_INDEX, AuditError

Layout = list[list[list[int]]]  # sequence indices per rank per micro-batch (gradscale.audit.batch.layout)


def trained_mask(labels: torch.Tensor) -> torch.Tensor:
    """[sequences, SEQ_LEN - 1], float64: 1 where position t's prediction of labels[t + 1] is trained."""
    return (labels[:, 1:] != IGNORE_INDEX).double()


def _seq_mean(mask: torch.Tensor, sequences: list[int] | None = None) -> torch.Tensor:
    """Each sequence's token mean, averaged over the sequences (of `sequences`, default all) that train at least
    one token; zero elsewhere."""
    keep = torch.zeros(len(mask), dtype=torch.bool)
    keep[sequences if sequences is not None else slice(None)] = True
    per_seq = mask.sum(1)
    keep &= per_seq > 0
    w = torch.zeros_like(mask)
    if keep.any():
        w[keep] = mask[keep] / per_seq[keep, None] / int(keep.sum())
    return w


# ---------------------------------------------------------------------------------------------------------------
# The objectives a step declares (--objective): layout-independent weightings of the global batch


@dataclass(frozen=True)
class Objective:
    name: str
    description: str
    weights: Callable[[torch.Tensor], torch.Tensor]  # trained mask -> w


def _token_mean(mask: torch.Tensor) -> torch.Tensor:
    return mask / mask.sum()


def _seq_mean_token_sum(mask: torch.Tensor) -> torch.Tensor:
    return mask / int((mask.sum(1) > 0).sum())


OBJECTIVES = {
    "token-mean": Objective("token-mean", "the global token mean of the cross-entropy (SFT; GRPO's DAPO / BNPO "
                            "token-level losses)", _token_mean),
    "seq-mean-token-mean": Objective("seq-mean-token-mean", "each sequence's token mean, averaged over the "
                                     "sequences with at least one trained token (GRPO's original loss)", _seq_mean),
    "seq-mean-token-sum": Objective("seq-mean-token-sum", "each sequence's token sum, averaged over the sequences "
                                    "with at least one trained token", _seq_mean_token_sum),
}
CONSTANT = "constant:"  # constant:D, the token sum over a divisor D that does not depend on the batch (Dr. GRPO)


def objective(spec: str) -> Objective:
    """A declared objective by name, or constant:D (AuditError, one line, if neither)."""
    if spec in OBJECTIVES:
        return OBJECTIVES[spec]
    if spec.startswith(CONSTANT):
        try:
            divisor = float(spec[len(CONSTANT):])
        except ValueError:
            divisor = float("nan")
        if divisor > 0 and divisor != float("inf"):
            return Objective(spec, f"the global token sum over the constant {divisor:g} (Dr. GRPO's divisor)",
                             lambda mask: mask / divisor)
    raise AuditError(f"error: --objective {spec}: must be one of {', '.join(OBJECTIVES)} or {CONSTANT}D with D > 0 "
                     f"(e.g. {CONSTANT}4096)")


# ---------------------------------------------------------------------------------------------------------------
# The suspects: reductions that depend on the layout, each the weighting a known bug computes (c = 1: exactly it)


@dataclass(frozen=True)
class Suspect:
    name: str
    description: str  # what the step computes, when the gradient fits it
    weights: Callable[[torch.Tensor, Layout], torch.Tensor]  # trained mask, layout -> w


def _per_micro_batch_token_means(mask: torch.Tensor, dealt: Layout) -> torch.Tensor:
    n, k = len(dealt), len(dealt[0])
    w = torch.zeros_like(mask)
    for rank in dealt:
        for mb in rank:
            w[mb] = mask[mb] / max(float(mask[mb].sum()), 1.0) / (n * k)
    return w


def _per_rank_token_means(mask: torch.Tensor, dealt: Layout) -> torch.Tensor:
    w = torch.zeros_like(mask)
    for rank in dealt:
        held = [i for mb in rank for i in mb]
        w[held] = mask[held] / max(float(mask[held].sum()), 1.0) / len(dealt)
    return w


def _last_micro_batch_only(mask: torch.Tensor, dealt: Layout) -> torch.Tensor:
    w = torch.zeros_like(mask)
    last = [i for rank in dealt for i in rank[-1]]
    w[last] = mask[last] / mask.sum()
    return w


def _per_rank_seq_means(mask: torch.Tensor, dealt: Layout) -> torch.Tensor:
    return sum(_seq_mean(mask, [i for mb in rank for i in mb]) for rank in dealt) / len(dealt)


def _per_micro_batch_seq_means(mask: torch.Tensor, dealt: Layout) -> torch.Tensor:
    n, k = len(dealt), len(dealt[0])
    return sum(_seq_mean(mask, mb) for rank in dealt for mb in rank) / (n * k)


SUSPECTS = (
    Suspect("per-rank token means", "each rank's own token mean, averaged over the ranks (a count not summed over "
            "ranks)", _per_rank_token_means),
    Suspect("per-micro-batch token means", "each micro-batch's own token mean, averaged (a count per micro-batch)",
            _per_micro_batch_token_means),
    Suspect("the last micro-batch only", "only each rank's last micro-batch (gradients zeroed between "
            "micro-batches?)", _last_micro_batch_only),
    Suspect("per-rank sequence means", "each rank's own mean over its sequences, averaged over the ranks (a "
            "sequence count not summed over ranks)", _per_rank_seq_means),
    Suspect("per-micro-batch sequence means", "each micro-batch's own mean over its sequences, averaged",
            _per_micro_batch_seq_means),
)


def slot_weights(mask: torch.Tensor, sequences: list[int]) -> torch.Tensor:
    """One micro-batch's token sum over the global count: the token mean's share of it (weight 1)."""
    w = torch.zeros_like(mask)
    w[sequences] = mask[sequences] / mask.sum()
    return w


def weighted_gradients(model, input_ids: torch.Tensor, labels: torch.Tensor,
                       weightings: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """One process, the whole global batch, float64: the gradient of sum(w * ce) for each weighting w
    ([sequences, SEQ_LEN - 1]). Every weighting here scales each sequence's trained tokens alike (w = a_s on the
    trained tokens of sequence s), so each is sum_s a_s G_s over the per-sequence token-sum gradients G_s, taken
    once (batched where it fits in memory). The model is left in fp32."""
    mask = trained_mask(labels)
    trained = [s for s in range(len(mask)) if mask[s].any()]
    per_token = mask[trained].sum(1)
    shares = {}
    for key, w in weightings.items():
        a = (w[trained] * mask[trained]).sum(1) / per_token
        if not torch.allclose(w, torch.zeros_like(w).index_put_((torch.tensor(trained),), mask[trained] * a[:, None]),
                              rtol=1e-12, atol=1e-15):
            raise ValueError(f"weighting {key!r} is not a per-sequence scaling of the trained tokens")
        shares[key] = a
    model = model.double()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    targets = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                           reduction="none").view_as(targets)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    one_each = torch.zeros((len(trained), *mask.shape), dtype=mask.dtype)
    for i, s in enumerate(trained):
        one_each[i, s] = mask[s]
    size = sum(p.numel() for p in params) * len(trained) * 8
    if size <= 2 * 2 ** 30:  # all the sequences' gradients at once (vmap over the backward)
        per_seq = torch.autograd.grad(ce, params, grad_outputs=one_each, is_grads_batched=True, allow_unused=True)
        per_seq = [torch.zeros((len(trained), *p.shape), dtype=p.dtype) if g is None else g
                   for p, g in zip(params, per_seq, strict=True)]
        out = {key: {n: torch.tensordot(a, g, dims=1) for n, g in zip(names, per_seq, strict=True)}
               for key, a in shares.items()}
    else:  # a large model: one backward per weighting
        out = {}
        for i, (key, w) in enumerate(weightings.items()):
            grads = torch.autograd.grad((ce * w).sum(), params, retain_graph=i < len(weightings) - 1,
                                        allow_unused=True)
            out[key] = {n: torch.zeros_like(p) if g is None else g.detach().clone()
                        for n, p, g in zip(names, params, grads, strict=True)}
    model.float()
    return out
