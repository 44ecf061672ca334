"""Profile the suite's optimizer step: where one step's time goes, op by op (torch.profiler).

    python scripts/profile_step.py [OVERRIDES ...] [--warmup 2] [--timed 3] [--rows 25]

Builds the job as a run does (scripts/bench.py's build), keeps freed memory as a run does, runs the loop's
step (gradscale.train.accumulate_gradients, the gradient pipeline, optimizer.step, zero_grad) --warmup
times, times --timed more, then profiles one and prints the ops by self CPU time, and again by input shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the script runs from anywhere
from gradscale.checks import CommandParser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python scripts/profile_step.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="example: python scripts/profile_step.py model=smollm2_135m precision=bf16 "
                                  "batch_size=16 seq_len=128")
    parser.add_argument("overrides", nargs="*", help="the suite's config overrides, e.g. model=smollm2_135m")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 0)")
    parser.add_argument("--timed", type=int, default=3, help="timed steps before the profiled one (>= 1)")
    parser.add_argument("--rows", type=int, default=25, help="rows of each table (>= 1)")
    args = parser.parse_intermixed_args(argv)
    for name in ("warmup", "timed", "rows"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name}={getattr(args, name)} is out of range (see --help)")

    import torch
    from torch.profiler import ProfilerActivity, profile

    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from gradscale.cache import keep_freed_memory
    from gradscale.kernels import matmuls
    from gradscale.train import accumulate_gradients

    keep_freed_memory()
    cfg, job = bench.build(args.overrides)
    params = [p for p in job.model.parameters() if p.requires_grad]

    def step(i: int) -> None:
        inputs, targets = job.batches.train_batch(i)
        with matmuls(job.bf16_matmul):  # as train() runs it
            _, num_tokens = accumulate_gradients(job.model, inputs, targets, job.pipeline, job.ranks, cfg.grad_accum,
                                                 job.autocast, job.device)
        job.pipeline.apply(params, num_tokens, job.ranks, measure=False)
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)

    print(f"{cfg.model.name}, {cfg.precision}, {cfg.batch_size} x {cfg.seq_len} tokens, {job.device}, "
          f"{torch.get_num_threads()} threads: {args.warmup} warm-up + {args.timed} timed steps, then one profiled",
          flush=True)
    for i in range(args.warmup):
        step(i)
    bench.sync(job.device)
    started = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.timed):
        step(i)
    bench.sync(job.device)
    print(f"{(time.perf_counter() - started) / args.timed:.3f} s per step", flush=True)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if job.device.type == "cuda" else [])],
                 record_shapes=True) as prof:
        step(args.warmup + args.timed)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                             max_name_column_width=40, max_shapes_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
