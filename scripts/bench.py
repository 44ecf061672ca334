"""Benchmark: the suite's training step against a bare PyTorch loop and the Hugging Face Trainer.

    python scripts/bench.py [OVERRIDES ...] [--steps 50] [--repeats 10] [--allocator N] [--sweep N]
    python scripts/bench.py [OVERRIDES ...] --memory N
    python scripts/bench.py [OVERRIDES ...] --real-model N [--steps 5] [--against GIT_REF] [--compiled]

In one process, on the same model (same init), batches and optimizer (the suite's AdamW, foreach), it
times per optimizer step:
  bare                      forward, token-mean loss, backward, optimizer.step, zero_grad; nothing else
  suite                     gradscale.train.train as a run calls it: every metric on (grad norm, update
                            RMS, parameter norm, Adam state statistics; metrics.jsonl written line by line)
                            every log_every = 5 steps, sqrt(v_hat) quantiles and a checkpoint every 50
  suite, logged every step  the same with log_every = 1
  suite, metrics off        the same loop with no metrics, statistics or checkpoints: what they cost
  hf_trainer                transformers.Trainer on the same model, batches and optimizer, logging off
The loops run interleaved, log_every steps at a time each, in their own greenlets (Interleaved), after
5 warm-up steps; the order is rotated each repeat. Ratios are taken within each repeat and their median
over repeats is reported with a 95% bootstrap interval: the machine's noise, made visible. With the
default 50 timed steps the suite logs, keeps statistics and checkpoints in the proportions of a real
run. Also the model FLOP/s of the suite (6 * parameters * tokens plus attention) against this
machine's fp32 matrix-multiply rate measured in the same run. Every loop runs with the suite's
process setting (gradscale.cache.keep_freed_memory; set GLIBC_TUNABLES to run them all without it);
--allocator N times the default run with glibc's malloc settings against the suite's, and --sweep N the
default 4-run sweep with the basic launcher against hydra/launcher=local_parallel: wall times, start-up
included, with the runs' page faults and kernel time, median of N, interleaved.
The last line is machine-readable:
    suite/bare=<step-time ratio> suite/hf_trainer=<tokens/s ratio> utilization=<fraction>
OVERRIDES are the suite's (model=..., batch_size=..., device=..., precision=...); default: its defaults.

--memory N measures peak memory instead of time: the bare loop, the suite's loop logged every step
(every metric, sqrt(v_hat) quantiles every step, a checkpoint) and the suite's at its default logging
interval (its unlogged steps are one full optimizer step, as the bare loop's), MEMORY_STEPS steps each, on the model
at two depths (MEMORY_LAYERS; width, batch and sequence from MEMORY_OVERRIDES, which OVERRIDES
replace key by key). Each measurement is a process of its own, as ru_maxrss only ever rises in one:
peak RSS on the CPU, torch.cuda.max_memory_allocated on CUDA, with the suite's process setting; the
median of N, interleaved. Bytes per parameter are the slope between the two depths, so imports, data
and the CUDA context cancel: (peak(deep) - peak(shallow)) / (parameters(deep) - parameters(shallow)).
Its last line: memory suite/bare=<ratio> suite=<bytes/parameter> bare=<bytes/parameter> default/bare=<ratio>

--real-model N measures SmolLM2-135M at 16 x 128 tokens (REAL_MODEL; OVERRIDES replace its keys) in fp32 and in
bf16 (with --compiled also in bf16 with compile=true): the bare loop and the suite's (default logging), each a
process of its own, 2 warm-up steps (a compiled run compiles in its first) and --steps timed ones; each
precision's 2048^3 matmul rate on the CPU, also a process of its own; interleaved, median of N. With --against
GIT_REF the same measurements run on that commit's code (a temporary git worktree) in the same run, so a
speed-up is a ratio taken on one machine in one sitting. Its last line:
    real-model suite/bare_<variant>=<r> ... bf16/fp32_suite_tokens=<r> [<variant>_suite_tokens_vs_REF=<r> ...
    bf16_compiled_suite_tokens_vs_REF_bf16=<r>]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import greenlet
import torch

ROOT = Path(__file__).resolve().parent.parent
# --against's measurements of an earlier commit run this script on that commit's code (a git worktree)
CODE = Path(os.environ.get("GRADSCALE_BENCH_CODE", ROOT))
sys.path.insert(0, str(CODE))
# the measured code's package: gradscale, or experiments in a commit before the one namespace
CODE_PACKAGE = "gradscale" if (CODE / "gradscale").is_dir() else "experiments"


def measured_module(module: str):
    """A module of the code being measured (this checkout's, or --against's commit's)."""
    import importlib

    return importlib.import_module(f"{CODE_PACKAGE}.{module}")


from gradscale import cache  # noqa: E402  (after the path: the script runs from anywhere)
from gradscale.checks import CommandParser  # noqa: E402


def build(overrides: list[str]):
    """The run's config and its job, built as a run builds them (gradscale.job.build_job)."""
    validate, build_job = measured_module("config").validate, measured_module("job").build_job
    if (CODE / CODE_PACKAGE / "hydra_glue.py").exists():
        compose, to_object = measured_module("hydra_glue").compose, measured_module("hydra_glue").to_object
        check_environment = measured_module("probes").check_environment
    else:  # --against a commit before 61b43df: these lived in its config.py, next to its conf/ (this script's
        # own helpers come from this checkout through its editable install; the code measured is the commit's)
        old = measured_module("config")
        check_environment, compose, to_object = old.check_environment, old.compose, old.to_object
    cfg = compose([*overrides, "wandb.mode=disabled"])
    validate(cfg, overrides=[])
    check_environment(cfg)
    run_cfg = to_object(cfg)
    try:
        prepare_weights = measured_module("pretrain").prepare_weights
    except (ImportError, AttributeError):  # --against a commit before 61b43df: its build_job builds the base itself
        pass
    else:
        prepare_weights(run_cfg.model)
    return run_cfg, build_job(run_cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Interleaved:
    """Runs the loops in turn, `block` optimizer steps at a time, each in its own greenlet on this one
    thread (one intra-op thread pool; nothing runs concurrently). A step ends at the optimizer's
    zero_grad (once per step in every loop; a logged suite step calls optimizer.step once per chunk).
    A block is timed from the moment its loop is resumed to the end of its block's last step (the
    device synchronized there, and only there), so all a loop does once per step is in its blocks:
    data, forward, backward, the gradient pipeline, the step, and the suite's logging, statistics and
    checkpoint where due. A slow stretch of the machine lasts over several loops' blocks and hits them
    alike. The first `warmup` steps of each loop, and whatever it does after its last timed step, are
    not timed."""

    def __init__(self, warmup: int, steps: int, block: int, device: torch.device):
        self.warmup, self.steps, self.block, self.device = warmup, steps, block, device
        self.loops: dict[str, dict] = {}

    def add(self, name: str, loop, optimizer: torch.optim.Optimizer) -> None:
        """loop: a function of no arguments that runs warmup + steps steps of `optimizer`."""
        state = {"calls": 0, "seconds": 0.0, "greenlet": greenlet.greenlet(loop)}
        inner = optimizer.zero_grad

        @functools.wraps(inner)
        def zero_grad(*args, **kwargs):
            out = inner(*args, **kwargs)
            state["calls"] += 1
            timed = state["calls"] - self.warmup
            if timed == 0 or (0 < timed <= self.steps and (timed % self.block == 0 or timed == self.steps)):
                sync(self.device)
                grad_enabled = torch.is_grad_enabled()  # thread-local, so shared by the greenlets
                greenlet.getcurrent().parent.switch()
                torch.set_grad_enabled(grad_enabled)
            return out

        optimizer.zero_grad = zero_grad
        self.loops[name] = state

    def run(self) -> dict[str, float]:
        """Seconds per step of each loop, its timed blocks summed over its timed steps."""
        for state in self.loops.values():
            self.resume(state)  # its warm-up
        pending = list(self.loops.values())
        while pending:
            for state in list(pending):
                start = time.perf_counter()
                self.resume(state)
                state["seconds"] += time.perf_counter() - start
                if state["calls"] == self.warmup + self.steps:
                    pending.remove(state)
                    state["greenlet"].switch()  # the rest of the loop (final eval, closing the log), untimed
        return {name: state["seconds"] / self.steps for name, state in self.loops.items()}

    def resume(self, state: dict) -> None:
        state["greenlet"].switch()
        if state["greenlet"].dead and state["calls"] < self.warmup + self.steps:
            raise RuntimeError(f"a loop ended after {state['calls']} steps, not {self.warmup + self.steps}")


def bare_loop(job, cfg, steps: int) -> None:
    """Forward, token-mean loss, backward, step, zero_grad: nothing else."""
    token_loss_sum = measured_module("grads").token_loss_sum

    model, optimizer, device = job.model, job.optimizer, job.device
    kernels = getattr(job, "bf16_matmul", None)  # the suite's bf16 kernels (gradscale/kernels.py), if it picks any
    with measured_module("kernels").matmuls(kernels) if kernels else contextlib.nullcontext():
        for step in range(steps):
            inputs, targets = (t.to(device) for t in job.batches.train_batch(step))
            with job.autocast:
                logits = model(input_ids=inputs).logits
            loss = token_loss_sum(logits, targets) / (targets != -100).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def suite_loop(job, cfg, steps: int, log_every: int | None = None, metrics: bool = True) -> None:
    """gradscale.train.train as a run calls it: metrics.jsonl, Adam statistics and checkpoints at the
    config's intervals (logged every cfg.log_every steps, or every `log_every`); metrics=False: none of
    them (only the warm-up and the last step log, outside the clock's interval)."""
    Checkpointer, RunLog = measured_module("checkpoint").Checkpointer, measured_module("metrics").RunLog
    LoopConfig, train = measured_module("train").LoopConfig, measured_module("train").train

    loop = replace(LoopConfig.of(cfg), steps=steps, log_every=(log_every or cfg.log_every) if metrics else steps,
                   eval_every=steps, eval_batches=1, adam_stats_every=cfg.adam_stats_every if metrics else None)
    with tempfile.TemporaryDirectory() as tmp:
        run_log = RunLog(Path(tmp), cfg.wandb, name="bench", group=None, tags=[], config={}) if metrics else None
        checkpointer = Checkpointer(Path(tmp), cfg.checkpoint_every, job.ranks) if metrics and cfg.checkpoint_every \
            else None
        train(job, loop, run_log, checkpointer)
        if run_log is not None:
            run_log.finish({})


def hf_trainer_loop(job, cfg, steps: int) -> None:
    """transformers.Trainer on the same batches and optimizer, logging and saving off."""
    model, optimizer, batches, device = job.model, job.optimizer, job.batches, job.device
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class EndOfStep(TrainerCallback):  # the Trainer zeroes the model's gradients, never the optimizer's
        def on_step_end(self, *args, **kwargs):
            optimizer.zero_grad(set_to_none=True)

    # HF shifts labels inside the model: label t is the input t, masked where our target t-1 is masked
    rows = []
    for step in range(steps):
        inputs, targets = batches.train_batch(step)
        labels = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
        rows += [{"input_ids": i, "labels": label} for i, label in zip(inputs, labels)]
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batches.batch_size, max_steps=steps,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, logging_strategy="no",
            save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
            use_cpu=device.type == "cpu", bf16=cfg.precision == "bf16", seed=cfg.seed,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, optimizers=(optimizer, None),
                          callbacks=[EndOfStep()])
        trainer.remove_callback(PrinterCallback)  # its end-of-training line would break up the progress lines
        trainer.train()


def median_interval(values: list[float], resamples: int = 2000, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median: how far the reported ratio may be off by noise alone."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def matmul_flops(device: torch.device, n: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """Measured matrix-multiply rate of this machine in `dtype` (FLOP/s), best of `repeats`."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = math.inf
    for _ in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def model_flops_per_token(cfg, n_params: int) -> float:
    """6 * parameters (forward + backward) plus attention scores and values: 12 * layers * heads * head_dim
    * seq_len (PaLM, appendix B)."""
    m = cfg.model
    return 6 * n_params + 12 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * cfg.seq_len


GLIBC_DEFAULT_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"}  # glibc's default, set: the suite leaves it
SWEEP = ["-m", "optimizer=sgd,adamw", "scale=1,8"]
WALL_TIMED = {
    "allocator": {"default run, glibc's malloc settings": ([], GLIBC_DEFAULT_MALLOC),
                  "default run, freed memory kept (the suite's)": ([], {})},
    "sweep": {"default sweep, sequential": (SWEEP, {}),
              "default sweep, parallel (local_parallel)": ([*SWEEP, "hydra/launcher=local_parallel"], {})},
}


def wall_times(variants: dict[str, tuple[list[str], dict]], repeats: int) -> dict[str, dict[str, float]]:
    """Per variant, `python -m gradscale.run ARGS` (start-up included), interleaved, median of `repeats`:
    wall s, and from the child's resource usage its minor page faults and kernel CPU s. Each run gets its
    own threads and malloc settings (none inherited from this process)."""
    measured: dict[str, dict[str, list[float]]] = {name: {"wall s": [], "minor faults": [], "kernel s": []}
                                                   for name in variants}
    skip = {"OMP_NUM_THREADS", *cache.GLIBC_MALLOC_ENV}
    base_env = {k: v for k, v in os.environ.items() if k not in skip} | {"WANDB_MODE": "disabled"}
    for repeat in range(repeats):
        for name, (args, env) in variants.items():
            with tempfile.TemporaryDirectory() as tmp:
                usage, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "gradscale.run", *args, "wandb.mode=disabled",
                     f"hydra.run.dir={tmp}/run", f"hydra.sweep.dir={tmp}/sweep"],
                    cwd=ROOT, capture_output=True, text=True, env=base_env | env,
                )
                wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
                if proc.returncode != 0:
                    raise SystemExit(f"error: {name} failed:\n{proc.stderr[-2000:]}")
            measured[name]["wall s"].append(wall)
            measured[name]["minor faults"].append(after.ru_minflt - usage.ru_minflt)
            measured[name]["kernel s"].append(after.ru_stime - usage.ru_stime)
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} {m['wall s'][-1]:.1f} s" for name, m in measured.items()), flush=True)
    return {name: {key: statistics.median(values) for key, values in m.items()} for name, m in measured.items()}


WARMUP = 5  # steps per loop before its clock starts: allocator, caches, the suite's step-0 record

# --memory: parameters well above activations and logits (a few tokens per step), so the slope is the
# loops' memory per parameter; every metric and statistic every step, and one checkpoint
MEMORY_OVERRIDES = ["model.init=random", "model.hidden_size=512", "model.intermediate_size=1408",
                    "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.head_dim=64", "batch_size=8",
                    "seq_len=16", "data.packed=true", "adam_stats_every=1", "checkpoint_every=2"]
MEMORY_LAYERS = (2, 6)
MEMORY_STEPS = 4  # the Adam state exists from the first step on; the checkpoint after the second
MEMORY_LOOPS = {"bare": bare_loop, "suite, logged every step": functools.partial(suite_loop, log_every=1),
                "suite": suite_loop}  # logged at the config's interval: unlogged steps take one full step


# --real-model: SmolLM2-135M at the size the issue measured, fp32 and bf16, the suite against a bare loop
REAL_MODEL = ["model=smollm2_135m", "batch_size=16", "seq_len=128", "device=cpu", "wandb.mode=disabled"]
# each variant: its overrides and the precision of its matmul rate; compiled: Inductor fuses the elementwise work
REAL_VARIANTS = {"fp32": (["precision=fp32"], "fp32"), "bf16": (["precision=bf16"], "bf16"),
                 "bf16 compiled": (["precision=bf16", "compile=true"], "bf16")}
REAL_PRECISIONS = tuple(dict.fromkeys(precision for _, precision in REAL_VARIANTS.values()))
REAL_LOOPS = {"bare": bare_loop, "suite": suite_loop}
REAL_WARMUP, REAL_STEPS = 2, 5
MATMUL_N = 2048


def step_probe(loop: str, overrides: list[str], steps: int) -> tuple[float, float]:
    """In this process: (seconds per step over `steps` timed steps after REAL_WARMUP, model FLOP/s) of `loop`."""
    cache.keep_freed_memory()
    cfg, job = build(overrides)
    timed = []

    def clocked_zero_grad(inner=job.optimizer.zero_grad):
        def zero_grad(*args, **kwargs):
            out = inner(*args, **kwargs)
            sync(job.device)
            timed.append(time.perf_counter())
            return out
        return zero_grad

    job.optimizer.zero_grad = clocked_zero_grad()  # a step ends at its zero_grad, in every loop
    REAL_LOOPS[loop](job, cfg, REAL_WARMUP + steps)
    seconds = (timed[REAL_WARMUP + steps - 1] - timed[REAL_WARMUP - 1]) / steps
    n_params = sum(p.numel() for p in job.model.parameters())
    return seconds, model_flops_per_token(cfg, n_params) * cfg.batch_size * cfg.seq_len / seconds


def real_model(overrides: list[str], repeats: int, steps: int, against: str | None, compiled: bool = False,
               matmul_size: int = MATMUL_N) -> int:
    """--real-model: each (code, variant, loop) a process of its own, and each precision's matmul rate,
    interleaved, median of `repeats`; a table and the ratios side by side."""
    codes = {"this": ROOT}
    variants = {k: v for k, v in REAL_VARIANTS.items() if compiled or k != "bf16 compiled"}
    with contextlib.ExitStack() as stack:
        if against:
            codes[against] = stack.enter_context(worktree(against))
        measured: dict[tuple, list[tuple[float, float]]] = {}
        matmul: dict[str, list[float]] = {p: [] for p in REAL_PRECISIONS}
        for repeat in range(repeats):
            for precision in REAL_PRECISIONS:
                matmul[precision].append(float(probe(ROOT, ["--matmul-probe", precision, "--matmul-size",
                                                             str(matmul_size)])[-1]))
            for variant, (settings, _) in variants.items():
                for code, tree in codes.items():
                    for loop in REAL_LOOPS:
                        args = ["--step-probe", loop, "--steps", str(steps),
                                *with_overrides(with_overrides(REAL_MODEL, settings), overrides)]
                        seconds, flops = map(float, probe(tree, args)[-2:])
                        measured.setdefault((code, variant, loop), []).append((seconds, flops))
            print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
                f"{code} {variant} {loop} {v[-1][0]:.2f}" for (code, variant, loop), v in measured.items())
                + " s/step", flush=True)
    cfg = to_object_of(with_overrides(REAL_MODEL, overrides))
    tokens = cfg.batch_size * cfg.seq_len
    print(f"\n{cfg.model.name}, {tokens} tokens/step ({cfg.batch_size} x {cfg.seq_len}), {torch.get_num_threads()} "
          f"threads; {REAL_WARMUP} + {steps} steps per measurement, one process each, median of {repeats}")
    print("\n| code | variant | loop | s/step | tokens/s | model GFLOP/s | matmul GFLOP/s | of matmul |\n"
          "|---|---|---|---|---|---|---|---|")
    seconds = {key: statistics.median(s for s, _ in v) for key, v in measured.items()}
    for (code, variant, loop), v in measured.items():
        flops, rate = statistics.median(f for _, f in v), statistics.median(matmul[REAL_VARIANTS[variant][1]])
        print(f"| {code} | {variant} | {loop} | {seconds[code, variant, loop]:.3f} | "
              f"{tokens / seconds[code, variant, loop]:,.0f} | {flops / 1e9:,.0f} | {rate / 1e9:,.0f} | "
              f"{flops / rate:.3f} |")
    names = {variant: variant.replace(" ", "_") for variant in variants}
    ratios = {f"suite/bare_{names[v]}": seconds["this", v, "suite"] / seconds["this", v, "bare"] for v in variants}
    ratios["bf16/fp32_suite_tokens"] = seconds["this", "fp32", "suite"] / seconds["this", "bf16", "suite"]
    if against:
        for v in variants:  # each against the old code in the same variant, and compiled against its eager bf16
            ratios[f"{names[v]}_suite_tokens_vs_{against}"] = seconds[against, v, "suite"] / seconds["this", v, "suite"]
        if compiled:
            ratios[f"bf16_compiled_suite_tokens_vs_{against}_bf16"] = (seconds[against, "bf16", "suite"]
                                                                       / seconds["this", "bf16 compiled", "suite"])
    print("\n(ratios of medians: suite/bare step time; the others tokens/s)")
    print("real-model " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))
    return 0


def to_object_of(overrides: list[str]):
    glue = measured_module("hydra_glue")
    return glue.to_object(glue.compose(overrides))


def probe(tree: Path, args: list[str]) -> list[str]:
    """This script's probe in a process of its own, on the code in `tree`; its last output line's fields."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args], cwd=tree, capture_output=True,
                          text=True, env=os.environ | {"WANDB_MODE": "disabled", "GRADSCALE_BENCH_CODE": str(tree)})
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(args[:2])} on {tree} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.split()


@contextlib.contextmanager
def worktree(ref: str):
    """A detached git worktree of `ref` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="gradscale-bench-") as tmp:
        tree = Path(tmp) / "code"
        made = subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=ROOT, capture_output=True,
                              text=True)
        if made.returncode != 0:
            reason = (made.stderr.strip() or "git worktree add failed").splitlines()[-1]
            raise SystemExit(f"error: --against {ref}: {reason}")
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)  # and any a killed run left


def with_overrides(defaults: list[str], overrides: list[str]) -> list[str]:
    """defaults, each replaced by an override of the same key (Hydra refuses a key given twice)."""
    from gradscale.checks import override_key

    keys = {override_key(o) for o in overrides}
    return [d for d in defaults if override_key(d) not in keys] + overrides


def memory_probe(loop: str, overrides: list[str]) -> tuple[int, int]:
    """In this process: (peak bytes, parameters) of MEMORY_STEPS steps of `loop`."""
    cache.keep_freed_memory()
    cfg, job = build(overrides)  # resets the CUDA peak first
    MEMORY_LOOPS[loop](job, cfg, MEMORY_STEPS)
    if job.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(job.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return peak, sum(p.numel() for p in job.model.parameters())


def memory(overrides: list[str], repeats: int) -> tuple[dict[str, dict[int, float]], dict[int, int]]:
    """Per loop, its median peak bytes at each of MEMORY_LAYERS over `repeats` (one process per
    measurement, interleaved); and the parameters at each depth."""
    overrides = with_overrides(MEMORY_OVERRIDES, overrides)
    peaks = {name: {layers: [] for layers in MEMORY_LAYERS} for name in MEMORY_LOOPS}
    n_params = {}
    for repeat in range(repeats):
        for layers in MEMORY_LAYERS:
            for name in MEMORY_LOOPS:
                proc = subprocess.run(
                    [sys.executable, __file__, "--memory-probe", name,
                     *with_overrides(overrides, [f"model.num_hidden_layers={layers}"])],
                    cwd=ROOT, capture_output=True, text=True, env=os.environ | {"WANDB_MODE": "disabled"},
                )
                if proc.returncode != 0:
                    raise SystemExit(f"error: {name} with {layers} layers failed:\n{proc.stderr[-2000:]}")
                peak, n_params[layers] = map(int, proc.stdout.split()[-2:])
                peaks[name][layers].append(peak)
        print(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
            f"{name} {layers} layers {peaks[name][layers][-1] / 2**20:,.1f}" for name in MEMORY_LOOPS
            for layers in MEMORY_LAYERS) + " MiB peak", flush=True)
    return {name: {layers: statistics.median(v) for layers, v in by_layers.items()}
            for name, by_layers in peaks.items()}, n_params


def print_memory(peaks: dict[str, dict[int, float]], n_params: dict[int, int]) -> None:
    shallow, deep = MEMORY_LAYERS
    per_param = {name: (peak[deep] - peak[shallow]) / (n_params[deep] - n_params[shallow])
                 for name, peak in peaks.items()}
    bare, suite = per_param["bare"], per_param["suite, logged every step"]
    print(f"\n| loop | peak MiB, {shallow} layers ({n_params[shallow] / 1e6:.2f}M parameters) | peak MiB, {deep} "
          f"layers ({n_params[deep] / 1e6:.2f}M) | bytes/parameter | vs bare |\n|---|---|---|---|---|")
    for name, peak in peaks.items():
        print(f"| {name} | {peak[shallow] / 2**20:,.1f} | {peak[deep] / 2**20:,.1f} | {per_param[name]:.2f} | "
              f"{per_param[name] / bare:.3f} |")
    print("(medians over repeats; bytes/parameter: the slope of the peak between the two depths)")
    print(f"memory suite/bare={suite / bare:.4f} suite={suite:.2f} bare={bare:.2f} "
          f"default/bare={per_param['suite'] / bare:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python scripts/bench.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples (docs/performance.md):\n"
                                  "  python scripts/bench.py --repeats 30 --allocator 3 --sweep 3\n"
                                  "  python scripts/bench.py --memory 5")
    parser.add_argument("overrides", nargs="*", help="the suite's config overrides, e.g. model=llama3_2_1b")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per run (>= 1; default 50, "
                        f"with --real-model {REAL_STEPS}), after "
                        f"{WARMUP} warm-up steps")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved repeats; medians are reported")
    parser.add_argument("--allocator", type=int, default=0, metavar="N", help="also time the default run with "
                        "glibc's malloc settings and with the suite's (freed memory kept), N times each")
    parser.add_argument("--sweep", type=int, default=0, metavar="N",
                        help="also time the default sweep, sequential and parallel, N times each")
    parser.add_argument("--memory", type=int, default=0, metavar="N", help="instead of timing, the peak memory "
                        "per parameter of the bare loop and of the suite's logged every step: the slope between "
                        f"{MEMORY_LAYERS[0]} and {MEMORY_LAYERS[1]} layers, one process per measurement, median "
                        "of N")
    parser.add_argument("--real-model", type=int, default=0, metavar="N", help="instead, SmolLM2-135M at 16 x 128 "
                        "tokens in fp32 and bf16: the suite against a bare loop, tokens/s and model FLOP/s against "
                        "the measured matmul rate of each precision (--matmul-size), one process per measurement, "
                        f"median of N ({REAL_WARMUP} + --steps steps each, default {REAL_STEPS})")
    parser.add_argument("--against", metavar="GIT_REF", help="with --real-model: also measure the code of this "
                        "commit (a git worktree), in the same run, for the ratios of this code's tokens/s to its")
    parser.add_argument("--matmul-size", type=int, default=MATMUL_N, metavar="N", help="with --real-model: the "
                        f"side of the square matmul whose rate each precision is measured by (default {MATMUL_N}; a "
                        "CPU without bf16 instructions takes minutes for bf16 at that size)")
    parser.add_argument("--compiled", action="store_true", help="with --real-model: also bf16 with compile=true "
                        "(Inductor; its first step compiles, a minute or more with a cold cache)")
    parser.add_argument("--memory-probe", metavar="LOOP", help=argparse.SUPPRESS)  # one measurement of --memory
    parser.add_argument("--step-probe", metavar="LOOP", help=argparse.SUPPRESS)  # one measurement of --real-model
    parser.add_argument("--matmul-probe", metavar="PRECISION", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    if args.memory_probe:
        print(*memory_probe(args.memory_probe, args.overrides))
        return 0
    if args.matmul_probe:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.matmul_probe]
        print(matmul_flops(torch.device("cpu"), args.matmul_size, dtype=dtype))
        return 0
    if args.step_probe:
        print(*step_probe(args.step_probe, args.overrides, args.steps))
        return 0
    if args.real_model < 0:
        parser.error(f"--real-model={args.real_model} must be >= 0")
    if args.matmul_size < 1:
        parser.error(f"--matmul-size={args.matmul_size} must be >= 1")
    if (args.against or args.compiled) and not args.real_model:
        parser.error(f"{'--against' if args.against else '--compiled'} goes with --real-model N")
    if args.real_model:
        steps = REAL_STEPS if args.steps is None else args.steps
        if steps < 1:
            parser.error(f"--steps={steps} must be >= 1")
        return real_model(args.overrides, args.real_model, steps, args.against, args.compiled, args.matmul_size)
    args.steps = 50 if args.steps is None else args.steps
    if args.steps < 1 or args.repeats < 1:
        parser.error(f"--steps={args.steps} must be >= 1 and --repeats={args.repeats} >= 1")
    if args.memory < 0:
        parser.error(f"--memory={args.memory} must be >= 0")
    if args.memory:
        print_memory(*memory(args.overrides, args.memory))
        return 0

    build_optimizer = measured_module("optimizers").build_optimizer

    cache.keep_freed_memory()  # as every suite job does, so every loop here runs with it

    cfg, job = build(args.overrides)
    device, base = job.device, job.model
    n_params = sum(p.numel() for p in base.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len
    print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, {device}, "
          f"{torch.get_num_threads()} threads, {cfg.precision}; {WARMUP} + {args.steps} steps x {args.repeats} "
          "repeats", flush=True)

    loops = {
        "bare": bare_loop,
        "suite": suite_loop,
        "suite, logged every step": functools.partial(suite_loop, log_every=1),
        "suite, metrics off": functools.partial(suite_loop, metrics=False),
        "hf_trainer": hf_trainer_loop,
    }
    step_s: dict[str, list[float]] = {name: [] for name in loops}
    for repeat in range(args.repeats):
        # the order rotated each repeat: whatever the previous loop's block left behind (allocator,
        # caches) does not always fall on the same loop
        order = list(loops)[repeat % len(loops):] + list(loops)[:repeat % len(loops)]
        interleaved = Interleaved(WARMUP, args.steps, cfg.log_every, device)
        for name in order:
            run_model = copy.deepcopy(base)
            optimizer = build_optimizer(cfg.optimizer,
                                        [(n, p) for n, p in run_model.named_parameters() if p.requires_grad])
            loop_job = replace(job, model=run_model, optimizer=optimizer)  # the same batches and pipeline
            interleaved.add(name, functools.partial(loops[name], loop_job, cfg, WARMUP + args.steps), optimizer)
        for name, seconds in interleaved.run().items():
            step_s[name].append(seconds)
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{name} {1e3 * times[-1]:.1f}" for name, times in step_s.items()) + " ms/step", flush=True)

    # ratios within a repeat (paired): what is left of the machine's drift cancels out of them
    def paired(numerator: str, denominator: str) -> list[float]:
        return [n / d for n, d in zip(step_s[numerator], step_s[denominator])]

    def spread(ratios: list[float]) -> str:
        low, high = median_interval(ratios)
        return f"{statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}]"

    print("\n| loop | ms/step | tokens/s | vs bare | vs suite, metrics off |\n|---|---|---|---|---|")
    for name in loops:
        ms = 1e3 * statistics.median(step_s[name])
        print(f"| {name} | {ms:.2f} | {tokens_per_step / ms * 1e3:,.0f} | {spread(paired(name, 'bare'))} | "
              f"{spread(paired(name, 'suite, metrics off'))} |")
    print("(medians over repeats; ratios: median of the per-repeat ratios of step times [its 95% bootstrap interval])")

    suite_vs_bare = paired("suite", "bare")
    suite_vs_hf = paired("hf_trainer", "suite")  # tokens/s ratio = inverse step-time ratio
    print(f"\ntargets: suite/bare step time {spread(suite_vs_bare)} (at most 1.03); suite/hf_trainer "
          f"tokens/s {spread(suite_vs_hf)} (at least 1)")
    peak = matmul_flops(device)
    suite_flops = model_flops_per_token(cfg, n_params) * tokens_per_step / statistics.median(step_s["suite"])
    print(f"\nsuite model FLOP/s: {suite_flops / 1e9:.2f} GFLOP/s; measured fp32 matmul (1024^3): "
          f"{peak / 1e9:.1f} GFLOP/s; utilization {suite_flops / peak:.3f}")
    for flag in ("allocator", "sweep"):
        if getattr(args, flag):
            measured = wall_times(WALL_TIMED[flag], getattr(args, flag))
            first = next(iter(measured.values()))["wall s"]
            print("\n| command | wall s | vs first | minor page faults | kernel CPU s |\n|---|---|---|---|---|")
            for name, m in measured.items():
                print(f"| {name} | {m['wall s']:.1f} | {m['wall s'] / first:.2f} | {m['minor faults']:,.0f} | "
                      f"{m['kernel s']:.1f} |")
    print(f"suite/bare={statistics.median(suite_vs_bare):.4f} suite/hf_trainer={statistics.median(suite_vs_hf):.4f} "
          f"utilization={suite_flops / peak:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
