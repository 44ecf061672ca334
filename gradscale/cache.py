"""What the suite's builders share: the cache folder, the lock that makes one process build a thing while the
others wait, the rename that publishes a finished build, and the process's memory setting. A leaf module.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import sys
from pathlib import Path


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir or os.environ.get("GRADSCALE_CACHE") or Path.home() / ".cache" / "gradscale")


@contextlib.contextmanager
def build_lock(target: Path):
    """Exclusive lock beside `target` while it is built: a second process waits, then finds it built."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish(tmp: Path, target: Path) -> None:
    """Rename a finished build into place: a killed build never leaves a half-written directory behind."""
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


# glibc's own settings, when the user gave any: they win over keep_freed_memory
GLIBC_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                    "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h


def keep_freed_memory() -> bool:
    """Keep freed CPU memory in the process instead of handing it back to the OS.

    glibc returns large freed blocks (munmap, heap trimming), so each step page-faults its activations,
    logits and gradients in again, in the kernel (docs/performance.md has the measurement). No mmap'd
    chunks and no trimming keep that memory for the next step, as PyTorch's caching allocator does on
    GPUs. No trimming at all (-1, mallopt(3)): a threshold, even the largest int's 2 GiB, is passed when a
    SmolLM2 step frees its activations, and the next step faulted 2.3 GB in again. Linux with glibc only,
    and not when the user set glibc's malloc variables; returns whether it applied."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in GLIBC_MALLOC_ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):  # not glibc
        return False
