"""Range checks: one line naming the key, the value and what is allowed. A leaf module (no torch, nothing of
the suite's own), so every config section, wherever it is defined, checks itself the same way."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A bad value: one line. Every command catches it, prints the line and exits 2 (the sweeper, the run's
    callback and the commands that compose in Python), so it needs nothing of Hydra: the reading side imports
    this module too."""


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"error: {key}={value!r} is not allowed: {allowed}")


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str, what: str) -> None:
    """ConfigError (one line) when an optional dependency of `what` is not installed: the extra that brings it."""
    if not installed(module):
        raise ConfigError(f"error: {what} needs {module}, which is not installed: pip install 'gradscale[{extra}]'")


def finite_positive(key: str, value: Any) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    check(number and math.isfinite(value) and value > 0, key, value, "must be a finite number > 0")


def int_at_least(key: str, value: Any, low: int) -> None:
    check(isinstance(value, int) and value >= low, key, value, f"must be an integer >= {low}")


def check_betas(betas, key: str = "optimizer.betas") -> None:
    betas = list(betas)
    check(len(betas) == 2 and all(0 <= b < 1 for b in betas), key, betas, "two numbers in [0, 1)")


def one_of(key: str, value: Any, allowed) -> None:
    check(value in allowed, key, value, f"one of {', '.join(allowed)}")


def override_key(override: str) -> str:
    """The key an override sets: `+optimizer.eps=1e-6` -> optimizer.eps, `~clip_grad_norm` -> clip_grad_norm."""
    return override.split("=", 1)[0].lstrip("+~")


def output_file_problem(path: Path | str) -> str | None:
    """Why a command could not write this file at the end of its work, or None: checked before the work starts."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        return "is a folder"
    if not folder.is_dir():
        return f"its folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "is not writable"
    return None


def check_writable(key: str, folder: Path) -> None:
    """The folder exists and is writable, or can be created: its nearest existing ancestor is a writable
    folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"error: {key}={str(folder)!r} cannot be written: {existing} {what}")


class CommandParser(argparse.ArgumentParser):
    """argparse for every command: a bad flag gets one line, `error: --flag VALUE: why`, and exit 2, as every
    other bad input (argparse prints its usage block above the error)."""

    def error(self, message: str):
        message = re.sub(r"^argument (\S+): \1 ", r"\1 ", message)  # "--flag VALUE: why", the flag once
        self.exit(2, f"error: {message.removeprefix('argument ')} ({self.prog} --help lists the flags)\n")
