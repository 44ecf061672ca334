"""One way to build a job: the entry point, the benchmark, the parity oracle, pretraining and the tests use it.

Each component builds from its own config section (the data from `data`, the model from `model` and
`finetune`, the optimizer from `optimizer`, the ranks from `dist`); the top level holds what the gradient
pipeline and the loop need.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from gradscale import data, kernels, model, parallel, weights
from gradscale.config import Config
from gradscale.data import Batches
from gradscale.frequency import TokenBuckets
from gradscale.grads import GradPipeline
from gradscale.optimizers import build_optimizer
from gradscale.parallel import Ranks
from gradscale.train import Job

log = logging.getLogger(__name__)


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


LOOK_UP = "look up"  # build_job's source when the caller resolved none: weights.checkpoint_dir, which never builds


def build_job(cfg: Config, world_size: int | None = None, batches: Batches | None = None,
              source: str | None = LOOK_UP) -> Job:
    """world_size: the ranks to train on (default cfg.world_size; under torchrun the environment's).
    batches: built already (build_batches), when several jobs share one data build. source: the checkpoint
    directory as gradscale.pretrain.prepare_weights resolved it where the run started (None: random init);
    left out, it is looked up, and must be ready."""
    device = parallel.device_for(cfg.device)
    if device.type == "cuda":  # a sweep's jobs share the process: each reports its own peak
        torch.cuda.reset_peak_memory_stats(device)
    ranks = parallel.setup(cfg.dist.strategy, world_size or cfg.world_size, cfg.dist.timeout_s, device)
    if source == LOOK_UP:
        source = weights.checkpoint_dir(cfg.model)
    batches = batches or build_batches(cfg, source)
    net = build_model(cfg, device, ranks, source)
    return assemble_job(net, cfg.optimizer, batches, build_pipeline(cfg, ranks.world_size), ranks, device,
                        cfg.precision, bf16_matmul=cfg.bf16_matmul)


def assemble_job(net: torch.nn.Module, optimizer_cfg, batches: Batches, pipeline: GradPipeline, ranks: Ranks,
                 device: torch.device, precision: str, buckets: bool = True, bf16_matmul: str = "auto") -> Job:
    """The job around a built model: its optimizer (gradscale/optimizers/), the autocast of its precision and its
    matmul kernels (gradscale/kernels.py), the token buckets (held-out loss by token frequency; buckets=False:
    none). Pretraining assembles its own."""
    optimizer = build_optimizer(optimizer_cfg, [(n, p) for n, p in net.named_parameters() if p.requires_grad])
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    return Job(net, optimizer, batches, pipeline, ranks, device, autocast,
               build_buckets(net, batches, ranks, device) if buckets else None,
               kernels.resolve(bf16_matmul, precision, device))


def build_buckets(net: torch.nn.Module, batches: Batches, ranks: Ranks, device: torch.device) -> TokenBuckets:
    """Token buckets by the training split's target counts; the output rows are measured where they are one
    whole, trained tensor on this rank (not FSDP2's shards, not a frozen LoRA base). An eval step then holds
    one copy of the output matrix (vocabulary x hidden, fp32) through its optimizer step."""
    while isinstance(net, torch.nn.parallel.DistributedDataParallel) or hasattr(net, "_orig_mod"):
        net = net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net._orig_mod  # compile
    output = net.get_output_embeddings()
    weight = output.weight if output.weight.requires_grad and not ranks.sharded else None
    return TokenBuckets.of(batches.train.targets, output.weight.shape[0], weight, device)
