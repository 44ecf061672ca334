"""One way to build and run a job: the entry point, the benchmark, the parity oracle and the tests use it.

Each component builds from its own config section (the data from `data`, the model from `model` and
`finetune`, the optimizer from `optimizer`, the ranks from `dist`); the top level holds what the gradient
pipeline and the loop need.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from experiments import checkpoint, data, model, parallel, weights
from experiments.config import Config, check_environment, resolve_world_size, validate
from experiments.data import Batches
from experiments.frequency import TokenBuckets
from experiments.grads import GradPipeline
from experiments.optimizers import build_optimizer
from experiments.parallel import Ranks
from experiments.train import LoopConfig, train

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What the training loop trains: built by build_job, or pieces of it replaced (the benchmark)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: Batches
    pipeline: GradPipeline
    ranks: Ranks
    device: torch.device
    autocast: contextlib.AbstractContextManager
    buckets: TokenBuckets | None = None  # held-out loss and output-row updates by token frequency, at evals


def build_batches(cfg: Config, source: str | None = None) -> Batches:
    """The run's batches: its examples, tokenized by the checkpoint's tokenizer (`source`) or by a BPE
    trained on the examples themselves."""
    examples = data.load_examples(cfg.data)
    if source:
        tokenizer = model.load_tokenizer(source)
    else:
        tokenizer = data.build_tokenizer(examples, cfg.data.tokenizer_vocab_size, cfg.data.cache_dir)
    return data.build_batches(examples, cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)


def build_model(cfg: Config, device: torch.device, ranks: Ranks, source: str | None = None) -> torch.nn.Module:
    """The weights from `source` (weights.checkpoint_dir) or a seeded random init, attention in fp32 under
    bf16 on the CPU (faster there: model.attention_in_fp32), fine-tune adapters, the ranks' engine (DDP /
    FSDP2 under torchrun), torch.compile when asked."""
    net = model.build_model(cfg.model, cfg.seed, device, source)
    if cfg.precision == "bf16" and device.type == "cpu":
        model.attention_in_fp32(net)
    net = model.apply_finetune(net, cfg.finetune)
    net = parallel.wrap(net, ranks)
    return torch.compile(net) if cfg.compile else net


def build_pipeline(cfg: Config, world_size: int) -> GradPipeline:
    return GradPipeline(world_size, cfg.scale, cfg.normalization.name, cfg.clip_grad_norm, cfg.grad_accum)


def build_job(cfg: Config, world_size: int | None = None, batches: Batches | None = None) -> Job:
    """world_size: the ranks to train on (default cfg.world_size; under torchrun the environment's).
    batches: built already (build_batches), when several jobs share one data build."""
    device = parallel.device_for(cfg.device)
    if device.type == "cuda":  # a sweep's jobs share the process: each reports its own peak
        torch.cuda.reset_peak_memory_stats(device)
    ranks = parallel.setup(cfg.dist.strategy, world_size or cfg.world_size, cfg.dist.timeout_s, device)
    source = weights.checkpoint_dir(cfg.model)  # fetched, converted or pretrained first when not cached
    batches = batches or build_batches(cfg, source)
    net = build_model(cfg, device, ranks, source)
    optimizer = build_optimizer(cfg.optimizer, [(n, p) for n, p in net.named_parameters() if p.requires_grad])
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    return Job(net, optimizer, batches, build_pipeline(cfg, ranks.world_size), ranks, device, autocast,
               build_buckets(net, batches, ranks, device))


def build_buckets(net: torch.nn.Module, batches: Batches, ranks: Ranks, device: torch.device) -> TokenBuckets:
    """Token buckets by the training split's target counts; the output rows are measured where they are one
    whole, trained tensor on this rank (not FSDP2's shards, not a frozen LoRA base). An eval step then holds
    one copy of the output matrix (vocabulary x hidden, fp32) through its optimizer step."""
    while isinstance(net, torch.nn.parallel.DistributedDataParallel) or hasattr(net, "_orig_mod"):
        net = net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net._orig_mod  # compile
    output = net.get_output_embeddings()
    weight = output.weight if output.weight.requires_grad and not ranks.sharded else None
    return TokenBuckets.of(batches.train.targets, output.weight.shape[0], weight, device)


def run_job(cfg: Config, run_log, overrides: list[str] = (), run_dir: Path | None = None) -> dict[str, Any]:
    """Check the config, build the job, train it, and return the summary fields.

    overrides: the job's command-line overrides (an explicit world_size must agree with torchrun's).
    run_dir: where checkpoints go (every cfg.checkpoint_every steps); a checkpoint there is resumed from."""
    validate(cfg, list(overrides))
    check_environment(cfg)
    job = build_job(cfg, resolve_world_size(cfg.world_size, list(overrides)))
    ranks, pipeline = job.ranks, job.pipeline
    log.info("%s (%s) lr=%g scale=%g normalization=%s world_size=%d (%s) -> c_eff=%g on %s",
             cfg.optimizer.name, cfg.finetune.name, cfg.optimizer.lr, cfg.scale, pipeline.recipe,
             ranks.world_size, f"{cfg.dist.strategy} ranks" if ranks.real else "emulated", pipeline.c_eff,
             job.device)
    checkpointer = (checkpoint.Checkpointer(run_dir, cfg.checkpoint_every, ranks)
                    if run_dir is not None and cfg.checkpoint_every else None)
    result = train(job, LoopConfig.of(cfg), run_log, checkpointer)
    if checkpointer is not None:
        checkpointer.remove()
    return {**vars(result), "c_eff": pipeline.c_eff, "device": str(job.device),
            "world_size": ranks.world_size, "ranks": f"{cfg.dist.strategy}" if ranks.real else "emulated",
            "normalization": pipeline.recipe,
            "peak_cuda_memory_gib": (torch.cuda.max_memory_allocated(job.device) / 2**30
                                     if job.device.type == "cuda" else None)}
