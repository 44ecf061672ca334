"""`gradscale-advise [key=value ...] [--gradient-only] [--world-sizes N,..] [--scales c,..] [--eps E]
[--json FILE]`

The risk advisor for your own model: runs the short c = 1 reference fine-tune it needs, through the same
entry point and config keys as any run (`model.path=DIR`, `data=...`, `optimizer.eps=...`; `steps=20`
unless given), with sqrt(v_hat) histograms on every step, then prints what a gradient multiplier c = 1/N
would do to AdamW's update at each world size N (`python -m gradscale.analysis.advise` on that run folder). With
--gradient-only it needs one gradient instead: Adam's first step has v_hat = g^2 exactly, so the step-0
prediction needs no optimizer state and no step, only the memory of a forward and backward. Both modes
print the memory they will need first, and refuse in one line when the device does not have it free.
With clip_grad_norm=M, one more line per N: which case of docs/design.md physics 13 the grad norms put it in
(both runs clipped, only the fixed one, neither, or some steps) and what to do.

    gradscale-advise model=smollm2_135m
    gradscale-advise model.path=/models/Llama-3.2-3B --gradient-only --world-sizes 8,64,512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from gradscale.advice import AdviseError, check_options
from gradscale.checks import CommandParser, ConfigError, override_key
from gradscale.optimizers import advisable
from gradscale.records import GRAD_NORM

DEFAULT_STEPS = 20
# what makes the run the advisor's reference: c = 1, records on every step
FIXED_KEYS = {"scale": "1", "fix": "true"}


def reference_overrides(overrides: list[str]) -> tuple[list[str], Path]:
    """The run's overrides (the user's, then the advisor's defaults and fixed keys) and its folder."""
    keys = {override_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    if "-m" in overrides or "--multirun" in overrides:
        raise AdviseError("error: gradscale.advise runs one reference fine-tune, not a sweep: drop -m")
    for key in FIXED_KEYS:
        if key in keys:
            raise AdviseError(f"error: {key}={keys[key]} is not allowed: the advisor runs the c = 1 reference "
                              "itself (scale=1, fix=true); ask for other multipliers with --scales or --world-sizes")
    if keys.get("optimizer", "adamw") not in advisable():
        raise AdviseError(f"error: optimizer={keys['optimizer']} is not allowed: the advisor predicts eps's effect "
                          f"on Adam's update (optimizer={' or '.join(advisable())}); sgd feels every factor "
                          "exactly, the scale-invariant ones none")
    run_dir = Path(keys.get("hydra.run.dir") or f"outputs/advise/{time.strftime('%Y-%m-%d/%H-%M-%S')}")
    added = [f"{k}={v}" for k, v in FIXED_KEYS.items()] + ["adam_stats_every=1", "log_every=1"]
    if "steps" not in keys:
        added.append(f"steps={DEFAULT_STEPS}")
    if "hydra.run.dir" not in keys:
        added.append(f"hydra.run.dir={run_dir}")
    return [*overrides, *added], run_dir


def preflight(overrides: list[str], gradient_only: bool):
    """The run's config, composed, range-checked and checked against the machine, and its memory estimate
    against what the device has free, before anything is loaded; ConfigError (one line) when any fails."""
    from gradscale import memory
    from gradscale.config import validate
    from gradscale.hydra_glue import compose_checked, to_object
    from gradscale.parallel import device_for
    from gradscale.probes import check_environment

    config_overrides = [o for o in overrides if not o.startswith("hydra.")]
    cfg = compose_checked(config_overrides)
    validate(cfg, config_overrides)
    check_environment(cfg)
    run_cfg = to_object(cfg)
    device_type = device_for(run_cfg.device).type
    needed = memory.estimate(run_cfg, device_type, optimizer_state=not gradient_only,
                             sequences_per_forward=run_cfg.batch_size // run_cfg.grad_accum)
    what = "the gradient-only advisor" if gradient_only else "the advisor's reference fine-tune"
    advice = "lower batch_size or seq_len, raise grad_accum" + ("" if gradient_only else ", or use --gradient-only")
    memory.check_fits(needed, device_type, what, advice)
    print(f"advise: {what} needs about {needed.describe()} on {device_type}", flush=True)
    return cfg, run_cfg


def gradient_only(cfg, run_cfg, run_dir: Path) -> None:
    """The step-0 gradient of one batch at c = 1, through the loop's own gradient code, as the histogram
    records the advisor reads (gradscale.optimizer_stats.gradient_records), in run_dir; no optimizer step."""
    import torch
    from omegaconf import OmegaConf

    from gradscale import kernels
    from gradscale.job import build_job
    from gradscale.optimizer_stats import gradient_records
    from gradscale.pretrain import prepare_weights
    from gradscale.train import accumulate_gradients

    job = build_job(run_cfg, source=prepare_weights(run_cfg.model))
    inputs, targets = job.batches.train_batch(0)
    params = [p for p in job.model.parameters() if p.requires_grad]
    with kernels.matmuls(job.bf16_matmul):
        _, num_tokens = accumulate_gradients(job.model, inputs, targets, job.pipeline, job.ranks,
                                             run_cfg.grad_accum, job.autocast, job.device)
    grad_norm, _ = job.pipeline.apply(params, num_tokens, job.ranks)
    records = gradient_records(job.optimizer, {p: n for n, p in job.model.named_parameters()})
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    (run_dir / "adam_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    # the step-0 grad norm before clipping, where a run's would be: the advisor's clipping lines read it
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, GRAD_NORM: grad_norm.item()}) + "\n")
    peak = (torch.cuda.max_memory_allocated(job.device) if job.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"advise: measured peak {'allocated' if job.device.type == 'cuda' else 'resident'} memory "
          f"{peak / 2**30:.3g} GiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="gradscale-advise", description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="examples:\n" + __doc__.split("\n\n")[2])
    parser.add_argument("overrides", nargs="*", help="the run's config overrides (key=value), as for gradscale.run")
    parser.add_argument("--gradient-only", action="store_true",
                        help="predict from one step-0 gradient (no optimizer state, no step) instead of 20 steps")
    parser.add_argument("--world-sizes", help="comma-separated N: the bug's c = 1/N (default 2,4,...,4096)")
    parser.add_argument("--scales", help="comma-separated multipliers c instead, e.g. 1e-4,1e-5")
    parser.add_argument("--eps", type=float, help="predict for this eps (default: the run's optimizer.eps)")
    parser.add_argument("--json", type=Path, help="also write every step's predictions to this file")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the flags
    try:
        overrides, run_dir = reference_overrides(args.overrides)
        check_options(args.world_sizes, args.scales, args.eps, args.json, None)  # before the run, not after
        cfg, run_cfg = preflight(overrides, args.gradient_only)
    except (AdviseError, ConfigError) as e:
        print(e, file=sys.stderr)
        return 2
    if args.gradient_only:
        print(f"advise: the step-0 gradient at c = 1 -> {run_dir}", flush=True)
        gradient_only(cfg, run_cfg, run_dir)
    else:
        print(f"advise: the c = 1 reference fine-tune -> {run_dir}", flush=True)
        done = subprocess.run([sys.executable, "-m", "gradscale.run", *overrides])
        if done.returncode != 0:
            return done.returncode  # the run said why, in one line
        cuda_peak = json.loads((run_dir / "summary.json").read_text()).get("peak_cuda_memory_gib")
        measured = (f"allocated memory {cuda_peak:.3g}" if cuda_peak is not None else "resident memory "
                    f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 2**30:.3g}")
        print(f"advise: the run's measured peak {measured} GiB", flush=True)
    options = [f"--{name.replace('_', '-')}={value}" for name, value in
               (("world_sizes", args.world_sizes), ("scales", args.scales), ("eps", args.eps), ("json", args.json))
               if value is not None]
    # the prediction is the reading side's (gradscale.analysis.advise), in a process of its own: the training
    # side never imports it
    return subprocess.run([sys.executable, "-m", "gradscale.analysis.advise", str(run_dir), *options]).returncode


if __name__ == "__main__":
    sys.exit(main())
