"""Entry point: `python -m experiments.run [-m] key=value ...`. Builds, trains, writes results.

    python -m experiments.run -m optimizer=sgd,adamw scale=1,8

Each job's folder (Hydra's output dir) gets metrics.jsonl, summary.json, run.log and .hydra/.
"""

from __future__ import annotations

import contextlib
import ctypes
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

from experiments.config import Config, refuse_unknown_keys, register_configs, to_object

register_configs()
log = logging.getLogger("gradscale")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class RunFailed(CompactHydraException):
    """The run started but could not finish; its summary.json says failed, run.log has the traceback."""


class Terminated(BaseException):
    """SIGTERM (torchrun stops every rank when one fails): not an Exception, so a sweep stops too."""


def _raise_terminated(signum, frame):
    raise Terminated(f"terminated by signal {signum}")


def run(cfg: Config, run_log, overrides: list[str], run_dir: Path | None = None) -> dict[str, Any]:
    """Build every component from its own config section, train, and return the summary fields.

    run_dir: where checkpoints go (every cfg.checkpoint_every steps); a checkpoint there is resumed from."""
    import torch

    from experiments import checkpoint, data, model, optim, parallel, weights
    from experiments.config import resolve_world_size
    from experiments.grads import GradPipeline
    from experiments.train import train

    device = parallel.device_for(cfg.device)
    world_size = resolve_world_size(cfg.world_size, overrides)
    ranks = parallel.setup(cfg.dist.strategy, world_size, cfg.dist.timeout_s, device)
    if device.type == "cuda":  # a sweep's jobs share the process: each reports its own peak
        torch.cuda.reset_peak_memory_stats(device)
    examples = data.load_examples(cfg.data)
    source = weights.checkpoint_dir(cfg.model)  # fetched, converted or pretrained first when not cached
    if source:
        tokenizer = model.load_tokenizer(source)
    else:
        tokenizer = data.build_tokenizer(examples, cfg.data.tokenizer_vocab_size, cfg.data.cache_dir)
    batches = data.build_batches(examples, cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)
    net = model.apply_finetune(model.build_model(cfg.model, cfg.seed, device, source), cfg.finetune)
    net = parallel.wrap(net, ranks)
    if cfg.compile:
        net = torch.compile(net)
    optimizer = optim.build_optimizer(cfg.optimizer, [p for p in net.parameters() if p.requires_grad])
    pipeline = GradPipeline(ranks.world_size, cfg.fix, cfg.scale, cfg.clip_grad_norm, cfg.normalization.name,
                            cfg.grad_accum)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    log.info("%s (%s) lr=%g scale=%g normalization=%s world_size=%d (%s) -> c_eff=%g on %s",
             cfg.optimizer.name, cfg.finetune.name, cfg.optimizer.lr, cfg.scale, pipeline.recipe_in_effect,
             ranks.world_size, f"{cfg.dist.strategy} ranks" if ranks.real else "emulated", pipeline.effective_scale,
             device)
    checkpoint_every = cfg.checkpoint_every if run_dir is not None else None
    start = checkpoint.load(run_dir, net, optimizer, ranks) if checkpoint_every else None
    if run_log is not None:  # drop what a killed run logged after its checkpoint (all of it, without one)
        run_log.rewind(start.next_step if start else 0)
    result = train(
        net, optimizer, batches, pipeline, run_log, ranks,
        steps=cfg.steps, grad_accum=cfg.grad_accum, log_every=cfg.log_every,
        eval_every=cfg.eval_every, eval_batches=cfg.eval_batches, adam_stats_every=cfg.adam_stats_every,
        autocast=autocast, device=device, start=start, checkpoint_every=checkpoint_every, run_dir=run_dir,
    )
    if checkpoint_every:
        checkpoint.remove(run_dir, ranks)
    return {**vars(result), "resumed_from_step": start.next_step if start else None,
            "effective_scale": pipeline.effective_scale, "device": str(device),
            "world_size": ranks.world_size, "ranks": f"{cfg.dist.strategy}" if ranks.real else "emulated",
            "normalization": pipeline.recipe_in_effect,
            "peak_cuda_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def share_cores(hydra_cfg) -> None:
    """Jobs run side by side (hydra/launcher=local_parallel, joblib) get cores / n_jobs threads each:
    two jobs with all cores' threads each would fight over them (several times slower on 2 cores)."""
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs", default=None)
    if n_jobs is None or "OMP_NUM_THREADS" in os.environ:  # not parallel, or the user chose
        return
    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // (cores if n_jobs < 1 else n_jobs)))


# glibc's own settings, when the user gave any: they win over keep_freed_memory
GLIBC_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                    "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h


def keep_freed_memory() -> bool:
    """Keep freed CPU memory in the process instead of handing it back to the OS.

    glibc returns large freed blocks (munmap, heap trimming), so each step page-faults its activations,
    logits and gradients in again: the default CPU run spent 16.3 s of CPU time in the kernel for 7.9M
    page faults, and took twice as long (docs/performance.md). No mmap'd chunks and no trimming keep
    that memory for the next step, as PyTorch's caching allocator does on GPUs. Linux with glibc only,
    and not when the user set glibc's malloc variables; returns whether it applied."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in GLIBC_MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc
        return False


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


@hydra.main(version_base="1.3", config_path=str(PROJECT_ROOT / "conf"), config_name="config")
def main(cfg: DictConfig) -> str:
    from experiments.metrics import RunLog, write_json_atomic
    from experiments.parallel import adopt_slurm_tasks, env_rank

    adopt_slurm_tasks()
    keep_freed_memory()
    share_cores(HydraConfig.get())
    signal.signal(signal.SIGTERM, _raise_terminated)
    is_main = env_rank() == 0  # under torchrun only rank 0 writes metrics, summary and W&B
    if not is_main:
        for handler in logging.getLogger().handlers:  # console: rank 0 speaks for all; files keep all
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    run_cfg = to_object(cfg)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    group = run_cfg.wandb.group or (Path(hydra_cfg.sweep.dir).name if multirun else None)
    summary: dict[str, Any] = {
        "status": "failed", "overrides": overrides, "optimizer": run_cfg.optimizer.name,
        "finetune": run_cfg.finetune.name, "lr": run_cfg.optimizer.lr, "scale": run_cfg.scale, "fix": run_cfg.fix,
        "world_size": run_cfg.world_size, "seed": run_cfg.seed, "versions": versions(), "git_commit": git_commit(),
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
        summary.update(run(run_cfg, run_log, overrides, run_dir))
    except Terminated as e:
        summary["error"] = str(e)
        raise
    except Exception as e:
        log.exception("run failed")
        summary["error"] = f"{type(e).__name__}: {e}"
        message = str(e) if str(e).startswith("error:") else f"error: run failed: {type(e).__name__}: {e}"
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


if __name__ == "__main__":
    refuse_unknown_keys()
    main()
