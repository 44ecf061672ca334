"""What a run will hold in memory, estimated from its config before any weight is loaded, and whether the
device has it free: the risk advisor refuses up front, in one line, a run that will not fit.

The estimate (bytes) is the sum of
- weights: 4 per parameter (fp32 master weights, also under precision=bf16, which autocasts);
- gradients: 4 per trained parameter;
- optimizer state (a training run, not the gradient-only advisor): Adam's two moments, 8 per trained
  parameter, the temporaries of its foreach step (about one more copy, 4), and the loop's update
  measurement, which copies an eighth of the weights at a time;
- activations kept for the backward pass of one micro-batch, per token and layer: about 10 hidden-size and
  4 intermediate-size vectors (the attention projections, residuals, norms and SwiGLU's gate, up, product),
  the attention probabilities (heads x sequence length) where the attention is not fused, at 2 bytes per
  element in bf16 and 4 in fp32; the logits and their gradient (2 x vocabulary per token, at that element
  size) and the loss's three fp32 buffers of a block of rows (gradscale.grads.CROSS_ENTROPY_BLOCK);
- the framework itself: 0.5 GiB (on the CPU: torch, transformers, the interpreter; on CUDA: its context).
docs/analysis.md compares it with the peak memory measured on the tiny model and SmolLM2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gradscale.checks import ConfigError

GIB = 2**30
FRAMEWORK_BYTES = GIB // 2
# What must be free beyond the estimate: measured peaks were 0.86-0.98 of it (docs/analysis.md), the highest in
# bf16, whose autocast keeps bf16 copies of the weights the estimate leaves out.
MARGIN = 1.1


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    framework: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activations + self.framework

    def describe(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer_state),
                 ("activations", self.activations), ("framework", self.framework)]
        return f"{gib(self.total)} GiB (" + ", ".join(f"{name} {gib(size)}" for name, size in parts if size) + ")"


def gib(size: int | float) -> str:
    return f"{size / GIB:.3g}" if size < 10 * GIB else f"{size / GIB:.0f}"


def architecture(model_cfg):
    """The transformers config the run will build: the checkpoint's own config.json for model.path (it wins
    over the preset's dimensions, as in the run), else the preset's dimensions."""
    if model_cfg.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    from gradscale.model import llama_config

    return llama_config(model_cfg)


def parameter_counts(cfg, arch=None) -> tuple[int, int]:
    """(all parameters, trained parameters) of the run's model and fine-tune, counted on the meta device:
    nothing is allocated or loaded. arch: architecture(cfg.model), when the caller has it."""
    import torch
    from transformers import AutoModelForCausalLM

    from gradscale.model import apply_finetune

    with torch.device("meta"):
        net = apply_finetune(AutoModelForCausalLM.from_config(arch or architecture(cfg.model)), cfg.finetune)
    unique = {id(p): p for p in net.parameters()}.values()  # tied embedding and output counted once
    return sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)


def estimate(cfg, device_type: str, optimizer_state: bool, sequences_per_forward: int) -> MemoryEstimate:
    """cfg: the run's Config. sequences_per_forward: the sequences of one micro-batch on this process."""
    from gradscale.grads import CROSS_ENTROPY_BLOCK
    arch = architecture(cfg.model)
    total, trained = parameter_counts(cfg, arch)
    hidden, layers = arch.hidden_size, arch.num_hidden_layers
    element = 2 if cfg.precision == "bf16" else 4
    tokens = sequences_per_forward * cfg.seq_len
    attention = arch.num_attention_heads * cfg.seq_len if device_type == "cpu" else 0  # CUDA: fused (SDPA)
    per_token_layer = (10 * hidden + 4 * arch.intermediate_size + attention) * element
    loss_block = max(arch.vocab_size, min(tokens * arch.vocab_size, CROSS_ENTROPY_BLOCK))  # whole rows
    logits = 2 * tokens * arch.vocab_size * element + 3 * loss_block * 4
    activations = tokens * layers * per_token_layer + logits
    state = 12 * trained + 4 * trained // 8 if optimizer_state else 0
    return MemoryEstimate(4 * total, 4 * trained, state, activations, FRAMEWORK_BYTES)


def run_estimate(cfg, device_type: str, processes: int) -> MemoryEstimate:
    """A training run's (gradscale-run): Adam-sized optimizer state whatever the optimizer (SGD and Lion hold
    less), and one micro-batch of the whole batch when the ranks are emulated in this process, or of this
    rank's share among `processes` torchrun ranks."""
    return estimate(cfg, device_type, optimizer_state=True,
                    sequences_per_forward=max(1, cfg.batch_size // cfg.grad_accum // processes))


def _proc_kib(path: str, field: str) -> int | None:
    """A `field:  N kB` line of a /proc file, in bytes; None where there is none (not Linux)."""
    file = Path(path)
    if file.is_file():
        for line in file.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere): what it holds already counts as room for what it
    will hold (gradscale.cache.keep_freed_memory keeps an earlier job's freed memory in the process)."""
    return _proc_kib("/proc/self/status", "VmRSS") or 0


def free_memory(device_type: str) -> tuple[int, str]:
    """(bytes this process may hold, what that is): CUDA's free memory on the current device, else the
    memory Linux says is available (MemAvailable) or the free physical pages, plus what this process holds."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free, f"{torch.cuda.get_device_name()} has {gib(free)} GiB free"
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is None:
        import os

        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    held = resident_bytes()
    return available + held, f"this machine has {gib(available)} GiB available (this process holds {gib(held)})"


def check_fits(needed: MemoryEstimate, device_type: str, what: str, advice: str, copies: int = 1) -> str:
    """One-line ConfigError when `copies` of the estimate (processes that start together, each holding as
    much), times MARGIN, exceed what the device has free; else what is free, in words."""
    free, said = free_memory(device_type)
    if copies * needed.total * MARGIN > free:
        size = (needed.describe() if copies == 1 else
                f"{gib(copies * needed.total)} GiB, {copies} processes side by side of {needed.describe()} each,")
        raise ConfigError(f"error: {what} needs about {size} on {device_type}, and {MARGIN:g} times that free; "
                          f"{said}: {advice}")
    return said
