"""`python -m experiments.advise [key=value ...] [--world-sizes N,..] [--scales c,..] [--eps E] [--json FILE]`

The risk advisor for your own model: runs the short c = 1 reference fine-tune it needs, through the same
entry point and config keys as any run (`model.path=DIR`, `data=...`, `optimizer.eps=...`; `steps=20`
unless given), with sqrt(v_hat) histograms on every step, then prints what a gradient multiplier c = 1/N
would do to AdamW's update at each world size N (`python -m analysis.advise` on that run folder).

    python -m experiments.advise model=smollm2_135m
    python -m experiments.advise model.path=/models/Llama-3.2-3B --world-sizes 8,64,512
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from experiments.checks import override_key
from experiments.optimizers import advisable

DEFAULT_STEPS = 20
# what makes the run the advisor's reference: c = 1, records on every step
FIXED_KEYS = {"scale": "1", "fix": "true"}


class AdviseError(Exception):
    """Bad input: one line, exit 2, before anything runs."""


def reference_overrides(overrides: list[str]) -> tuple[list[str], Path]:
    """The run's overrides (the user's, then the advisor's defaults and fixed keys) and its folder."""
    keys = {override_key(o): o.split("=", 1)[1] if "=" in o else "" for o in overrides}
    if "-m" in overrides or "--multirun" in overrides:
        raise AdviseError("error: experiments.advise runs one reference fine-tune, not a sweep: drop -m")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.advise", description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="examples:\n" + __doc__.split("\n\n")[2])
    parser.add_argument("overrides", nargs="*", help="the run's config overrides (key=value), as for experiments.run")
    parser.add_argument("--world-sizes", help="comma-separated N: the bug's c = 1/N (default 2,4,...,4096)")
    parser.add_argument("--scales", help="comma-separated multipliers c instead, e.g. 1e-4,1e-5")
    parser.add_argument("--eps", type=float, help="predict for this eps (default: the run's optimizer.eps)")
    parser.add_argument("--json", type=Path, help="also write every step's predictions to this file")
    args = parser.parse_args(argv)
    from analysis import advise

    try:
        overrides, run_dir = reference_overrides(args.overrides)
        advise.check_options(args.world_sizes, args.scales, args.eps, args.json, None)  # before the run, not after
    except (AdviseError, advise.AdviseError) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"advise: the c = 1 reference fine-tune -> {run_dir}", flush=True)
    done = subprocess.run([sys.executable, "-m", "experiments.run", *overrides])
    if done.returncode != 0:
        return done.returncode  # the run said why, in one line
    options = [f"--{name.replace('_', '-')}={value}" for name, value in
               (("world_sizes", args.world_sizes), ("scales", args.scales), ("eps", args.eps), ("json", args.json))
               if value is not None]
    return advise.main([str(run_dir), *options])


if __name__ == "__main__":
    sys.exit(main())
