"""The bug zoo: steps with the gradient-scaling bugs that shipped in public frameworks, each beside its fix.

Each entry is a plain data-parallel step (DistributedDataParallel on gloo, or an explicit all-reduce where the
engine's own reduction is the bug), or for pipeline parallelism torch.distributed.pipelining stages on the ranks,
with the one line the incident got wrong. The audit must flag every bug
with the multiplier or residual its mechanism predicts (`expected_c`, where the mechanism is a multiplier) and
pass every fix: the audit's own mutation self-test (tests/test_audit.py). docs/audit.md has the table.

Mean-based entries guard an empty micro-batch with max(count, 1), as most loops do; unguarded, a mean over zero
trained tokens is NaN, which the audit reports as such.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradscale.audit.contract import IGNORE_INDEX, AuditError, World, trained_tokens

PARALLEL_DEGREE = 2  # the tensor- / context-parallel size the over-counting and context-parallel entries assume
STEPS_PER_GENERATION = 2  # TRL GRPO's steps_per_generation in its entry: the bug shows where K differs from it


# ---------------------------------------------------------------------------------------------
# The pieces every step shares


def token_loss_sum(model, micro_batch) -> torch.Tensor:
    """Summed cross-entropy over the micro-batch's trained tokens (transformers' shift: position t predicts
    labels[t + 1])."""
    return _logits_token_sum(model(input_ids=micro_batch["input_ids"]).logits, micro_batch["labels"])


def _logits_token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def sum_over_ranks(value: float) -> float:
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()


def grad_norm(model) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def accumulate(net: DistributedDataParallel, micro_batches, loss_of: Callable[[int, dict], torch.Tensor]) -> None:
    """Backward of loss_of(k, micro-batch) for each micro-batch; DDP reduces (averages over ranks) after the
    last one only."""
    for k, mb in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with contextlib.nullcontext() if last else net.no_sync():
            loss_of(k, mb).backward()


def global_tokens(micro_batches) -> float:
    return sum_over_ranks(sum(trained_tokens(mb["labels"]) for mb in micro_batches))


# ---------------------------------------------------------------------------------------------
# Fixes


def global_token_mean(model, micro_batches, world: World) -> float:
    """The fix: every micro-batch's summed token loss over the global trained-token count, times N because
    DDP averages over ranks (torchtune's scale_grads(world_size / num_tokens), torchtitan PR 2323)."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size / tokens)
    return grad_norm(model)


def shard_norms_summed(model, micro_batches, world: World) -> float:
    """The fix for logging a shard's norm (torchtune PR 2248): each rank's squared shard norm, summed over
    ranks."""
    global_token_mean(model, micro_batches, world)
    return sum_over_ranks(sum(_shard(p.grad, world).pow(2).sum().item() for p in model.parameters())) ** 0.5


def expert_grads_divided(model, micro_batches, world: World) -> float:
    """An explicit reduction: SUM over ranks, then divide every gradient by N (the expert ones included)."""
    _summed_over_ranks_then_divided(model, micro_batches, world, divide_experts=True)
    return grad_norm(model)


def engine_divides_by_accumulation(model, micro_batches, world: World) -> float:
    """An engine that scales each micro-batch's loss by 1/K (DeepSpeed's scale_wrt_gas): the loss it is
    given is the micro-batch's share as if it were the whole step."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches,
               lambda k, mb: token_loss_sum(net, mb) * world.size * world.accumulation / tokens / world.accumulation)
    return grad_norm(model)


# ---------------------------------------------------------------------------------------------
# Bugs


def ddp_mean_then_global_tokens(model, micro_batches, world: World) -> float:
    """DDP averages over ranks, and the loss is already divided by the global count: 1/N."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) / tokens)  # the bug: no * world.size
    return grad_norm(model)


def local_shard_norm(model, micro_batches, world: World) -> float:
    """The gradient is right; the logged norm is this rank's shard's (FSDP's flat 1/N slice of each tensor)."""
    global_token_mean(model, micro_batches, world)
    return sum(_shard(p.grad, world).pow(2).sum().item() for p in model.parameters()) ** 0.5  # the bug: no sum


def per_microbatch_mean(model, micro_batches, world: World) -> float:
    """Each micro-batch's own token mean, averaged over micro-batches (and by DDP over ranks)."""
    net = DistributedDataParallel(model)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) / max(trained_tokens(mb["labels"]), 1)
               / len(micro_batches))
    return grad_norm(model)


def per_rank_mean(model, micro_batches, world: World) -> float:
    """Tokens counted over the rank's own micro-batches, the ranks' means averaged by DDP."""
    net = DistributedDataParallel(model)
    local = max(sum(trained_tokens(mb["labels"]) for mb in micro_batches), 1)  # the bug: not summed over ranks
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) / local)
    return grad_norm(model)


def parallel_degree_overcount(model, micro_batches, world: World) -> float:
    """The loss scaled as if the model-parallel ranks that share a batch were data-parallel ones: times the
    tensor- or context-parallel size."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size * PARALLEL_DEGREE / tokens)
    return grad_norm(model)


def expert_grads_summed(model, micro_batches, world: World) -> float:
    """SUM over ranks, then divide by N, except the expert (here: MLP) gradients: too large by N."""
    _summed_over_ranks_then_divided(model, micro_batches, world, divide_experts=False)
    return grad_norm(model)


def summed_accumulation(model, micro_batches, world: World) -> float:
    """The engine's 1/K is skipped (pipeline parallel with accumulation): micro-batch gradients summed, K x."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size * world.accumulation / tokens)
    return grad_norm(model)


def unshifted_token_count(model, micro_batches, world: World) -> float:
    """The global count taken on unshifted labels (labels != -100): a label at position 0, which no position
    predicts, is counted too."""
    net = DistributedDataParallel(model)
    tokens = sum_over_ranks(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches))  # the bug
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size / tokens)
    return grad_norm(model)


def steps_per_generation_factor(model, micro_batches, world: World) -> float:
    """TRL GRPO's DAPO loss before PR 6024: the global token mean, then scaled by gradient_accumulation_steps /
    steps_per_generation, a factor that is 1 only where the two agree."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)
    accumulate(net, micro_batches, lambda k, mb: token_loss_sum(net, mb) * world.size / tokens
               * world.accumulation / STEPS_PER_GENERATION)  # the bug: the factor
    return grad_norm(model)


def context_shards_own_count(model, micro_batches, world: World) -> float:
    """Context parallelism as Megatron-LM before PR 7513 scaled it: each of PARALLEL_DEGREE context shards (here
    contiguous slices of the positions, within each micro-batch) divides its token sum by its own trained count,
    and the shards' results are averaged; right only where the shards train equally many tokens (one trained
    token per sequence: half the gradient at degree 2). Emulated inside each data-parallel rank."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)

    def loss_of(k, mb):
        shifted = mb["labels"][:, 1:]
        logits = net(input_ids=mb["input_ids"]).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                                               reduction="none").view_as(shifted)
        count = int((shifted != IGNORE_INDEX).sum())
        shares = []
        for positions in torch.arange(shifted.shape[1]).tensor_split(PARALLEL_DEGREE):
            shard_count = int((shifted[:, positions] != IGNORE_INDEX).sum())
            # the bug: / shard_count (then averaged over the shards) where the fix divides the sum by count
            shares.append(ce[:, positions].sum() / max(shard_count, 1) * count / PARALLEL_DEGREE)
        return sum(shares) * world.size / tokens
    accumulate(net, micro_batches, loss_of)
    return grad_norm(model)


def data_and_accumulation_overcount(model, micro_batches, world: World) -> float:
    """Gradients summed over ranks and micro-batches, and the loss scaled by N x K as if both averaged (NeMo
    Automodel PRs 3359, 3830): x N K."""
    tokens = global_tokens(micro_batches)
    for mb in micro_batches:
        (token_loss_sum(model, mb) * world.size * world.accumulation / tokens).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # the bug: SUM over ranks where the N above assumed an average
    return grad_norm(model)


def seq_mean_global(model, micro_batches, world: World) -> float:
    """The fix for a sequence-level mean (GRPO's seq-mean-token-mean): each sequence's token mean, summed, over
    the global count of sequences that train a token, times N for DDP's average."""
    net = DistributedDataParallel(model)
    sequences = sum_over_ranks(sum(_trained_sequences(mb) for mb in micro_batches))
    accumulate(net, micro_batches, lambda k, mb: _sequence_means(net, mb).sum() * world.size / sequences)
    return grad_norm(model)


def seq_mean_per_rank(model, micro_batches, world: World) -> float:
    """A sequence-level mean over the rank's own sequences, the ranks' means averaged by DDP (prime-rl issue
    2358 / PR 2562: per-rank counts)."""
    net = DistributedDataParallel(model)
    local = max(sum(_trained_sequences(mb) for mb in micro_batches), 1)  # the bug: not summed over ranks
    accumulate(net, micro_batches, lambda k, mb: _sequence_means(net, mb).sum() / local)
    return grad_norm(model)


def _trained_sequences(mb) -> int:
    return int(((mb["labels"][:, 1:] != IGNORE_INDEX).sum(1) > 0).sum())


def _sequence_means(model, mb) -> torch.Tensor:
    """Each sequence's mean cross-entropy over its trained tokens (0 for a sequence with none)."""
    shifted = mb["labels"][:, 1:]
    logits = model(input_ids=mb["input_ids"]).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX,
                                           reduction="none").view_as(shifted)
    return ce.sum(1) / (shifted != IGNORE_INDEX).sum(1).clamp(min=1)


def _shard(grad: torch.Tensor, world: World) -> torch.Tensor:
    return grad.flatten().tensor_split(world.size)[world.rank]  # N parts, some empty when a tensor is small


def _summed_over_ranks_then_divided(model, micro_batches, world: World, divide_experts: bool) -> None:
    tokens = global_tokens(micro_batches)
    for mb in micro_batches:
        (token_loss_sum(model, mb) * world.size / tokens).backward()
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        if divide_experts or "mlp" not in name:
            p.grad /= world.size


# ---------------------------------------------------------------------------------------------
# An auxiliary loss beside the cross-entropy (an MoE router's): right where its weight does not depend on the
# layout. Checked with --reference layout, as the sum is no declared objective.

AUX_COEFFICIENT = 1e-2  # the auxiliary loss's weight (Megatron's moe_z_loss_coeff is of this order)


def _with_auxiliary_loss(model, micro_batches, world: World, aux_divisor: int) -> float:
    """The global token mean of the cross-entropy plus AUX_COEFFICIENT x a z-loss, the mean over every position
    (trained or not, as a router's loss covers every routed token) of logsumexp(logits)^2; each micro-batch's
    z-loss over K, averaged over ranks by DDP: the global mean, since every micro-batch holds as many positions.
    aux_divisor: what the auxiliary term is divided by besides (1 where right)."""
    net = DistributedDataParallel(model)
    tokens = global_tokens(micro_batches)

    def loss_of(k, mb):
        logits = net(input_ids=mb["input_ids"]).logits
        return (_logits_token_sum(logits, mb["labels"]) * world.size / tokens
                + AUX_COEFFICIENT * logits.float().logsumexp(-1).pow(2).mean() / world.accumulation / aux_divisor)

    accumulate(net, micro_batches, loss_of)
    return grad_norm(model)


def moe_aux_loss_averaged(model, micro_batches, world: World) -> float:
    """The fix: each micro-batch's auxiliary loss over K, DDP's average over ranks doing the rest."""
    return _with_auxiliary_loss(model, micro_batches, world, 1)


def moe_aux_loss_over_dp(model, micro_batches, world: World) -> float:
    """The auxiliary loss divided by the data-parallel size as well (Megatron-LM PR 3769), though DDP averages over
    the ranks already: its weight is 1/N of the cross-entropy's."""
    return _with_auxiliary_loss(model, micro_batches, world, world.size)


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: torch.distributed.pipelining stages, one per rank (no data parallelism: N is the
# pipeline's degree). Every rank gathers the global batch; accumulation step k runs the schedule over every rank's
# micro-batch k, in PIPELINE_MICROBATCHES pipeline micro-batches; then each parameter's gradient, held by the
# rank whose stage owns it, is summed onto every rank (a tied embedding's two stages add up), as the contract asks.

PIPELINE_MICROBATCHES = 2  # the schedule's n_microbatches per accumulation step


class _PipelineStage(torch.nn.Module):
    """Some consecutive blocks of a Llama-style model (its embedding, decoder layers, final norm with the output
    head), running as the model's own forward does (its causal mask and rotary embeddings)."""

    def __init__(self, model, blocks: list):
        super().__init__()
        inner = model.model
        self.config = model.config
        self.embed = inner.embed_tokens if "embed" in blocks else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in blocks if isinstance(i, int))
        self.norm, self.lm_head = (inner.norm, model.lm_head) if "head" in blocks else (None, None)
        self.rotary = inner.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed(x) if self.embed is not None else x
        if len(self.layers):
            positions = torch.arange(h.shape[1], device=h.device)[None]
            rope = self.rotary(h, position_ids=positions)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                      position_ids=positions)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def _stage_of(model, world: World) -> _PipelineStage:
    """The rank's stage: the model's blocks cut into N consecutive runs of about equal length."""
    if not all(hasattr(model, a) for a in ("model", "lm_head")) or not hasattr(model.model, "embed_tokens"):
        raise AuditError("error: the pipeline entries cut a Llama-style model (model.embed_tokens, model.layers, "
                         f"model.norm, lm_head) into stages; {type(model).__name__} is not one")
    blocks = ["embed", *range(len(model.model.layers)), "head"]
    if world.size > len(blocks):
        raise AuditError(f"error: the model has {len(blocks)} pipeline blocks, too few for {world.size} stages")
    bounds = [round(i * len(blocks) / world.size) for i in range(world.size + 1)]
    return _PipelineStage(model, blocks[bounds[world.rank]:bounds[world.rank + 1]])


def _pipeline_step(model, micro_batches, world: World, scale_grads: bool,
                   loss_of: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]) -> float:
    """loss_of(logits, labels, global trained tokens, pipeline micro-batches) is the schedule's loss_fn."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    shares = [None] * world.size
    dist.all_gather_object(shares, [(mb["input_ids"], mb["labels"]) for mb in micro_batches])
    tokens = sum(trained_tokens(labels) for share in shares for _, labels in share)
    stage = PipelineStage(_stage_of(model, world), world.rank, world.size, torch.device("cpu"))
    first, last = world.rank == 0, world.rank == world.size - 1
    for k in range(world.accumulation):
        input_ids = torch.cat([share[k][0] for share in shares])
        labels = torch.cat([share[k][1] for share in shares])
        m = min(PIPELINE_MICROBATCHES, len(input_ids))
        schedule = ScheduleGPipe(stage, m, loss_fn=lambda logits, target, m=m: loss_of(logits, target, tokens, m),
                                 scale_grads=scale_grads)
        schedule.step(*([input_ids] if first else []), target=labels if last else None)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    return grad_norm(model)


def pipeline_global_token_mean(model, micro_batches, world: World) -> float:
    """The fix (torchtitan PR 1732): the schedule leaves the gradients alone (scale_grads=False) and the loss
    carries the whole factor, each pipeline micro-batch's token sum over the global trained-token count."""
    return _pipeline_step(model, micro_batches, world, False,
                          lambda lg, t, tokens, m: _logits_token_sum(lg, t) / tokens)


def pipeline_scale_grads_accumulation(model, micro_batches, world: World) -> float:
    """torchtitan before PR 1732 (issue 1733): the schedule's scale_grads=True divides all of the stage's
    gradients by n_microbatches after each step, the ones accumulated from earlier steps too: exact at K = 1
    (the loss is scaled up to match), a moving average over the steps at K > 1 (step k of K weighs m^-(K-1-k))."""
    return _pipeline_step(model, micro_batches, world, True,
                          lambda lg, t, tokens, m: _logits_token_sum(lg, t) * m / tokens)


def pipeline_token_sum(model, micro_batches, world: World) -> float:
    """The schedule's loss function returns the token sum where the step divides by the global count (torchtitan
    issue 2972): gradients x the global trained-token count."""
    return _pipeline_step(model, micro_batches, world, False, lambda lg, t, tokens, m: _logits_token_sum(lg, t))


# ---------------------------------------------------------------------------------------------
# The zoo


@dataclass(frozen=True)
class Entry:
    name: str  # the buggy step, a function of this module
    fixed: str  # its fixed counterpart, a function of this module
    incidents: str  # where it shipped
    summary: str
    # the multiplier the audit must find, as a function of (N, K, the global trained tokens); None: no multiplier
    expected_c: Callable[[int, int, int], float] | None = None
    # the groups whose multiplier differs from the rest's: group -> c(N, K)
    expected_group_c: dict[str, Callable[[int, int], float]] | None = None
    # where the bug shows at all: (N, K) -> bool
    shows: Callable[[int, int], bool] = lambda n, k: True
    objective: str = "token-mean"  # what the fix computes (gradscale-audit --objective)
    reference: str = "objective"  # layout: the fix computes no declared objective (gradscale-audit --reference)


ZOO = (
    Entry("ddp_mean_then_global_tokens", "global_token_mean",
          "torchtune PR 2172; torchtitan issue 2318 (PR 2323); AReaL PR 1273 (N x too small)",
          "DDP averages over ranks and the loss is divided by the global token count: gradients 1/N",
          expected_c=lambda n, k, t: 1 / n, shows=lambda n, k: n > 1),
    Entry("local_shard_norm", "shard_norms_summed",
          "torchtune issue 2240 (PR 2248); LLaMA-Factory PR 10640",
          "the logged grad norm is one rank's shard's, not the whole gradient's",
          expected_c=lambda n, k, t: 1.0, shows=lambda n, k: n > 1),
    Entry("per_microbatch_mean", "global_token_mean",
          "transformers PR 34191; TRL issue 2175; open-instruct issue 1728 (mean of micro-batch means)",
          "each micro-batch's own token mean, averaged: tokens of sparse micro-batches weigh more",
          shows=lambda n, k: n * k > 1),
    Entry("per_rank_mean", "global_token_mean",
          "transformers PR 39395 (average_tokens_across_devices off); TRL PR 3538",
          "each rank's own token mean, averaged over ranks: tokens of sparse ranks weigh more",
          shows=lambda n, k: n > 1),
    Entry("parallel_degree_overcount", "global_token_mean",
          "transformers PR 45994 (loss x tp_size); Megatron-LM issue 906 (loss x cp_size)",
          f"the loss counts model-parallel ranks as data-parallel ones: gradients x{PARALLEL_DEGREE}",
          expected_c=lambda n, k, t: float(PARALLEL_DEGREE)),
    Entry("expert_grads_summed", "expert_grads_divided",
          "pytorch issue 160285; pytorch PR 167178",
          "expert gradients summed over ranks where the rest are averaged: the expert group x N",
          expected_group_c={"MLP": lambda n, k: float(n)}, shows=lambda n, k: n > 1),
    Entry("summed_accumulation", "engine_divides_by_accumulation",
          "DeepSpeed issue 7773",
          "micro-batch gradients summed where the engine should average them: gradients x K",
          expected_c=lambda n, k, t: float(k), shows=lambda n, k: k > 1),
    Entry("unshifted_token_count", "global_token_mean",
          "torchtune 0.6.1 full_finetune_distributed.py line 778 (labels != ignore_index before the shift)",
          "the count taken on unshifted labels counts position 0's label, which no position predicts",
          expected_c=lambda n, k, t: t / (t + 1)),
    Entry("steps_per_generation_factor", "global_token_mean",
          "TRL issue 5619 / PR 6024 (GRPO's dapo and cispo losses)",
          f"the loss x gradient_accumulation_steps / steps_per_generation ({STEPS_PER_GENERATION} here): x K / "
          f"{STEPS_PER_GENERATION}",
          expected_c=lambda n, k, t: k / STEPS_PER_GENERATION, shows=lambda n, k: k != STEPS_PER_GENERATION),
    Entry("context_shards_own_count", "global_token_mean",
          "Megatron-LM PR 7513 (each context-parallel shard over its own token count)",
          f"each of {PARALLEL_DEGREE} context shards divides by its own trained count and the shards average: "
          "tokens of sparse shards weigh more (emulated)"),
    Entry("moe_aux_loss_over_dp", "moe_aux_loss_averaged",
          "Megatron-LM PR 3769 (the MoE auxiliary loss 1/dp)",
          f"an auxiliary loss (a z-loss, weight {AUX_COEFFICIENT:g}) divided by the data-parallel size though DDP "
          "averages already: its weight 1/N (use --reference layout)",
          shows=lambda n, k: n > 1, reference="layout"),
    Entry("pipeline_token_sum", "pipeline_global_token_mean",
          "torchtitan issue 2972 (pipeline-parallel gradients global_valid_tokens x larger)",
          "the pipeline schedule's loss function returns the token sum: gradients x the global trained-token count",
          expected_c=lambda n, k, t: float(t)),
    Entry("pipeline_scale_grads_accumulation", "pipeline_global_token_mean",
          "torchtitan issue 1733 (PR 1732: accumulation under scale_grads=True, a moving average)",
          f"the schedule divides every gradient by its {PIPELINE_MICROBATCHES} micro-batches after each "
          "accumulation step, the earlier steps' again: later steps weigh more",
          shows=lambda n, k: k > 1),
    Entry("data_and_accumulation_overcount", "global_token_mean",
          "NeMo Automodel PRs 3359, 3830 (8x at dp 4 x accumulation 2)",
          "gradients summed over ranks and micro-batches, the loss scaled by N K as if averaged: x N K",
          expected_c=lambda n, k, t: float(n * k), shows=lambda n, k: n * k > 1),
    Entry("seq_mean_per_rank", "seq_mean_global",
          "prime-rl issue 2358 / PR 2562 (per-rank counts)",
          "a sequence-level mean over each rank's own sequences, averaged over ranks: sequences of sparse ranks "
          "weigh more", shows=lambda n, k: n > 1, objective="seq-mean-token-mean"),
)
