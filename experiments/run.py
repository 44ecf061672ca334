"""Entry point: `python -m experiments.run [-m] key=value ...`. Builds, trains, writes results.

    python -m experiments.run -m optimizer=sgd,adamw scale=1,8

Each job's folder (Hydra's output dir) gets metrics.jsonl, summary.json, run.log and .hydra/.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from experiments.config import Config
from experiments.hydra_glue import refuse_unknown_keys, register_configs, to_object, unknown_option_problem

register_configs()
log = logging.getLogger("gradscale")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class RunFailed(CompactHydraException):
    """The run started but could not finish; its summary.json says failed, run.log has the traceback."""


class Terminated(BaseException):
    """SIGTERM (torchrun stops every rank when one fails): not an Exception, so a sweep stops too."""


def _raise_terminated(signum, frame):
    raise Terminated(f"terminated by signal {signum}")


def share_cores(hydra_cfg) -> None:
    """Jobs run side by side (hydra/launcher=local_parallel, joblib) get cores / n_jobs threads each:
    two jobs with all cores' threads each would fight over them (several times slower on 2 cores)."""
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs", default=None)
    if n_jobs is None or "OMP_NUM_THREADS" in os.environ:  # not parallel, or the user chose
        return
    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // (cores if n_jobs < 1 else n_jobs)))


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The run folder's summary.json ({} when there is none, or it cannot be read)."""
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("gradscale", "torch", "transformers", "tokenizers", "hydra-core", "wandb"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def run_job(cfg: Config, run_log, overrides: list[str] = (), run_dir: Path | None = None) -> dict[str, Any]:
    """Check the config, build the job, train it, and return the summary fields.

    overrides: the job's command-line overrides (an explicit world_size must agree with torchrun's).
    run_dir: where checkpoints go (every cfg.checkpoint_every steps); a checkpoint there is resumed from."""
    import torch

    from experiments import checkpoint, kernels
    from experiments.config import resolve_world_size, validate
    from experiments.job import build_job
    from experiments.pretrain import prepare_weights
    from experiments.probes import check_environment
    from experiments.train import LoopConfig, train

    validate(cfg, list(overrides))
    check_environment(cfg)
    prepare_weights(cfg.model)  # fetched, converted or pretrained first when not cached
    job = build_job(cfg, resolve_world_size(cfg.world_size, list(overrides)))
    ranks, pipeline = job.ranks, job.pipeline
    log.info("%s (%s) lr=%g scale=%g normalization=%s world_size=%d (%s) -> c_eff=%g on %s",
             cfg.optimizer.name, cfg.finetune.name, cfg.optimizer.lr, cfg.scale, pipeline.recipe,
             ranks.world_size, f"{cfg.dist.strategy} ranks" if ranks.real else "emulated", pipeline.c_eff,
             job.device)
    checkpointer = (checkpoint.Checkpointer(run_dir, cfg.checkpoint_every, ranks)
                    if run_dir is not None and cfg.checkpoint_every else None)
    matmuls = kernels.resolve(cfg.bf16_matmul, cfg.precision, job.device)
    if matmuls == "fp32":
        log.info("bf16 matmuls by fp32 kernels on bf16 operands (experiments/kernels.py): this CPU's bf16 kernels "
                 "are %.0f times slower", kernels.bf16_slowdown())
    with kernels.context(matmuls):
        result = train(job, LoopConfig.of(cfg), run_log, checkpointer)
    if checkpointer is not None:
        checkpointer.remove()
    return {**vars(result), "c_eff": pipeline.c_eff, "device": str(job.device),
            "world_size": ranks.world_size, "ranks": f"{cfg.dist.strategy}" if ranks.real else "emulated",
            "normalization": pipeline.recipe, "bf16_matmul": matmuls,
            "peak_cuda_memory_gib": (torch.cuda.max_memory_allocated(job.device) / 2**30
                                     if job.device.type == "cuda" else None)}


def setup_process(hydra_cfg) -> bool:
    """What the process needs before its first job; returns whether it is rank 0, the one that writes
    metrics, summary and W&B (under torchrun; always, when the ranks are emulated)."""
    from experiments.cache import keep_freed_memory
    from experiments.parallel import adopt_slurm_tasks, env_rank

    adopt_slurm_tasks()  # srun's tasks as torchrun ranks
    keep_freed_memory()
    share_cores(hydra_cfg)
    signal.signal(signal.SIGTERM, _raise_terminated)
    is_main = env_rank() == 0
    if not is_main:
        for handler in logging.getLogger().handlers:  # console: rank 0 speaks for all; files keep all
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    return is_main


def run_folder_job(cfg: DictConfig, hydra_cfg, is_main: bool) -> str:
    """One job in its folder: skipped when it finished before, else run (a killed run resumes from its
    checkpoint); summary.json says how it ended, also when it failed. Returns the status."""
    from experiments.metrics import RunLog, write_json_atomic

    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    run_cfg = to_object(cfg)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    group = run_cfg.wandb.group or (Path(hydra_cfg.sweep.dir).name if multirun else None)
    summary: dict[str, Any] = {
        "status": "failed", "overrides": overrides, "optimizer": run_cfg.optimizer.name,
        "finetune": run_cfg.finetune.name, "lr": run_cfg.optimizer.lr, "scale": run_cfg.scale, "fix": run_cfg.fix,
        "normalization": run_cfg.normalization.name, "world_size": run_cfg.world_size, "seed": run_cfg.seed,
        "versions": versions(), "git_commit": git_commit(),
    }
    previous = read_summary(run_dir)
    if previous.get("status") in ("completed", "diverged"):  # a re-run sweep: this job is done already
        log.info("%s: already %s, skipped -> %s", hydra_cfg.job.override_dirname or "run", previous["status"],
                 run_dir)
        return previous["status"]
    if previous and is_main:  # failed before: it runs again, and no stale summary stands meanwhile
        (run_dir / "summary.json").unlink()
    started = time.perf_counter()
    run_log = None
    try:
        if is_main:
            run_log = RunLog(
                run_dir, run_cfg.wandb, name=hydra_cfg.job.override_dirname or "default", group=group,
                tags=[run_cfg.optimizer.name, f"scale={run_cfg.scale:g}", f"fix={run_cfg.fix}", *run_cfg.wandb.tags],
                config=OmegaConf.to_container(cfg, resolve=True),
            )
        summary.update(run_job(run_cfg, run_log, overrides, run_dir))
    except Terminated as e:
        summary["error"] = str(e)
        raise
    except Exception as e:
        said = str(e).startswith("error:")  # a one-line refusal of the suite's own: no traceback to add
        if said:
            log.error("run failed: %s", e)
        else:
            log.exception("run failed")
        summary["error"] = f"{type(e).__name__}: {e}"
        message = str(e) if said else f"error: run failed: {type(e).__name__}: {e}"
        if not multirun:  # one line and a non-zero exit (Hydra would add a hint line); the summary still lands
            print(f"{message} ({run_dir})", file=sys.stderr, flush=True)
            sys.exit(1)
        raise RunFailed(f"{message} ({run_dir})") from e  # the sweeper records it and runs the other jobs
    finally:
        summary["wall_s"] = time.perf_counter() - started
        if run_log is not None:
            run_log.finish(summary)
        elif is_main:
            write_json_atomic(run_dir / "summary.json", summary)
        log.info("%s: %s (%.1f s) -> %s", summary["status"], summary.get("final_loss"), summary["wall_s"], run_dir)
    return summary["status"]


@hydra.main(version_base="1.3", config_path=str(PROJECT_ROOT / "conf"), config_name="config")
def main(cfg: DictConfig) -> str:
    hydra_cfg = HydraConfig.get()
    return run_folder_job(cfg, hydra_cfg, setup_process(hydra_cfg))


if __name__ == "__main__":
    if not sys.stderr.isatty():  # progress bars in a log file are one line of carriage returns
        os.environ.setdefault("TQDM_DISABLE", "1")  # read by tqdm when it is imported, which comes later
    if problem := unknown_option_problem(sys.argv[1:]):
        print(problem, file=sys.stderr)
        sys.exit(2)
    refuse_unknown_keys()
    main()
