"""Parity oracle: each normalization recipe's gradient on N real ranks against the one-device reference.

    python -m gradscale.parity [--world-size 2] [--strategy ddp|fsdp2] [--grad-accum 2]

On the tiny model and a batch whose trained-token counts are deliberately equal, ragged (one rank with
very few) or zero on one rank, it computes the reference gradient of the global token-mean loss on one
device, then the gradient each recipe produces on N real gloo ranks through the training loop's own
code (`accumulate_gradients`, then `GradPipeline.apply`), and prints relative error, grad-norm ratio
and cosine similarity against the reference (the worst rank's view; every rank must pass), with a
verdict against what the recipe should give:

    global_tokens               matches (fp32 relative error ~1e-6)
    global_tokens_no_world_fix  exactly reference / N (norm ratio 1/N, cosine 1)
    local_mean                  matches when counts are equal, differs in direction when ragged
    per_microbatch_mean         the same, per micro-batch

It exits non-zero when any row misses its expectation, so it can guard the pipeline (see the mutation
test in tests/test_parallel.py, which injects the known bugs and checks that this flags them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gradscale.checks import CommandParser
from gradscale.data import IGNORE_INDEX
from gradscale.recipes import RECIPES
from gradscale.runs import render_table

CASES = ("equal", "ragged", "zero_rank")
SEQ_LEN = 32
SEQUENCES_PER_MICRO_BATCH = 2
TOLERANCE = 1e-5  # fp32, different summation order
DIRECTION_GAP = 1e-4  # "differs in direction": cosine below 1 - this


@dataclass
class Row:
    case: str
    recipe: str
    tokens_per_rank: list[int]
    rel_err: float
    norm_ratio: float
    cosine: float
    expected: str
    ok: bool


def parity_batch(case: str, world_size: int, grad_accum: int, vocab_size: int, seed: int = 0):
    """Random tokens; the trained-token mask sets each rank's and micro-batch's count."""
    gen = torch.Generator().manual_seed(seed)
    batch = world_size * grad_accum * SEQUENCES_PER_MICRO_BATCH
    inputs = torch.randint(0, vocab_size, (batch, SEQ_LEN), generator=gen)
    next_tokens = torch.randint(0, vocab_size, (batch, SEQ_LEN), generator=gen)
    counts = torch.full((batch,), SEQ_LEN // 2)
    per_rank = batch // world_size
    last = slice((world_size - 1) * per_rank, batch)
    if case == "ragged":  # rank 0 full, the last rank very few, and ragged micro-batches inside ranks
        counts[:per_rank] = SEQ_LEN
        counts[last] = 1
        counts[last.start] = 3
    elif case == "zero_rank":  # equal counts, but the last rank has none
        counts[:] = SEQ_LEN - 4
        counts[last] = 0
    positions = torch.arange(SEQ_LEN)
    trained = positions[None, :] >= (SEQ_LEN - counts)[:, None]  # the last `count` positions
    targets = torch.where(trained, next_tokens, torch.full_like(next_tokens, IGNORE_INDEX))
    return inputs, targets


def reference_gradient(model, inputs, targets) -> torch.Tensor:
    """One device, whole global batch: the gradient of the global token-mean loss."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=inputs).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def expectation(case: str, recipe: str, world_size: int) -> tuple[str, Callable[[float, float, float], bool]]:
    """What the recipe's gradient should be, read from its registry entry: a recipe that divides by the global
    token count gives c_eff times the reference whatever the counts; one that takes a token mean before backward
    (mean_over) gives the reference only where every count it divides by is equal."""
    rule = RECIPES[recipe]
    if rule.divide_by_tokens:
        c = rule.c_eff(1.0, world_size)
        if c == 1:
            return "matches", lambda err, ratio, cos: err < TOLERANCE
        label = f"= ref/{1 / c:g}" if c < 1 else f"= ref*{c:g}"
        return label, lambda err, ratio, cos: abs(ratio / c - 1) < TOLERANCE and cos > 1 - 1e-6
    if case == "equal":
        return "matches", lambda err, ratio, cos: err < TOLERANCE
    if case == "zero_rank":  # the empty rank adds 0 to the average over N: the others' mean, times (N-1)/N
        share = (world_size - 1) / world_size
        return f"= ref*{world_size - 1}/{world_size}", lambda err, ratio, cos: abs(ratio / share - 1) < TOLERANCE and (
            cos > 1 - 1e-6)
    return "differs in direction", lambda err, ratio, cos: cos < 1 - DIRECTION_GAP


def _config(world_size: int, grad_accum: int):
    """The tiny model from a seeded random init (the same weights on every rank and for the reference)."""
    from gradscale.hydra_glue import compose, to_object

    return to_object(compose(["model.init=random", f"world_size={world_size}", f"grad_accum={grad_accum}"]))


def _rank_main(rank, world_size, port, strategy, grad_accum, out_dir, child_setup):
    """One real rank: the training loop's gradient code for every case and recipe."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if child_setup is not None:
        child_setup()  # e.g. a test's injected bug
    from gradscale import parallel, train
    from gradscale.job import build_model, build_pipeline

    cfg = _config(world_size, grad_accum)
    ranks = parallel.setup(strategy, world_size, timeout_s=120, device=torch.device("cpu"))
    net = build_model(cfg, torch.device("cpu"), ranks)
    params = list(net.parameters())
    for case in CASES:
        inputs, targets = parity_batch(case, world_size, grad_accum, cfg.model.vocab_size)
        for recipe in RECIPES:
            net.zero_grad(set_to_none=True)
            pipeline = replace(build_pipeline(cfg, world_size), recipe=recipe)
            _, num_tokens = train.accumulate_gradients(net, inputs, targets, pipeline, ranks, grad_accum,
                                                       contextlib.nullcontext(), torch.device("cpu"))
            pipeline.apply(params, num_tokens, ranks)
            full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
            # every rank's view: DDP replicas that disagree are a bug even when rank 0 looks right
            torch.save(torch.cat([g.flatten() for g in full]), Path(out_dir) / f"{case}-{recipe}-rank{rank}.pt")
    parallel.finish()


def run_parity(world_size: int = 2, strategy: str = "ddp", grad_accum: int = 2,
               child_setup: Callable[[], None] | None = None) -> list[Row]:
    """child_setup runs first in every rank process (it must be picklable: a module-level function)."""
    import torch.multiprocessing as mp

    from gradscale.job import build_model
    from gradscale.parallel import Ranks, free_port

    cfg = _config(world_size, grad_accum)
    reference_model = build_model(cfg, torch.device("cpu"), Ranks(world_size=1))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(world_size, free_port(), strategy, grad_accum, out_dir, child_setup),
                 nprocs=world_size, join=True)
        rows = []
        for case in CASES:
            inputs, targets = parity_batch(case, world_size, grad_accum, cfg.model.vocab_size)
            reference = reference_gradient(reference_model, inputs, targets).double()
            tokens_per_rank = [int((t != IGNORE_INDEX).sum()) for t in targets.chunk(world_size)]
            for recipe in RECIPES:
                expected, check = expectation(case, recipe, world_size)
                per_rank = []
                for rank in range(world_size):
                    grad = torch.load(Path(out_dir) / f"{case}-{recipe}-rank{rank}.pt").double()
                    rel_err = ((grad - reference).norm() / reference.norm()).item()
                    ratio = (grad.norm() / reference.norm()).item()
                    cosine = torch.nn.functional.cosine_similarity(grad, reference, dim=0).item()
                    per_rank.append((check(rel_err, ratio, cosine), rel_err, ratio, cosine))
                worst = min(per_rank, key=lambda r: (r[0], -r[1]))  # a failing rank first, else the largest error
                rows.append(Row(case, recipe, tokens_per_rank, *worst[1:], expected, all(r[0] for r in per_rank)))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("case", "tokens/rank", "recipe", "rel. error", "norm ratio", "cosine", "expected", "verdict")
    lines = [(r.case, ",".join(map(str, r.tokens_per_rank)), r.recipe, f"{r.rel_err:.2e}", f"{r.norm_ratio:.6f}",
              f"{r.cosine:.8f}", r.expected, "ok" if r.ok else "FAIL") for r in rows]
    return render_table(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m gradscale.parity", description=__doc__.split("\n\n")[0],
                           epilog="example: python -m gradscale.parity --world-size 4 --strategy fsdp2 "
                                  "(exits non-zero when a recipe misses its expectation)")
    parser.add_argument("--world-size", type=int, default=2, choices=range(2, 9), metavar="N (2..8)",
                        help="real gloo ranks, one process each (default: 2)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp",
                        help="the engine whose gradients are checked: DDP or FSDP2 (default: ddp)")
    parser.add_argument("--grad-accum", type=int, default=2, choices=range(1, 9), metavar="A (1..8)",
                        help="micro-batches per rank and step (default: 2)")
    args = parser.parse_args(argv)
    rows = run_parity(args.world_size, args.strategy, args.grad_accum)
    print(f"parity: {args.world_size} {args.strategy} ranks (gloo), grad_accum={args.grad_accum}, tiny Llama 3.2, "
          "reference = one-device gradient of the global token-mean loss")
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"error: {len(failed)} of {len(rows)} rows miss their expectation", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
