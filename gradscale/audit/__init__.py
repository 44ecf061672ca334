"""The audit: does a training loop hand its optimizer the gradient of the global token-mean loss?

A target is a step function, a built-in adapter around a framework's own training code or a zoo entry
(gradscale/audit/zoo.py), or the user's own `module:function`:

    def step(model, micro_batches, world) -> float | None

- model: the suite's tiny Llama 3.2 (a transformers LlamaForCausalLM, fp32), identical weights on every rank.
- micro_batches: this rank's K micro-batches, in order: dicts of `input_ids` and `labels`, [sequences, seq_len]
  each, transformers' convention (labels unshifted, -100 where no token is trained; the model predicts
  labels[t + 1] from position t, so trained tokens are those of labels[:, 1:] that are not -100).
- world: rank, size (N) and accumulation (K). torch.distributed is initialised already (gloo, CPU).
- The step runs forward and backward over the micro-batches, with its own reduction over ranks and its own
  scaling, and leaves in each parameter's .grad the gradient its optimizer would receive (before clipping).
  It returns the grad norm it would log, or None.

The audit runs the step on N real gloo ranks and K micro-batches of accumulation, on one fixed global batch that
is ragged on purpose (trained-token counts differ across ranks and micro-batches, and wherever N or K > 1 at least one
micro-batch has no trained token), and compares what each rank holds with the one-process reference gradient of
the global token-mean loss (in float64): the fitted multiplier c, the same per tensor group, the residual that
no multiplier explains, and the logged norm over the gradient's own.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gradscale.audit.contract import IGNORE_INDEX, AuditError, World, trained_tokens

SEQ_LEN = 24
MIN_SEQUENCES = 8
TOLERANCE = 1e-4  # fp32 steps against a float64 reference, summed in another order: about 1e-6 off
ALLOWED_SIZES = (1, 2, 4, 8)  # powers of two: one global batch divides into every layout


@dataclass
class Result:
    world_size: int
    accumulation: int
    tokens: list[list[int]]  # trained tokens per rank, per micro-batch
    sequences: int = 0  # in the global batch
    c: float = math.nan  # <g, g_ref> / <g_ref, g_ref>
    group_c: dict[str, float] = field(default_factory=dict)
    residual: float = math.nan  # ||g - c g_ref|| / ||c g_ref||
    norm: float = math.nan  # ||g||, the gradient the optimizer receives
    reference_norm: float = math.nan
    logged_norm: float | None = None
    replica_spread: float = 0.0  # max over ranks of ||g_r - g_0|| / ||g_0||
    ok: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def logged_over_true(self) -> float | None:
        return None if self.logged_norm is None or not self.norm else self.logged_norm / self.norm


# ---------------------------------------------------------------------------------------------
# Targets


def builtin_targets() -> dict[str, tuple[str, str]]:
    """name -> (module:function, one-line summary): the zoo and the framework adapters."""
    from gradscale.audit import adapters, zoo

    fixes: dict[str, list[str]] = {}
    for e in zoo.ZOO:
        fixes.setdefault(e.fixed, []).append(e.name)
    bugs = {e.name: (f"gradscale.audit.zoo:{e.name}", f"zoo: {e.summary}") for e in zoo.ZOO}
    fixed = {fix: (f"gradscale.audit.zoo:{fix}", f"zoo, the fix of: {', '.join(names)}")
             for fix, names in fixes.items()}
    return {**adapters.ADAPTERS, **bugs, **fixed}


def resolve_target(spec: str) -> Callable:
    """A built-in target's name or `module:function`, as the callable step (AuditError, one line, if not)."""
    from gradscale.audit.adapters import REQUIRES, find_peer

    builtins = builtin_targets()
    if spec in REQUIRES:
        find_peer(REQUIRES[spec])
    path = builtins[spec][0] if spec in builtins else spec
    if ":" not in path:
        raise AuditError(f"error: target {spec!r} is neither a built-in target ({', '.join(sorted(builtins))}) "
                         "nor module:function")
    module_name, _, function_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error (a SyntaxError) while importing it
        raise AuditError(f"error: target {spec!r}: cannot import {module_name!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    step = getattr(module, function_name, None)
    if not callable(step):
        raise AuditError(f"error: target {spec!r}: {module_name!r} has no function {function_name!r}")
    return step


# ---------------------------------------------------------------------------------------------
# The global batch and who gets which sequence


def global_batch(vocab_size: int, sequences: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels, [sequences, SEQ_LEN]: the first half trained over the last t positions, t from
    SEQ_LEN - 1 down to 1 (ragged), the second half with no trained token (a prompt cut off before its answer)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (sequences, SEQ_LEN), generator=gen)
    half = sequences // 2
    top = SEQ_LEN - 1
    counts = [1 + round((top - 1) * ((half - 1 - i) / max(half - 1, 1)) ** 2) for i in range(half)] + [0] * half
    trained = torch.arange(SEQ_LEN)[None, :] >= SEQ_LEN - torch.tensor(counts)[:, None]
    return input_ids, torch.where(trained, input_ids, IGNORE_INDEX)


def layout(counts: Sequence[int], world_size: int, accumulation: int) -> list[list[list[int]]]:
    """Sequence indices per rank per micro-batch. Where N or K > 1 the last rank's last micro-batch holds only
    sequences with no trained token (at K = 1: the whole last rank); the trained sequences go round the other
    micro-batches, largest first, rank by rank, so ranks and micro-batches differ in trained tokens."""
    slots = world_size * accumulation
    per_slot = len(counts) // slots
    empty = [i for i, n in enumerate(counts) if n == 0]
    trained = sorted((i for i, n in enumerate(counts) if n > 0), key=lambda i: -counts[i])
    held: dict[tuple[int, int], list[int]] = {(r, k): [] for r in range(world_size) for k in range(accumulation)}
    reserved = (world_size - 1, accumulation - 1) if slots > 1 else None
    if reserved:
        held[reserved] = [empty.pop() for _ in range(per_slot)]
    open_slots = [(r, k) for k in range(accumulation) for r in range(world_size) if (r, k) != reserved]
    turn = 0
    for i in trained:
        while len(held[open_slots[turn % len(open_slots)]]) == per_slot:
            turn += 1
        held[open_slots[turn % len(open_slots)]].append(i)
        turn += 1
    for slot in open_slots:
        while len(held[slot]) < per_slot:
            held[slot].append(empty.pop())
    return [[sorted(held[(r, k)]) for k in range(accumulation)] for r in range(world_size)]


def batch_size_for(world_sizes: Sequence[int], accumulations: Sequence[int]) -> int:
    """Sequences in the global batch: at least one per micro-batch of the finest layout (sizes are powers of
    two, so it divides into every layout) and at least MIN_SEQUENCES."""
    return max(MIN_SEQUENCES, max(world_sizes) * max(accumulations))


# ---------------------------------------------------------------------------------------------
# The reference and the comparison


def reference_gradient(model, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, float64: the gradient of the global token-mean loss."""
    model = model.double()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                      ignore_index=IGNORE_INDEX).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.float()
    return grads


def compare(result: Result, grads: list[dict[str, torch.Tensor]], logged: list[float | None],
            reference: dict[str, torch.Tensor], tolerance: float) -> Result:
    """Fill result's numbers and verdict from every rank's gradient and logged norm."""
    from gradscale.analysis.theory import tensor_group

    def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g[n].double().flatten() for n in reference])

    for g in grads:
        if set(g) != set(reference):
            changed = sorted(set(g) ^ set(reference))[:3]
            result.reasons.append(f"the step changed the model's parameters ({', '.join(changed)}, ...): the audit "
                                  "compares the gradients of the model it hands over, in place")
            return result

    ref = flat(reference)
    per_rank = [flat(g) for g in grads]
    for rank, g in enumerate(per_rank):
        if not torch.isfinite(g).all():
            kind = "NaN" if torch.isnan(g).any() else "inf"
            empty = [f"rank {r} micro-batch {k}" for r, counts in enumerate(result.tokens)
                     for k, n in enumerate(counts) if n == 0]
            hint = f" ({', '.join(empty[:3])} had no trained token: a mean over zero tokens?)" if empty else ""
            result.reasons.append(f"{kind} in rank {rank}'s gradient{hint}")
            return result
    g = per_rank[0]
    result.norm, result.reference_norm = g.norm().item(), ref.norm().item()
    result.replica_spread = max(((x - g).norm() / g.norm()).item() if g.norm() > 0 else (x - g).norm().item()
                                for x in per_rank)
    result.c = (g @ ref / (ref @ ref)).item()
    result.residual = ((g - result.c * ref).norm() / (abs(result.c) * ref.norm())).item() if result.c else math.inf
    groups: dict[str, list[str]] = {}
    for name in reference:
        groups.setdefault(tensor_group(name), []).append(name)
    group_residuals = {}
    for group, names in groups.items():
        g_group = torch.cat([grads[0][n].double().flatten() for n in names])
        r_group = torch.cat([reference[n].flatten() for n in names])
        c = result.group_c[group] = (g_group @ r_group / (r_group @ r_group)).item()
        group_residuals[group] = ((g_group - c * r_group).norm() / (abs(c) * r_group.norm())).item() if c else math.inf
    result.logged_norm = logged[0]

    if result.norm == 0:
        result.reasons.append("the gradient is zero: did the step leave it in .grad?")
    if result.replica_spread > tolerance:
        result.reasons.append(f"ranks hold different gradients (spread {result.replica_spread:.2g})")
    groups_differ = any(abs(c / result.c - 1) > tolerance for c in result.group_c.values()) if result.c else False
    scaled = ", ".join(f"{g} x{c:.6g}" for g, c in sorted(result.group_c.items(), key=lambda x: -abs(x[1] - 1)))
    if groups_differ and max(group_residuals.values()) <= tolerance:  # each group scaled, by its own factor
        result.reasons.append(f"tensor groups scaled unequally: {scaled}")
    elif result.residual > tolerance:
        result.reasons.append(f"residual {result.residual:.2g}: tokens weighted unequally (per-rank or "
                              "per-micro-batch means?)")
    elif groups_differ:  # a small group off, too small to move the overall residual past the tolerance
        result.reasons.append(f"tensor groups differ: {scaled}")
    elif abs(result.c - 1) > tolerance:
        result.reasons.append(f"gradient x{result.c:.6g} the global token-mean's")
    ratio = result.logged_over_true
    if ratio is not None and abs(ratio - 1) > tolerance:
        result.reasons.append(f"logged norm x{ratio:.4g} the gradient's (one shard's norm? logged before the "
                              "reduction?)")
    result.ok = not result.reasons
    return result


def meaning(c: float, eps: float | None = None, by: float = 0.1) -> str:
    """What a uniform multiplier c does: SGD's lr times c; AdamW's update per coordinate times
    (s + eps) / (s + eps / c), off by more than `by` where sqrt(v_hat) = s is below the threshold (eps: AdamW's
    default unless given); and a clipping threshold max_norm acts as max_norm / c on the right gradient
    (docs/design.md physics 13)."""
    from gradscale.analysis.theory import departure_threshold
    from gradscale.optimizers.adamw import AdamWConfig

    eps = AdamWConfig().eps if eps is None else eps

    sgd = f"SGD: the lr is in effect x{c:.4g}"
    threshold = departure_threshold(c, eps, by)
    effect = ("steps it should clip go unclipped: AdamW feels that; without the fix, repair with eps and M both "
              f"x{c:.4g}" if c < 1 else "steps it should not clip get clipped: AdamW feels that")
    clip = f"; clipping at max_norm M clips the right gradient at M / {c:.4g} = {1 / c:.4g} M instead ({effect})"
    if threshold is None:
        return f"{sgd}; AdamW (eps {eps:g}): no coordinate's update moves by more than {by:.0%}{clip}"
    way = "cut" if c < 1 else "raised"
    return (f"{sgd}; AdamW (eps {eps:g}): a coordinate's update is {way} by more than {by:.0%} where "
            f"sqrt(v_hat) < {threshold:.2g} (the advisor measures that share on your model: "
            f"gradscale-advise){clip}")


# ---------------------------------------------------------------------------------------------
# Running it: one launch of N real ranks per world size, every accumulation inside it


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


def counts_of(labels: torch.Tensor) -> list[int]:
    return [trained_tokens(row) for row in labels]


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


# ---------------------------------------------------------------------------------------------
# Output


def is_uniform_multiplier(r: Result, tolerance: float) -> bool:
    """The gradient is c times the right one, c != 1: what c means is then the whole story."""
    return math.isfinite(r.c) and abs(r.c - 1) > tolerance and r.residual <= tolerance


def format_table(results: list[Result]) -> str:
    from gradscale.sweep import render_table

    header = ("N", "K", "trained tokens per rank", "c", "groups' c", "residual", "logged/true", "verdict")
    lines = []
    for r in results:
        groups = (f"{min(r.group_c.values()):.6f}..{max(r.group_c.values()):.6f}" if r.group_c else "-")
        ratio = r.logged_over_true
        lines.append((str(r.world_size), str(r.accumulation), ",".join(str(sum(t)) for t in r.tokens),
                      f"{r.c:.6f}" if math.isfinite(r.c) else "-", groups,
                      f"{r.residual:.1e}" if math.isfinite(r.residual) else "-",
                      "-" if ratio is None else f"{ratio:.6f}", "ok" if r.ok else "FAIL"))
    return render_table(header, lines)


def report(target: str, results: list[Result], tolerance: float) -> str:
    """The table, then each failing configuration's reasons and what its c means."""
    lines = [format_table(results)]
    failed = [r for r in results if not r.ok]
    for r in failed:
        lines.append(f"N={r.world_size} K={r.accumulation}: " + "; ".join(r.reasons))
    uniform = {round(r.c, 6) for r in failed if is_uniform_multiplier(r, tolerance)}
    for c in sorted(uniform):
        lines.append(f"what c = {c:g} means: {meaning(c)}")
    verdict = (f"{target}: {len(failed)} of {len(results)} configurations FAIL" if failed else
               f"{target}: every configuration gives the global token-mean gradient (c = 1, residual, groups and "
               f"logged norm within {tolerance:g})")
    lines.append(verdict)
    return "\n".join(lines)


def as_json(target: str, results: list[Result], tolerance: float) -> dict:
    rows = []
    for r in results:
        row = asdict(r)
        row["logged_over_true"] = r.logged_over_true
        row["meaning"] = meaning(r.c) if is_uniform_multiplier(r, tolerance) else None
        rows.append(_finite_or_none(row))
    return {"target": target, "tolerance": tolerance, "seq_len": SEQ_LEN,
            "reference": "one-process float64 gradient of the global token-mean loss", "results": rows,
            "ok": all(r.ok for r in results)}


def _finite_or_none(value):
    """JSON has no NaN or inf: None in their place, at any depth."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def assert_gradient_matches(target: str, world_sizes: Sequence[int] = (1, 2, 4),
                            accumulations: Sequence[int] = (1, 4), tolerance: float = TOLERANCE) -> list[Result]:
    """For a project's own tests: fails (AssertionError with the audit's table) unless every configuration
    gives the global token-mean gradient."""
    results = audit(target, world_sizes, accumulations, tolerance)
    if not all(r.ok for r in results):
        raise AssertionError("\n" + report(target, results, tolerance))
    return results
