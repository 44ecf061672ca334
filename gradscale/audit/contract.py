"""What a step is handed (the docs' contract, gradscale/audit/__init__.py) and the audit's error: the leaf the
audit, its adapters and its zoo import."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # transformers' label for an untrained position


class AuditError(RuntimeError):
    """Bad input to the audit: the message is one line, says what is wrong and what is allowed."""


def import_callable(module_name: str, name: str, named: str):
    """module_name's function `name`, or an AuditError that starts with `named` (how the user named it)."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own error (a SyntaxError) while importing it
        raise AuditError(f"error: {named}: cannot import {module_name!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise AuditError(f"error: {named}: {module_name!r} has no function {name!r}")
    return found


@dataclass(frozen=True)
class World:
    rank: int
    size: int  # N: ranks
    accumulation: int  # K: micro-batches per rank and step


def trained_tokens(labels: torch.Tensor) -> int:
    """Trained tokens of a micro-batch's (unshifted) labels: position t predicts labels[t + 1]."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())
