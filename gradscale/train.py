"""The training loop: one function, on one screen. The optimizer step is the thing under study."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from gradscale import kernels
from gradscale.checkpoint import Checkpointer, LoopState
from gradscale.data import Batches
from gradscale.grads import (
    GradPipeline,
    count_trained_tokens,
    global_token_count,
    sequence_loss_sums,
    token_losses,
    total_norm,
)
from gradscale.metrics import RunLog
from gradscale.optimizer_stats import adam_state_stats, sqrt_v_quantiles
from gradscale.parallel import Ranks, local
from gradscale.progress import Progress
from gradscale.records import (
    CLIP_COEF,
    CLIPPED,
    EVAL_LOSS,
    GRAD_NORM,
    LR,
    PARAM_NORM,
    TOKENS,
    TOKENS_PER_S,
    TRAIN_LOSS,
    UPDATE_RMS,
)

if TYPE_CHECKING:
    from gradscale.frequency import TokenBuckets

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What the training loop trains: built by gradscale.job.build_job (or
    assemble_job), or pieces of it replaced (the benchmark). The loop is handed one and never builds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: Batches
    pipeline: GradPipeline
    ranks: Ranks
    device: torch.device
    autocast: contextlib.AbstractContextManager
    buckets: TokenBuckets | None = None  # held-out loss and output-row updates by token frequency, at evals
    bf16_matmul: str | None = None  # "native" | "fp32" under bf16 autocast on the CPU (gradscale/kernels.py)


@dataclass(frozen=True)
class LoopConfig:
    """What the loop takes from the run's config: how long, and how often to log, evaluate and record."""

    steps: int
    grad_accum: int = 1
    log_every: int = 5
    eval_every: int = 50
    eval_batches: int = 4
    adam_stats_every: int | None = 50  # sqrt(v_hat) quantiles and histograms -> adam_stats.jsonl; None: off

    @classmethod
    def of(cls, cfg) -> LoopConfig:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class TrainResult:
    status: str  # completed | diverged
    steps_done: int
    final_loss: float | None
    best_eval_loss: float | None
    diverged_at_step: int | None
    tokens_per_s: float
    clipped_steps: int  # steps whose gradient clipping scaled down (all steps, not only logged ones)
    resumed_from_step: int | None  # the checkpoint's step this run went on from; None: from the start


def train(job: Job, loop: LoopConfig, run_log: RunLog | None = None,
          checkpointer: Checkpointer | None = None) -> TrainResult:
    """Train job.model for loop.steps steps; resume from the checkpointer's checkpoint when it has one."""
    model, optimizer, batches, pipeline, ranks = job.model, job.optimizer, job.batches, job.pipeline, job.ranks
    autocast, device, buckets = job.autocast, job.device, job.buckets
    resumed = checkpointer.resume(model, optimizer) if checkpointer else None
    if run_log is not None:  # drop what a killed run logged after its checkpoint (all of it, without one)
        run_log.rewind(resumed.next_step if resumed else 0)
    start = resumed or LoopState()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_coords = sum(p.numel() for p in params)  # FSDP2: numel of a DTensor is the full size
    names = {p: n for n, p in model.named_parameters()}
    final_loss, best_eval, window_start, window_tokens = start.final_loss, start.best_eval, time.perf_counter(), 0
    clipped_steps = torch.tensor(start.clipped_steps, device=device)  # summed on device: no sync per step
    tokens_per_s = 0.0

    def result(status: str, steps_done: int, diverged_at_step: int | None = None) -> TrainResult:
        return TrainResult(status=status, steps_done=steps_done, final_loss=final_loss, best_eval_loss=best_eval,
                           diverged_at_step=diverged_at_step, tokens_per_s=tokens_per_s,
                           clipped_steps=int(clipped_steps), resumed_from_step=resumed.next_step if resumed else None)

    steps = loop.steps
    with kernels.matmuls(job.bf16_matmul), Progress(steps, start.next_step, log, loop.log_every) as progress:
        for step in range(start.next_step, steps):
            progress.step_started(step)
            inputs, targets = batches.train_batch(step)  # the global batch: all ranks, all micro-batches
            loss_sum, num_tokens = accumulate_gradients(model, inputs, targets, pipeline, ranks, loop.grad_accum,
                                                        autocast, device)
            logging_step = step % loop.log_every == 0 or step == steps - 1
            eval_step = (step + 1) % loop.eval_every == 0 or step == steps - 1
            grad_norm, clip_coef = pipeline.apply(params, num_tokens, ranks, measure=logging_step)
            clipped = clip_coef < 1 if clip_coef is not None else torch.zeros((), dtype=torch.bool, device=device)
            clipped_steps += clipped
            rows_before = buckets.rows_before_step() if eval_step and buckets else None  # the update by bucket

            if logging_step:  # the same step, taken a chunk at a time to measure the exact update cheaply
                update_rms = step_measuring_update(optimizer, params, ranks) / math.sqrt(n_coords)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            window_tokens += inputs.numel()

            measured = None
            if logging_step:
                stats = {
                    TRAIN_LOSS: ranks.sum(loss_sum) / num_tokens,  # global token mean: independent of fix, scale
                    GRAD_NORM: grad_norm,
                    CLIPPED: clipped,
                    **({CLIP_COEF: clip_coef} if clip_coef is not None else {}),
                    UPDATE_RMS: update_rms,
                    PARAM_NORM: total_norm(params, ranks),
                    **adam_state_stats(optimizer, ranks),
                }
                record = dict(zip(stats, torch.stack([v.float() for v in stats.values()]).tolist()))  # one sync
                record[CLIPPED] = bool(record[CLIPPED])
                elapsed, window_start = time.perf_counter() - window_start, time.perf_counter()
                tokens_per_s = window_tokens / elapsed
                window_tokens = 0
                log_record(run_log,
                    {"step": step, **record, LR: optimizer.param_groups[0]["lr"],
                     TOKENS: num_tokens, TOKENS_PER_S: tokens_per_s}
                )
                measured = (f"loss {record[TRAIN_LOSS]:.4f} | grad_norm {record[GRAD_NORM]:.3e} | "
                            f"{tokens_per_s:.0f} tok/s")
                final_loss = record[TRAIN_LOSS]
            progress.step_done(step, measured)
            if logging_step and not (math.isfinite(record[TRAIN_LOSS]) and math.isfinite(record[GRAD_NORM])):
                log.warning("non-finite loss or grad norm at step %d: run diverged", step)
                return result("diverged", step + 1, step)

            if loop.adam_stats_every and (step % loop.adam_stats_every == 0 or step == steps - 1):
                records = sqrt_v_quantiles(optimizer, names, step, ranks)  # every rank: histograms sum the shards
                if run_log is not None:
                    run_log.log_adam_stats(records)

            if eval_step:
                progress.eval_start(step, *batches.eval_size(loop.eval_batches))
                eval_record = evaluate(model, batches, loop.eval_batches, autocast, device, buckets)
                if rows_before is not None:
                    eval_record.update(buckets.row_update_record(rows_before))
                log_record(run_log, {"step": step, **eval_record})
                eval_loss = eval_record[EVAL_LOSS]
                progress.eval_done(step, eval_loss)
                if not math.isfinite(eval_loss):  # weights gone non-finite after the last logged step
                    log.warning("non-finite eval loss at step %d: run diverged", step)
                    return result("diverged", step + 1, step)
                best_eval = eval_loss if best_eval is None or eval_loss < best_eval else best_eval

            if checkpointer and checkpointer.due(step, steps):
                state = LoopState(step + 1, final_loss, best_eval, int(clipped_steps))
                checkpointer.save(model, optimizer, state)  # every rank: gathers under torchrun
    return result("completed", steps)


UPDATE_CHUNKS = 8  # a logged step copies 1/8 of the weights at a time (or one tensor, if larger)


@torch.no_grad()
def step_measuring_update(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], ranks: Ranks) -> torch.Tensor:
    """optimizer.step(), returning ||p_after - p_before|| over all trained coordinates (all shards).

    A copy of all the weights would raise the run's peak memory by 4 bytes per parameter (issue: 1.19x a
    bare loop). Instead the step runs UPDATE_CHUNKS times, each time on one chunk of the parameters, the
    others' gradients set aside: every optimizer here skips a parameter without a gradient and treats each
    parameter on its own, elementwise, so the weights and state come out bit for bit as from one step
    (tests/test_train.py), and only one chunk's copy, and its step's temporaries, exist at a time."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    local_numel = sum(local(p).numel() for p in params)
    chunk, chunk_numel, norms = [], 0, []
    for i, p in enumerate(params):
        chunk.append(i)
        chunk_numel += local(p).numel()
        if chunk_numel * UPDATE_CHUNKS < local_numel and i < len(params) - 1:
            continue
        for j in chunk:
            params[j].grad, grads[j] = grads[j], None  # only the chunk's gradients, freed as it is stepped
        before = [local(params[j]).detach().clone() for j in chunk]
        optimizer.step()
        torch._foreach_sub_(before, [local(params[j]).detach() for j in chunk])  # the update's negative
        norms.extend(torch._foreach_norm(before))
        for j in chunk:
            params[j].grad = None
        chunk, chunk_numel = [], 0
    square_sum = torch.stack(norms).square().sum()  # as grads.total_norm sums: the same bits
    return ranks.sum_if_sharded(square_sum).sqrt()


def accumulate_gradients(model, inputs, targets, pipeline: GradPipeline, ranks: Ranks, grad_accum: int,
                         autocast, device) -> tuple[torch.Tensor, int]:
    """Forward/backward of this rank's share of the global batch, micro-batch by micro-batch.

    Returns this rank's summed token loss (unweighted, for logging) and the global trained-token count.
    """
    weights = pipeline.sequence_weights(targets)  # needs the global batch: per-rank counts
    inputs, targets, weights = ranks.local_block(inputs, targets, weights)
    num_tokens = global_token_count(targets, ranks)
    loss_sum = torch.zeros((), device=device)
    for micro in zip(inputs.chunk(grad_accum), targets.chunk(grad_accum), weights.chunk(grad_accum)):
        micro_inputs, micro_targets, micro_weights = (t.to(device) for t in micro)
        with autocast:
            logits = model(input_ids=micro_inputs).logits
        sequence_losses = sequence_loss_sums(logits, micro_targets)
        (sequence_losses * micro_weights).sum().backward()  # grads accumulate over micro-batches
        loss_sum += sequence_losses.detach().sum()
    return loss_sum, num_tokens


def log_record(run_log: RunLog | None, record: dict) -> None:
    if run_log is not None:  # only rank 0 has one
        run_log.log(record)


@torch.no_grad()
def evaluate(model, batches: Batches, max_batches: int, autocast, device, buckets: TokenBuckets | None = None
             ) -> dict[str, float]:
    """Token-mean loss over the held-out split (the same sequences every time): eval/loss, and with `buckets`
    the loss of each token-frequency bucket's targets (gradscale/frequency.py)."""
    model.eval()
    loss_sum, tokens = torch.zeros((), device=device), 0
    bucket_losses = bucket_tokens = 0
    for inputs, targets in batches.eval_batches(max_batches):
        tokens += count_trained_tokens(targets)  # on the host: no device sync
        targets = targets.to(device)
        with autocast:
            logits = model(input_ids=inputs.to(device)).logits
        losses = token_losses(logits, targets)
        loss_sum += losses.sum(1).sum()  # as token_loss_sum adds: the same bits
        if buckets is not None:
            sums, counts = buckets.bucket_sums(losses, targets)
            bucket_losses, bucket_tokens = bucket_losses + sums, bucket_tokens + counts
    model.train()
    record = {EVAL_LOSS: loss_sum.item() / tokens}
    if buckets is not None:
        record.update(buckets.loss_record(bucket_losses, bucket_tokens))
    return record
