"""The suite's own pretrained base: so that the default tiny model runs a *fine-tune*, not pretraining.

    python -m gradscale.pretrain [model=llama3_2_tiny] [model.pretrain.steps=...]   # build it now

The corpus is the docstrings of the Python standard library (modules, classes, functions), read from
the source files with `ast`, never imported; on every machine, no download, and not the fine-tune data
(`pydoc_data`, the reference text the default fine-tune trains on, is left out). A byte-level BPE
tokenizer of `model.vocab_size` is trained on it, then the model at the config's dimensions is trained
with AdamW on packed sequences, through the suite's own loop (`gradscale.train.train`, one device).

The result is a checkpoint directory (weights, config, tokenizer, and the base's own `metrics.jsonl`:
its loss curve) under the cache dir, named by a digest of everything it depends on: the architecture,
`model.pretrain`, the corpus files' bytes, and the package versions. Deterministic for a seed on one
machine (built on all its cores, whatever OMP_NUM_THREADS says); built on first use with progress lines;
later runs load it (about half a second).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gradscale.checks import CommandParser

if TYPE_CHECKING:
    from gradscale.weights import Base

log = logging.getLogger(__name__)


# A run builds a missing base only when that takes less than this (measured on a step first); a longer build is
# asked for explicitly: python -m gradscale.pretrain.
LONGEST_UNASKED_BUILD_S = 300


def pretrained_base(model_cfg, asked: bool = False) -> Path:
    """The base's checkpoint directory (weights.base_dir), built first if it is not cached. asked: the user
    asked for the build itself (python -m gradscale.pretrain), so a long one goes ahead."""
    return base_entry(model_cfg, asked)[0]


def base_entry(model_cfg, asked: bool = False) -> tuple[Path, bool]:
    """pretrained_base's directory, and whether it was found built (False: built now)."""
    from gradscale.cache import build_lock
    from gradscale.weights import base_dir

    target = base_dir(model_cfg)
    if (target / "config.json").is_file():
        return target, True
    with build_lock(target):
        if (target / "config.json").is_file():  # built by another job while this one waited
            return target, True
        build_base(model_cfg, target, None if asked else LONGEST_UNASKED_BUILD_S)
    return target, False


def prepare_base(model_cfg) -> Base:
    """Where a run's weights come from, resolved once, where the run starts and before its job is built, in one
    pass (the first that is set wins; gradscale/weights.py has the sources' details):
    1. model.path: the user's directory, as it is;
    2. model.gguf_file: the GGUF file converted once into a cached directory (fetched first from its package);
    3. model.init=pretrained: the suite's base, built here when it is not cached;
    4. model.init=random: no directory, a seeded random init.
    The run hands the directory to build_job, which then looks nothing up."""
    from gradscale.weights import Base, gguf_entry

    if model_cfg.path:
        return Base("path", model_cfg.path)
    if model_cfg.gguf_file:
        directory, found = gguf_entry(model_cfg)
        return Base("gguf", str(directory), found)
    if model_cfg.init == "pretrained":
        directory, found = base_entry(model_cfg)
        return Base("pretrained", str(directory), found)
    return Base("random", None)


def prepare_weights(model_cfg) -> str | None:
    """prepare_base's checkpoint directory (None: random init)."""
    return prepare_base(model_cfg).directory


@contextlib.contextmanager
def all_cores():
    """The build on every core, whatever OMP_NUM_THREADS or the process set: the thread count changes the
    summation order, so a base built with 1 thread (a parallel sweep's jobs) and one with 2 (a single run) had
    different bits under one cache key. A parallel sweep's other job waits on the build lock meanwhile."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def seconds_per_step(net, batches, lr: float) -> float:
    """One pretraining step (forward, backward, AdamW) of a copy of net: the fastest of two, after two warm-up
    steps (the first ones pay for allocations and thread start-up, 10x a step on the tiny model)."""
    import copy
    import time

    import torch

    from gradscale.grads import token_losses

    trial = copy.deepcopy(net)
    optimizer = torch.optim.AdamW(trial.parameters(), lr=lr)
    took = []
    with all_cores():
        for step in range(4):
            started = time.perf_counter()
            inputs, targets = batches.train_batch(step)
            token_losses(trial(input_ids=inputs).logits, targets).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            took.append(time.perf_counter() - started)
    return min(took[2:])


def build_base(model_cfg, target: Path, longest_s: float | None = None) -> None:
    """Pretrain the base through the suite's own job builder and loop, on one device. longest_s: refuse (one
    line naming the command that builds it) when the measured estimate is longer."""
    import torch
    from transformers.utils import logging as hf_logging

    from gradscale import data, model, weights
    from gradscale.cache import publish
    from gradscale.config import WandbConfig
    from gradscale.grads import GradPipeline
    from gradscale.job import assemble_job
    from gradscale.metrics import RunLog
    from gradscale.optimizers.adamw import AdamWConfig
    from gradscale.parallel import Ranks
    from gradscale.train import LoopConfig, train

    pre = model_cfg.pretrain
    log.info("building the pretrained base for model=%s (%d steps; once, then cached) -> %s",
             model_cfg.name, pre.steps, target)
    files = data.stdlib_files()
    texts = [d.text for d in data.stdlib_docstrings(files)]
    log.info("corpus: %d docstrings, %.2fM characters, from %d standard-library files",
             len(texts), sum(map(len, texts)) / 1e6, len(files))
    tokenizer = data.train_bpe(texts, model_cfg.vocab_size, model_cfg.cache_dir)
    encoded = [(ids, [True] * len(ids)) for ids in
               ([tokenizer.bos_token_id, *row, tokenizer.eos_token_id]
                for row in tokenizer(texts, add_special_tokens=False)["input_ids"])]
    held_out = max(1, len(encoded) // 50)  # every 50th docstring: the base's own eval loss
    split = [data.to_sequences(part, pre.seq_len, packed=True, pad_id=tokenizer.pad_token_id)
             for part in ([e for i, e in enumerate(encoded) if i % 50], encoded[::50][:held_out])]
    batches = data.Batches(*split, pre.batch_size, pre.seed)
    log.info("pretraining on %d sequences of %d tokens (%.1f epochs)", len(split[0]), pre.seq_len,
             pre.steps * pre.batch_size / len(split[0]))

    net = model.build_model(model_cfg, pre.seed, torch.device("cpu"))  # the seeded random init
    step_s = seconds_per_step(net, batches, pre.lr)
    estimate = step_s * pre.steps * 1.1  # and its evals
    shape = (f"hidden {model_cfg.hidden_size}, {model_cfg.num_hidden_layers} layers, "
             f"{sum(p.numel() for p in net.parameters()) / 1e6:.2f}M parameters")
    if longest_s is not None and estimate > longest_s:
        raise weights.WeightsError(
            f"error: the pretrained base for model={model_cfg.name} ({shape}) is not built and would take about "
            f"{estimate / 60:.0f} min here ({pre.steps} steps at {step_s:.2f} s, measured): build it first with "
            "python -m gradscale.pretrain and the same model overrides, or start from model.init=random")
    log.info("building the base (%s): about %.0f s (%d steps at %.3f s, measured)", shape, estimate, pre.steps,
             step_s)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    run_log = RunLog(tmp, WandbConfig(mode="disabled"), name="pretrain", group=None, tags=[], config={})
    job = assemble_job(net, AdamWConfig(lr=pre.lr, weight_decay=0.1), batches, GradPipeline(world_size=1, scale=1.0),
                       Ranks(world_size=1), torch.device("cpu"), precision="fp32", buckets=False)
    loop = LoopConfig(steps=pre.steps, log_every=max(1, pre.steps // 20), eval_every=max(1, pre.steps // 5),
                      eval_batches=4, adam_stats_every=None)
    with all_cores():
        result = train(job, loop, run_log)
    run_log.finish({"status": result.status, "final_loss": result.final_loss,
                    "best_eval_loss": result.best_eval_loss, "steps_done": result.steps_done})
    if result.status != "completed":
        raise weights.WeightsError(f"error: pretraining the base diverged at step {result.diverged_at_step} "
                                   f"(model.pretrain.lr={pre.lr} is too high)")
    hf_logging.disable_progress_bar()  # the progress lines above say enough
    net.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights.record_build(tmp)
    publish(tmp, target)
    log.info("pretrained base: train loss %.3f, eval loss %.3f -> %s", result.final_loss, result.best_eval_loss,
             target)


# what each key of model.pretrain sets (gradscale.config.PretrainConfig has the defaults)
RECIPE_KEYS = {"steps": "AdamW steps", "lr": "AdamW's learning rate", "batch_size": "packed sequences per step",
               "seq_len": "tokens per sequence", "seed": "initial weights and batch order"}


def build_parser() -> argparse.ArgumentParser:
    from dataclasses import fields

    from gradscale.config import PretrainConfig

    keys = [f"  model.pretrain.{f.name}={f.default:g}".ljust(34) + RECIPE_KEYS[f.name] for f in fields(PretrainConfig)]
    parser = CommandParser(
        prog="python -m gradscale.pretrain", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build the suite's own pretrained base for the model these overrides compose (the one a run\n"
                    "with model.init=pretrained fine-tunes), or find it in the cache, and print its directory.",
        epilog="the base's recipe (defaults; a model preset may set its own):\n" + "\n".join(keys) +
               "\n\nexample: python -m gradscale.pretrain model=llama3_2_tiny model.pretrain.steps=300")
    parser.add_argument("overrides", nargs="*",
                        help="config overrides (key=value) as for gradscale-run: model=... and model.* "
                             "choose the architecture, model.pretrain.* the recipe")
    return parser


def main(argv: list[str]) -> int:
    """Build (or find) the base for the config these overrides compose, and print its directory."""
    from gradscale.checks import ConfigError
    from gradscale.config import validate
    from gradscale.hydra_glue import compose_checked, refuse_unknown_keys, to_object

    argv = build_parser().parse_intermixed_args(argv).overrides
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s", stream=sys.stderr)
    from gradscale.cache import keep_freed_memory

    keep_freed_memory()
    try:
        refuse_unknown_keys()  # `nope=1`, `+stpes=10`: one line naming the key, as for gradscale-run
        cfg = compose_checked(argv)
        validate(cfg, argv)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    model_cfg = to_object(cfg).model
    if model_cfg.path or model_cfg.gguf_file:
        print("error: model.init=pretrained builds the suite's own base; this model loads its weights from "
              "model.path or model.gguf_file", file=sys.stderr)
        return 2
    print(pretrained_base(model_cfg, asked=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
