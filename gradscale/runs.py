"""What both sides read the same way, with neither torch nor Hydra: a sweep's job folders and their overrides, a
plain-text table, a number as a person reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import OmegaConf


def job_overrides(job_dir: Path) -> list[str]:
    """The job's command-line overrides, as Hydra saved them ([] when it has none saved)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    return list(OmegaConf.to_container(OmegaConf.load(overrides_file))) if overrides_file.exists() else []


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders of a sweep in job order (their names start with Hydra's job number)."""

    def job_number(d: Path) -> tuple[int, str]:
        head = d.name.split("_")[0]
        return (int(head) if head.isdigit() else 1 << 30, d.name)

    return sorted((d for d in Path(sweep_dir).iterdir() if (d / ".hydra").is_dir()), key=job_number)


def render_table(header: tuple[str, ...], lines: list[tuple]) -> str:
    """Plain-text table: left-aligned columns, a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    render = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *lines)]
    return "\n".join([render[0], "  ".join("-" * w for w in widths), *render[1:]])


def short_number(value: float, digits: int = 3) -> str:
    """One short format for every number a person reads (labels, ticks, tables): plain between 0.01 and
    1000 (0.125, 8, 0.03), else a compact power of ten (1e-8, 1.25e-4, 1e4); `digits` significant."""
    value = float(value)
    if value == 0 or not np.isfinite(value):
        return f"{value:g}"
    if 1e-2 <= abs(value) < 1e3:
        return f"{value:.{digits}g}"
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"
