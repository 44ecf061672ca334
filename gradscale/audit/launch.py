"""Running the audit: one launch of N real gloo ranks per world size, every target and accumulation inside it."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gradscale.audit.batch import batch_size_for, counts_of, global_batch, layout
from gradscale.audit.compare import TOLERANCE, Result, compare, reference_gradient
from gradscale.audit.contract import AuditError, World
from gradscale.audit.targets import resolve_target

ALLOWED_SIZES = (1, 2, 4, 8)  # powers of two: one global batch divides into every layout


def _rank_main(rank: int, world_size: int, port: int, jobs: list[tuple[str, int]], work: str,
               timeout_s: float) -> None:
    """One real rank: each job's (target, K) step, each on freshly loaded weights. A step that raises ends
    the launch (its peers may wait in a collective it never joins); the audit relaunches the jobs left."""
    work_dir = Path(work)
    log_fd = os.open(work_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)  # the frameworks' own output goes to the rank's log
    os.dup2(log_fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    input_ids, labels = torch.load(work_dir.parent / "batch.pt")
    for target, k in jobs:
        key = job_key(target, k)
        model = AutoModelForCausalLM.from_pretrained(work_dir.parent / "model", dtype=torch.float32)
        model.train()
        micro_batches = [{"input_ids": input_ids[idx], "labels": labels[idx]}
                         for idx in layout(counts_of(labels), world_size, k)[rank]]
        try:
            logged = resolve_target(target)(model, micro_batches, World(rank, world_size, k))
        except Exception as e:
            (work_dir / f"{key}-rank{rank}.error").write_text(f"{type(e).__name__}: {e}".splitlines()[0])
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # at once: peers blocked in a collective with this rank see it gone and stop too
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().cpu()
        torch.save({"grads": grads, "logged": None if logged is None else float(logged)},
                   work_dir / f"{key}-rank{rank}.pt")
    with contextlib.suppress(Exception):
        dist.barrier()
    dist.destroy_process_group()


def all_saved(launch_dir: Path, job: tuple[str, int], n: int) -> bool:
    return all((launch_dir / f"{job_key(*job)}-rank{r}.pt").exists() for r in range(n))


def job_key(target: str, k: int) -> str:
    return f"{''.join(ch if ch.isalnum() else '_' for ch in target)}-k{k}"




def audit(target: str, world_sizes: Sequence[int] = (1, 2, 4), accumulations: Sequence[int] = (1, 4),
          tolerance: float = TOLERANCE, timeout_s: float = 120.0,
          progress: Callable[[str], None] | None = None) -> list[Result]:
    """Every (N, K) of the grid against the reference; one Result each, in grid order."""
    return audit_many([target], world_sizes, accumulations, tolerance, timeout_s, progress)[target]


def audit_many(targets: Sequence[str], world_sizes: Sequence[int] = (1, 2, 4), accumulations: Sequence[int] = (1, 4),
               tolerance: float = TOLERANCE, timeout_s: float = 120.0,
               progress: Callable[[str], None] | None = None) -> dict[str, list[Result]]:
    """audit() for several targets, all of them inside one launch of N ranks per world size."""
    import torch.multiprocessing as mp
    from transformers.utils import logging as hf_logging

    from gradscale.hydra_glue import compose, to_object
    from gradscale.model import build_model
    from gradscale.parallel import free_port

    check_grid(world_sizes, accumulations, tolerance)
    for target in targets:
        resolve_target(target)  # a bad target fails here, before any rank starts
    say = progress or (lambda message: None)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its notes on stopping ranks
    hf_logging.disable_progress_bar()
    cfg = to_object(compose(["model.init=random"]))
    input_ids, labels = global_batch(cfg.model.vocab_size, batch_size_for(world_sizes, accumulations))
    counts = counts_of(labels)
    results: dict[str, list[Result]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory(prefix="gradscale-audit-") as work:
        work_dir = Path(work)
        model = build_model(cfg.model, cfg.seed, torch.device("cpu"))
        model.save_pretrained(work_dir / "model")
        torch.save((input_ids, labels), work_dir / "batch.pt")
        reference = reference_gradient(model, input_ids, labels)
        for n in world_sizes:
            started = time.monotonic()
            what = targets[0] if len(targets) == 1 else f"{len(targets)} targets"
            say(f"audit {what}: {n} rank{'s' if n > 1 else ''} (gloo), K = {', '.join(map(str, accumulations))} "
                f"(about {5 + 2 * n + len(targets) * len(accumulations) * n // 2} s on 2 cores) ...")
            launch_dir = work_dir / f"n{n}"
            launch_dir.mkdir()
            pending = [(t, k) for t in targets for k in accumulations]
            failures: dict[tuple[str, int], str] = {}
            while pending:
                try:
                    mp.spawn(_rank_main, args=(n, free_port(), pending, str(launch_dir), timeout_s),
                             nprocs=n, join=True)
                except Exception as e:  # a step raised (its error file says why) or a rank died
                    done = 0  # the jobs every rank saved, in order
                    while done < len(pending) and all_saved(launch_dir, pending[done], n):
                        done += 1
                    if done == len(pending):  # every step saved; a rank failed only at teardown
                        break
                    first = pending[done]
                    # the first rank to fail says why; its peers only saw it go
                    errors = sorted(launch_dir.glob(f"{job_key(*first)}-rank*.error"), key=lambda f: f.stat().st_mtime)
                    failures[first] = (errors[0].read_text() if errors else
                                       (str(e).strip().splitlines() or [type(e).__name__])[-1])
                    if errors:  # its traceback, from the rank's log (the folder goes when the audit ends)
                        rank_log = launch_dir / f"rank{errors[0].stem.rsplit('rank', 1)[1]}.log"
                        tail = rank_log.read_text(errors="replace").strip().splitlines()[-8:]
                        say(f"  {first[0]} (K = {first[1]}) failed on {errors[0].stem.rsplit('-', 1)[1]}:\n    "
                            + "\n    ".join(tail))
                    for r in range(n):  # a partial save of the failed job is not a result
                        (launch_dir / f"{job_key(*first)}-rank{r}.pt").unlink(missing_ok=True)
                    pending = pending[done + 1:]
                    continue
                pending = []
            for t in targets:
                for k in accumulations:
                    tokens = [[sum(counts[i] for i in mb) for mb in rank] for rank in layout(counts, n, k)]
                    result = Result(n, k, tokens, len(counts))
                    saved = [launch_dir / f"{job_key(t, k)}-rank{r}.pt" for r in range(n)]
                    if (t, k) in failures or not all(p.exists() for p in saved):
                        result.reasons.append(f"the step failed: {failures.get((t, k), 'a rank stopped')}")
                    else:
                        loaded = [torch.load(p) for p in saved]
                        compare(result, [x["grads"] for x in loaded], [x["logged"] for x in loaded], reference,
                                tolerance)
                    results[t].append(result)
            say(f"  done in {time.monotonic() - started:.0f} s")
    for t in targets:  # grid order: N, then K
        results[t].sort(key=lambda r: (r.world_size, r.accumulation))
    return results


def check_grid(world_sizes: Sequence[int], accumulations: Sequence[int], tolerance: float) -> None:
    for flag, values in (("--world-sizes", world_sizes), ("--accumulation", accumulations)):
        bad = [v for v in values if v not in ALLOWED_SIZES]
        if len(set(values)) < len(values):
            raise AuditError(f"error: {flag} {','.join(map(str, values))}: each value once")
        if bad or not values:
            raise AuditError(f"error: {flag} {','.join(map(str, values))}: each must be one of "
                             f"{', '.join(map(str, ALLOWED_SIZES))}")
    if not (0 < tolerance < 1):
        raise AuditError(f"error: --tolerance {tolerance}: must be in (0, 1)")
