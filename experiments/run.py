"""Entry point: `python -m experiments.run [-m] key=value ...`. Builds, trains, writes results.

    python -m experiments.run -m optimizer=sgd,adamw scale=1,8

Each job's folder (Hydra's output dir) gets metrics.jsonl, summary.json, run.log and .hydra/.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from experiments.config import Config, register_configs, to_object

register_configs()
log = logging.getLogger("gradscale")
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class RunFailed(CompactHydraException):
    """The run started but could not finish; its summary.json says failed, run.log has the traceback."""


def run(cfg: Config, run_dir: Path, run_log) -> dict[str, Any]:
    """Build every component from its own config section, train, and return the summary fields."""
    import torch

    from experiments import data, model, optim
    from experiments.grads import GradPipeline
    from experiments.train import train

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    examples = data.load_examples(cfg.data)
    if cfg.model.path:
        tokenizer = model.load_tokenizer(cfg.model.path)
    else:
        tokenizer = data.build_tokenizer(examples, cfg.data.tokenizer_vocab_size, cfg.data.cache_dir)
    batches = data.build_batches(examples, cfg.data, tokenizer, cfg.seq_len, cfg.batch_size, cfg.seed)
    net = model.build_model(cfg.model, cfg.seed, device)
    optimizer = optim.build_optimizer(cfg.optimizer, [p for p in net.parameters() if p.requires_grad])
    pipeline = GradPipeline(cfg.world_size, cfg.fix, cfg.scale, cfg.clip_grad_norm)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    log.info("%s lr=%g scale=%g fix=%s world_size=%d -> effective gradient multiplier c_eff=%g on %s",
             cfg.optimizer.name, cfg.optimizer.lr, cfg.scale, cfg.fix, cfg.world_size,
             pipeline.effective_scale, device)
    result = train(
        net, optimizer, batches, pipeline, run_log,
        steps=cfg.steps, grad_accum=cfg.grad_accum, log_every=cfg.log_every,
        eval_every=cfg.eval_every, eval_batches=cfg.eval_batches, autocast=autocast, device=device,
    )
    return {**vars(result), "effective_scale": pipeline.effective_scale, "device": str(device)}


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


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> str:
    from experiments.metrics import RunLog, write_json_atomic

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    run_cfg = to_object(cfg)
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    group = run_cfg.wandb.group or (Path(hydra_cfg.sweep.dir).name if multirun else None)
    summary: dict[str, Any] = {
        "status": "failed", "overrides": overrides, "optimizer": run_cfg.optimizer.name,
        "lr": run_cfg.optimizer.lr, "scale": run_cfg.scale, "fix": run_cfg.fix, "world_size": run_cfg.world_size,
        "seed": run_cfg.seed, "versions": versions(), "git_commit": git_commit(),
    }
    started = time.perf_counter()
    run_log = None
    try:
        run_log = RunLog(
            run_dir, run_cfg.wandb, name=hydra_cfg.job.override_dirname or "default", group=group,
            tags=[run_cfg.optimizer.name, f"scale={run_cfg.scale:g}", f"fix={run_cfg.fix}", *run_cfg.wandb.tags],
            config=OmegaConf.to_container(cfg, resolve=True),
        )
        summary.update(run(run_cfg, run_dir, run_log))
    except Exception as e:
        log.exception("run failed")
        summary["error"] = f"{type(e).__name__}: {e}"
        message = str(e) if str(e).startswith("error:") else f"error: run failed: {type(e).__name__}: {e}"
        raise RunFailed(f"{message} ({run_dir})") from e
    finally:
        summary["wall_s"] = time.perf_counter() - started
        if run_log is not None:
            run_log.finish(summary)
        else:
            write_json_atomic(run_dir / "summary.json", summary)
        log.info("%s: %s (%.1f s) -> %s", summary["status"], summary.get("final_loss"), summary["wall_s"], run_dir)
    return summary["status"]


if __name__ == "__main__":
    main()
