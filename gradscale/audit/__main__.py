"""gradscale-audit TARGET: does this training step hand its optimizer the right gradient?"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gradscale.audit import (
    ALLOWED_SIZES,
    REFERENCES,
    TOLERANCE,
    AuditError,
    as_json,
    audit,
    builtin_targets,
    check_grid,
    objective,
    report,
    resolve_target,
)
from gradscale.audit.models import resolve_model
from gradscale.checks import CommandParser


def sizes(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text}: comma-separated integers, each one of "
                                             f"{', '.join(map(str, ALLOWED_SIZES))}") from None
        return values
    return parse


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    targets = builtin_targets()
    listing = "\n".join(f"  {name:32s} {summary}" for name, (_, summary) in targets.items())
    parser = CommandParser(
        prog="gradscale-audit", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a training step on N real gloo ranks with K micro-batches of accumulation, on one "
                    "ragged global batch, and compare the gradient its optimizer receives with the one-process "
                    "gradient of the objective it declares (default: the global token mean), or with its own "
                    "gradient at N = 1, K = 1 (--reference layout). Exits 1 when any configuration fails.",
        epilog=f"targets (or your own module:function; the contract is in docs/audit.md):\n{listing}\n\n"
               "example: gradscale-audit hf_trainer --json audit.json")
    parser.add_argument("target", help="a built-in target (below) or module:function")
    parser.add_argument("--world-sizes", type=sizes("--world-sizes"), default=[1, 2, 4], metavar="N,...",
                        help="real gloo ranks, each one of 1, 2, 4, 8 (default: 1,2,4)")
    parser.add_argument("--accumulation", type=sizes("--accumulation"), default=[1, 4], metavar="K,...",
                        help="micro-batches per rank and step, each one of 1, 2, 4, 8 (default: 1,4)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"largest |c - 1|, residual and logged-norm error that pass (default: {TOLERANCE:g})")
    parser.add_argument("--objective", default="token-mean", metavar="NAME",
                        help="the loss the step means over the global batch: token-mean (default), "
                             "seq-mean-token-mean, seq-mean-token-sum (over the sequences with at least one trained "
                             "token) or constant:D (the token sum over D, Dr. GRPO's)")
    parser.add_argument("--reference", default="objective", choices=REFERENCES,
                        help="objective (default): each row against the objective's one-process float64 gradient; "
                             "layout: against the step's own N = 1, K = 1 gradient, for any loss (GRPO with "
                             "advantages, DPO, your own): a correct one does not depend on how the batch is split")
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="your own model instead of the suite's tiny Llama: "
                        "a function with no argument that returns it (the contract is in docs/audit.md)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:  # the console command finds the user's modules where
        sys.path.insert(0, os.getcwd())  # it is run, as `python -m gradscale.audit` does
    try:
        check_grid(args.world_sizes, args.accumulation, args.tolerance, args.reference)
        objective(args.objective)
        resolve_target(args.target)
        if args.model is not None:
            resolve_model(args.model)
        if args.json is not None:
            check_json_path(args.json)
    except AuditError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        results = audit(args.target, args.world_sizes, args.accumulation, args.tolerance, progress=progress,
                        objective=args.objective, reference=args.reference, model_spec=args.model)
    except AuditError as e:  # what only the built model can say (its vocabulary), before any rank starts
        print(e, file=sys.stderr)
        return 2
    print(report(args.target, results, args.tolerance))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(args.target, results, args.tolerance), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r.ok for r in results) else 1


def check_json_path(path: Path) -> None:
    from gradscale.checks import output_file_problem

    if problem := output_file_problem(path):
        raise AuditError(f"error: --json {path}: {problem}")


if __name__ == "__main__":
    sys.exit(main())
