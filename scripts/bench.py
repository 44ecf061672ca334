"""Benchmark: the suite's training step against a bare PyTorch loop and the Hugging Face Trainer.

    python scripts/bench.py [OVERRIDES ...] [--steps 20] [--repeats 5] [--sweep N]

In one process, on the same model (same init), batches and optimizer (AdamW, foreach), interleaved and
repeated (median of --repeats), it times per optimizer step:
  (a) bare:       forward, token-mean loss, backward, optimizer.step, zero_grad; nothing else
  (b) suite:      experiments.train.train with every metric on (grad norm, update RMS, parameter norm,
                  Adam state statistics, sqrt(v_hat) quantiles, metrics.jsonl written line by line), logged
                  every log_every = 5 steps as the suite runs by default; suite_every_step: logged every step
  (c) hf_trainer: transformers.Trainer on the same model and batches, logging and saving off
Step times are medians over steps 1..N-1 of each repeat (step 0 warms up), then over repeats. Then the
suite's own loop with metrics off, at the default logging and every step (what the metrics alone cost,
everything else equal). Also the
model FLOP/s of (b) (6 * parameters * tokens plus attention) against this machine's fp32
matrix-multiply rate measured in the same run. --sweep N adds the default 4-run sweep's wall time with
the basic launcher and with hydra/launcher=local_parallel (median of N, interleaved). The last line is machine-readable:
    suite/bare=<step-time ratio> suite/hf_trainer=<tokens/s ratio> utilization=<fraction>
OVERRIDES are the suite's (model=..., batch_size=..., device=..., precision=...); default: its defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from experiments.config import register_configs, to_object, validate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[*overrides, "wandb.mode=disabled"])
    validate(cfg, overrides=[])
    return to_object(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_step_times(model, batches, cfg, device, steps: int) -> list[float]:
    from experiments.grads import token_loss_sum
    from experiments.optim import build_optimizer

    optimizer = build_optimizer(cfg.optimizer, list(model.parameters()))  # the same AdamW as the suite's
    autocast = autocast_for(cfg, device)
    times, last = [], time.perf_counter()
    for step in range(steps):
        inputs, targets = (t.to(device) for t in batches.train_batch(step))
        with autocast:
            logits = model(input_ids=inputs).logits
        loss = token_loss_sum(logits, targets) / (targets != -100).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[1:]


def suite_step_times(model, batches, cfg, device, steps: int, log_every: int | None = None) -> list[float]:
    """The suite's own loop with every metric on, logged every cfg.log_every steps (the default, 5) or
    every step; step times from its own perf/tokens_per_s (each logged window's mean step time)."""
    from experiments.grads import GradPipeline
    from experiments.metrics import RunLog
    from experiments.optim import build_optimizer
    from experiments.parallel import Ranks
    from experiments.train import train

    optimizer = build_optimizer(cfg.optimizer, list(model.parameters()))
    pipeline = GradPipeline(cfg.world_size, cfg.fix, cfg.scale, cfg.clip_grad_norm)
    with tempfile.TemporaryDirectory() as tmp:
        run_log = RunLog(Path(tmp), cfg.wandb, name="bench", group=None, tags=[], config={})
        train(model, optimizer, batches, pipeline, run_log, Ranks(world_size=cfg.world_size), steps=steps,
              grad_accum=1, log_every=log_every or cfg.log_every, eval_every=steps, eval_batches=1,
              adam_stats_every=cfg.adam_stats_every, autocast=autocast_for(cfg, device), device=device)
        run_log.finish({})
        from analysis.load import read_jsonl

        records = [r for r in read_jsonl(Path(tmp) / "metrics.jsonl") if "perf/tokens_per_s" in r]
    tokens = batches.batch_size * batches.train.inputs.shape[1]
    return [tokens / r["perf/tokens_per_s"] for r in records[1:]]


def metrics_cost(base, batches, cfg, device, steps: int, repeats: int) -> dict[str, float]:
    """The suite's own loop timed whole (wall time / steps, the final eval included alike) with metrics
    off, at the default logging, and every step: what the metrics cost, with everything else equal."""
    from experiments.grads import GradPipeline
    from experiments.optim import build_optimizer
    from experiments.parallel import Ranks
    from experiments.train import train

    settings = {"metrics off": (10**9, None), f"every {cfg.log_every} steps (default)": (cfg.log_every,
                cfg.adam_stats_every), "every step": (1, cfg.adam_stats_every)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(repeats):  # interleaved
        for name, (log_every, adam_stats_every) in settings.items():
            model = copy.deepcopy(base)
            optimizer = build_optimizer(cfg.optimizer, list(model.parameters()))
            start = time.perf_counter()
            train(model, optimizer, batches, GradPipeline(cfg.world_size, cfg.fix, cfg.scale), None,
                  Ranks(world_size=cfg.world_size), steps=steps, grad_accum=1, log_every=log_every,
                  eval_every=steps, eval_batches=1, adam_stats_every=adam_stats_every,
                  autocast=autocast_for(cfg, device), device=device)
            sync(device)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def hf_trainer_step_times(model, batches, cfg, device, steps: int) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.last = self.last or time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    # HF shifts labels inside the model: label t is the input t, masked where our target t-1 is masked
    rows = []
    for step in range(steps):
        inputs, targets = batches.train_batch(step)
        labels = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
        rows += [{"input_ids": i, "labels": label} for i, label in zip(inputs, labels)]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batches.batch_size, max_steps=steps,
            learning_rate=cfg.optimizer.lr, adam_beta1=cfg.optimizer.betas[0], adam_beta2=cfg.optimizer.betas[1],
            adam_epsilon=cfg.optimizer.eps, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
            max_grad_norm=0.0, logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, use_cpu=device.type == "cpu", bf16=cfg.precision == "bf16",
            seed=cfg.seed, optim="adamw_torch",
        )
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[clock]).train()
    return clock.times[1:]


def autocast_for(cfg, device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16" else contextlib.nullcontext()


def matmul_flops(device: torch.device, n: int = 1024, repeats: int = 10) -> float:
    """Measured fp32 matrix-multiply rate of this machine (FLOP/s), best of `repeats`."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
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


def sweep_wall_times(repeats: int) -> dict[str, float]:
    """The default 4-run sweep's wall time (start-up included), sequential (basic launcher) and in
    parallel (hydra/launcher=local_parallel: 2 jobs, cores / 2 threads each); interleaved, median."""
    times: dict[str, list[float]] = {"sequential": [], "parallel": []}
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each launcher's own threads
    for repeat in range(repeats):
        for name, extra in (("sequential", []), ("parallel", ["hydra/launcher=local_parallel"])):
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "experiments.run", "-m", "optimizer=sgd,adamw", "scale=1,8", *extra,
                     "wandb.mode=disabled", f"hydra.sweep.dir={tmp}/sweep"],
                    cwd=ROOT, capture_output=True, text=True, env={**env, "WANDB_MODE": "disabled"},
                )
                times[name].append(time.perf_counter() - start)
                if proc.returncode != 0:
                    raise SystemExit(f"error: the {name} sweep failed:\n{proc.stderr[-2000:]}")
        print(f"default sweep, repeat {repeat + 1}/{repeats}: sequential {times['sequential'][-1]:.1f} s, "
              f"parallel {times['parallel'][-1]:.1f} s", flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the suite's config overrides, e.g. model=llama3_2_1b")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed run (>= 3)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median is reported")
    parser.add_argument("--sweep", type=int, default=0, metavar="N",
                        help="also time the default sweep, sequential and parallel, N times each")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.repeats < 1:
        parser.error(f"--steps={args.steps} must be >= 3 and --repeats={args.repeats} >= 1")

    from experiments import data, model, parallel

    cfg = compose(args.overrides)
    device = parallel.device_for(cfg.device)
    examples = data.load_examples(cfg.data)
    tokenizer = data.build_tokenizer(examples, cfg.data.tokenizer_vocab_size, cfg.data.cache_dir)
    batches = data.build_batches(examples, cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)
    base = model.build_model(cfg.model, cfg.seed, device)
    n_params = sum(p.numel() for p in base.parameters())
    tokens_per_step = cfg.batch_size * cfg.seq_len
    print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, {device}, "
          f"{torch.get_num_threads()} threads, {cfg.precision}; {args.steps} steps x {args.repeats} repeats",
          flush=True)

    variants = {"bare": bare_step_times, "suite": suite_step_times,
                "suite_every_step": functools.partial(suite_step_times, log_every=1),
                "hf_trainer": hf_trainer_step_times}
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        # interleaved, and the order rotated each repeat: drifts in machine speed and whatever the
        # previous loop left behind (allocator, caches) hit all three alike
        order = list(variants)[repeat % len(variants):] + list(variants)[:repeat % len(variants)]
        for name in order:
            timed = variants[name]
            times = timed(copy.deepcopy(base), batches, cfg, device, args.steps)
            medians[name].append(statistics.median(times))
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{n} {1e3 * m[-1]:.1f} ms/step" for n, m in medians.items()), flush=True)

    step = {name: statistics.median(m) for name, m in medians.items()}
    tokens_per_s = {name: tokens_per_step / t for name, t in step.items()}
    cost = metrics_cost(base, batches, cfg, device, args.steps, args.repeats)
    print("\n| suite loop, metrics | ms/step | vs metrics off |\n|---|---|---|")
    for name, t in cost.items():
        print(f"| {name} | {1e3 * t:.2f} | {t / cost['metrics off']:.3f} |")
    peak = matmul_flops(device)
    suite_flops = model_flops_per_token(cfg, n_params) * tokens_per_s["suite"]
    print("\n| loop | ms/step | tokens/s | vs bare |\n|---|---|---|---|")
    for name in variants:
        print(f"| {name} | {1e3 * step[name]:.2f} | {tokens_per_s[name]:,.0f} | {step[name] / step['bare']:.3f} |")
    print(f"\nsuite model FLOP/s: {suite_flops / 1e9:.2f} GFLOP/s; measured fp32 matmul (1024^3): "
          f"{peak / 1e9:.1f} GFLOP/s; utilization {suite_flops / peak:.3f}")
    if args.sweep:
        walls = sweep_wall_times(args.sweep)
        print(f"default sweep: sequential {walls['sequential']:.1f} s, parallel {walls['parallel']:.1f} s "
              f"(parallel/sequential {walls['parallel'] / walls['sequential']:.2f})")
    print(f"suite/bare={step['suite'] / step['bare']:.4f} "
          f"suite/hf_trainer={tokens_per_s['suite'] / tokens_per_s['hf_trainer']:.4f} "
          f"utilization={suite_flops / peak:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
