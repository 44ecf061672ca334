"""Execute a jupytext percent-format notebook headless on a sweep, writing an .ipynb with its outputs.

    python -m gradscale.analysis.notebook gradscale/analysis/notebooks/01_world_size_fix.py SWEEP_DIR

The executed notebook goes into the sweep folder (SWEEP_DIR/notebooks/NAME.ipynb), never over the one
committed beside the .py unless --out names it (scripts/make_figures.sh does, from its own sweeps).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gradscale.checks import CommandParser


class NotebookError(RuntimeError):
    """The notebook or sweep named cannot be used; the message is one line (exit 2)."""


class NotebookFailed(NotebookError):
    """A cell raised; the message is one line, its last (exit 1)."""


def default_out(notebook_py: Path, sweep_dir: Path) -> Path:
    return Path(sweep_dir) / "notebooks" / Path(notebook_py).with_suffix(".ipynb").name


def execute(notebook_py: Path, sweep_dir: Path, out: Path | None = None, timeout_s: int = 600) -> Path:
    """Run every cell with GRADSCALE_SWEEP=sweep_dir (the parameters cell reads it); return the .ipynb path.
    A cell that fails raises NotebookFailed and writes nothing."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook_py, sweep_dir = Path(notebook_py), Path(sweep_dir)
    if notebook_py.suffix != ".py" or not notebook_py.is_file():
        raise NotebookError(f"error: {notebook_py} is not a notebook: a jupytext .py file "
                            "(gradscale/analysis/notebooks/*.py)")
    if not sweep_dir.is_dir():
        raise NotebookError(f"error: {sweep_dir} is not a sweep folder (it does not exist)")
    notebook_py = notebook_py.resolve()
    notebook = jupytext.read(notebook_py)
    previous = os.environ.get("GRADSCALE_SWEEP")
    os.environ["GRADSCALE_SWEEP"] = str(sweep_dir.resolve())
    try:
        NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook_py.parent)}}).execute()
    except CellExecutionError as e:
        last = next((line for line in reversed(str(e).strip().splitlines()) if line.strip()), "")
        raise NotebookFailed(f"error: {notebook_py.name} failed on {sweep_dir}: {last.strip()}") from None
    finally:
        if previous is None:
            os.environ.pop("GRADSCALE_SWEEP")
        else:
            os.environ["GRADSCALE_SWEEP"] = previous
    out = Path(out) if out else default_out(notebook_py, sweep_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    nbformat.write(notebook, tmp)
    os.replace(tmp, out)  # a killed write never leaves half a notebook
    return out


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m gradscale.analysis.notebook",
        description="Execute an analysis notebook headless on a sweep and write the .ipynb with its outputs "
                    "(figures and tables) into the sweep folder.",
        epilog="example: python -m gradscale.analysis.notebook gradscale/analysis/notebooks/01_world_size_fix.py "
               "SWEEP_DIR")
    parser.add_argument("notebook", type=Path,
                        help="the jupytext .py notebook, e.g. gradscale/analysis/notebooks/01_world_size_fix.py")
    parser.add_argument("sweep", type=Path, help="the sweep folder (hydra.sweep.dir) the notebook reads")
    parser.add_argument("--out", type=Path,
                        help="where the .ipynb goes (default: SWEEP/notebooks/NAME.ipynb); naming the committed "
                             "gradscale/analysis/notebooks/NAME.ipynb replaces it")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    args = parser.parse_args(argv)
    try:
        out = execute(args.notebook, args.sweep, args.out, args.timeout)
    except NotebookError as e:
        print(e, file=sys.stderr)
        return 1 if isinstance(e, NotebookFailed) else 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
