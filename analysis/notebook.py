"""Execute a jupytext percent-format notebook headless on a sweep, writing the paired .ipynb with outputs.

    python -m analysis.notebook analysis/notebooks/01_world_size_fix.py SWEEP_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def execute(notebook_py: Path, sweep_dir: Path, out: Path | None = None, timeout_s: int = 600) -> Path:
    """Run every cell with GRADSCALE_SWEEP=sweep_dir (the parameters cell reads it); return the .ipynb path."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    notebook_py = Path(notebook_py).resolve()
    notebook = jupytext.read(notebook_py)
    previous = os.environ.get("GRADSCALE_SWEEP")
    os.environ["GRADSCALE_SWEEP"] = str(Path(sweep_dir).resolve())
    try:
        NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook_py.parent)}}).execute()
    finally:
        if previous is None:
            os.environ.pop("GRADSCALE_SWEEP")
        else:
            os.environ["GRADSCALE_SWEEP"] = previous
    out = out or notebook_py.with_suffix(".ipynb")
    nbformat.write(notebook, out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m analysis.notebook NOTEBOOK.py SWEEP_DIR")
    print(f"wrote {execute(Path(sys.argv[1]), Path(sys.argv[2]))}")
