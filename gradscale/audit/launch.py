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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from gradscale.audit.batch import batch_size_for, counts_of, global_batch, layout
from gradscale.audit.compare import TOLERANCE, Result, compare
from gradscale.audit.contract import AuditError, World
from gradscale.audit.models import resolve_model, vocab_size_of
from gradscale.audit.targets import resolve_target

ALLOWED_SIZES = (1, 2, 4, 8)  # powers of two: one global batch divides into every layout


def _rank_main(rank: int, world_size: int, port: int, jobs: list[tuple[str, int]], work: str,
               timeout_s: float, model_spec: str | None) -> None:
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
        if model_spec is None:
            model = AutoModelForCausalLM.from_pretrained(work_dir.parent / "model", dtype=torch.float32)
        else:  # the user's factory, then the parent's weights: identical on every rank whatever it draws
            model = resolve_model(model_spec)().float()
            model.load_state_dict(torch.load(work_dir.parent / "model.pt"))
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




REFERENCES = ("objective", "layout")  # --reference: the declared objective's gradient, or the step's own at N=1, K=1


def audit(target: str, world_sizes: Sequence[int] = (1, 2, 4), accumulations: Sequence[int] = (1, 4),
          tolerance: float = TOLERANCE, timeout_s: float = 120.0,
          progress: Callable[[str], None] | None = None, objective: str = "token-mean",
          reference: str = "objective", model_spec: str | None = None) -> list[Result]:
    """Every (N, K) of the grid against the reference; one Result each, in grid order."""
    return audit_many([target], world_sizes, accumulations, tolerance, timeout_s, progress, objective,
                      reference, model_spec)[target]


def audit_many(targets: Sequence[str], world_sizes: Sequence[int] = (1, 2, 4), accumulations: Sequence[int] = (1, 4),
               tolerance: float = TOLERANCE, timeout_s: float = 120.0,
               progress: Callable[[str], None] | None = None, objective: str | Mapping[str, str] = "token-mean",
               reference: str = "objective", model_spec: str | None = None) -> dict[str, list[Result]]:
    """audit() for several targets, all of them inside one launch of N ranks per world size. objective: one for
    every target, or one per target. reference "layout": each row against the step's own N = 1, K = 1 gradient
    (any objective passes that does not depend on how the batch is split). model_spec: the user's
    module:factory (gradscale.audit.models), default the suite's tiny Llama."""
    import torch.multiprocessing as mp
    from transformers.utils import logging as hf_logging

    from gradscale.audit.objectives import OBJECTIVES, SUSPECTS, slot_weights, trained_mask, weighted_gradients
    from gradscale.audit.objectives import objective as objective_of
    from gradscale.hydra_glue import compose, to_object
    from gradscale.model import build_model

    check_grid(world_sizes, accumulations, tolerance, reference)
    declared = {t: objective_of(objective if isinstance(objective, str) else objective[t]) for t in targets}
    for target in targets:
        resolve_target(target)  # a bad target fails here, before any rank starts
    say = progress or (lambda message: None)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its notes on stopping ranks
    hf_logging.disable_progress_bar()
    cfg = to_object(compose(["model.init=random"]))
    if model_spec is None:
        model = build_model(cfg.model, cfg.seed, torch.device("cpu"))
    else:
        torch.manual_seed(cfg.seed)
        model = resolve_model(model_spec)().float()
    input_ids, labels = global_batch(vocab_size_of(model, model_spec), batch_size_for(world_sizes, accumulations))
    counts = counts_of(labels)
    mask = trained_mask(labels)
    grid = [(n, k) for n in world_sizes for k in accumulations]
    # N = 1, K = 1 runs even where the grid leaves it out: the step's own gradient with no reduction at all
    launches = {n: list(accumulations) for n in world_sizes} | {1: sorted({*accumulations, 1}) if 1 in world_sizes
                                                                 else [1]}
    # every objective, declared or not: a step that computes another one is told which
    weightings = {f"objective {o.name}": o.weights(mask) for o in [*OBJECTIVES.values(), *declared.values()]}
    for n, k in grid:
        dealt = layout(counts, n, k)
        weightings |= {f"{n},{k} {s.name}": s.weights(mask, dealt) for s in SUSPECTS}
        weightings |= {f"{n},{k} slot {r},{j}": slot_weights(mask, mb) for r, rank in enumerate(dealt)
                       for j, mb in enumerate(rank) if mask[mb].sum() > 0}
    results: dict[str, list[Result]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory(prefix="gradscale-audit-") as work:
        work_dir = Path(work)
        if model_spec is None:
            model.save_pretrained(work_dir / "model")
        else:
            torch.save(model.state_dict(), work_dir / "model.pt")
        torch.save((input_ids, labels), work_dir / "batch.pt")
        expected = weighted_gradients(model, input_ids, labels, weightings)
        saved: dict[tuple[str, int, int], dict] = {}
        failures: dict[tuple[str, int, int], str] = {}
        for n in sorted(launches, key=lambda n: (n not in world_sizes, n)):
            ks = launches[n]
            started = time.monotonic()
            what = targets[0] if len(targets) == 1 else f"{len(targets)} targets"
            say(f"audit {what}: {n} rank{'s' if n > 1 else ''} (gloo), K = {', '.join(map(str, ks))} "
                f"(about {5 + 2 * n + len(targets) * len(ks) * n // 2} s on 2 cores) ...")
            launch_dir = work_dir / f"n{n}"
            launch_dir.mkdir()
            for (t, k), why in run_launch(mp, n, [(t, k) for t in targets for k in ks], launch_dir, timeout_s,
                                          say, model_spec).items():
                failures[(t, n, k)] = why
            for t in targets:
                for k in ks:
                    files = [launch_dir / f"{job_key(t, k)}-rank{r}.pt" for r in range(n)]
                    if (t, n, k) not in failures and all(p.exists() for p in files):
                        saved[(t, n, k)] = [torch.load(p) for p in files]
            say(f"  done in {time.monotonic() - started:.0f} s")
        for t in targets:
            one_rank = saved.get((t, 1, 1))
            baseline = one_rank[0]["grads"] if one_rank and all(
                torch.isfinite(g).all() for g in one_rank[0]["grads"].values()) else None
            objective_grads = expected[f"objective {declared[t].name}"]
            if reference == "layout":
                described = "layout: the step's own gradient at N = 1, K = 1" + (
                    f", which is {baseline_objective(baseline, expected, tolerance)}" if baseline else "")
            else:
                described = declared[t].name
            for n, k in grid:
                tokens = [[sum(counts[i] for i in mb) for mb in rank] for rank in layout(counts, n, k)]
                result = Result(n, k, tokens, len(counts), reference=described)
                if (t, n, k) not in saved:
                    result.reasons.append(f"the step failed: {failures.get((t, n, k), 'a rank stopped')}")
                elif reference == "layout" and baseline is None:
                    result.reasons.append("no reference: the step failed or gave no finite gradient at N = 1, K = 1, "
                                          "which --reference layout compares every row with")
                else:
                    loaded = saved[(t, n, k)]
                    # objectives first: a step that computes another one whole is told so, not given a suspect
                    suspects = {o.name: expected[f"objective {o.name}"] for o in OBJECTIVES.values()
                                if f"objective {o.name}" in expected and o.name != declared[t].name}
                    suspects |= {s.name: expected[f"{n},{k} {s.name}"] for s in SUSPECTS}
                    slots = {tuple(map(int, key.rsplit(" ", 1)[1].split(","))): grads
                             for key, grads in expected.items() if key.startswith(f"{n},{k} slot ")}
                    if reference == "layout":
                        compare(result, [x["grads"] for x in loaded], [x["logged"] for x in loaded], baseline,
                                tolerance, reference_name="its own N = 1, K = 1", suspects=suspects, slots=slots)
                    else:
                        compare(result, [x["grads"] for x in loaded], [x["logged"] for x in loaded], objective_grads,
                                tolerance, reference_name=f"the {_global(declared[t].name)}", baseline=baseline,
                                suspects=suspects, slots=slots)
                results[t].append(result)
    return results


def _global(name: str) -> str:
    return f"global {name}" if name == "token-mean" else name


def baseline_objective(baseline: dict[str, torch.Tensor], expected: dict, tolerance: float) -> str:
    """Which declared objective the step's N = 1, K = 1 gradient is (times its c), or that it is none of them."""
    from gradscale.audit.compare import fit, flat

    names = list(baseline)
    g = flat(baseline, names)
    fitted = []
    for key, grads in expected.items():
        if key.startswith("objective "):
            c, residual = fit(g, flat(grads, names))
            if residual <= tolerance:
                fitted.append(f"{key.removeprefix('objective ')} x{c:.6g}")
    return " or ".join(fitted) if fitted else "none of the declared objectives it was given"


def run_launch(mp, n: int, jobs: list[tuple[str, int]], launch_dir: Path, timeout_s: float,
               say: Callable[[str], None], model_spec: str | None) -> dict[tuple[str, int], str]:
    """Every (target, K) job on n ranks, relaunching the jobs after one that fails; {job: why} for the failed."""
    from gradscale.parallel import free_port

    pending = list(jobs)
    failures: dict[tuple[str, int], str] = {}
    while pending:
        try:
            mp.spawn(_rank_main, args=(n, free_port(), pending, str(launch_dir), timeout_s, model_spec), nprocs=n,
                     join=True)
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
    return failures


def check_grid(world_sizes: Sequence[int], accumulations: Sequence[int], tolerance: float,
               reference: str = "objective") -> None:
    for flag, values in (("--world-sizes", world_sizes), ("--accumulation", accumulations)):
        bad = [v for v in values if v not in ALLOWED_SIZES]
        if len(set(values)) < len(values):
            raise AuditError(f"error: {flag} {','.join(map(str, values))}: each value once")
        if bad or not values:
            raise AuditError(f"error: {flag} {','.join(map(str, values))}: each must be one of "
                             f"{', '.join(map(str, ALLOWED_SIZES))}")
    if not (0 < tolerance < 1):
        raise AuditError(f"error: --tolerance {tolerance}: must be in (0, 1)")
    if reference not in REFERENCES:
        raise AuditError(f"error: --reference {reference}: must be one of {', '.join(REFERENCES)}")
