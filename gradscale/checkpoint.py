"""Checkpoints for resuming an interrupted run: the model, the optimizer, the RNG states and where the
loop stands. The data position needs nothing more: the batch at each step is a pure function of
(seed, step). One file per run, `checkpoint.pt`, written to a temporary file and renamed, so a kill
mid-write leaves the previous checkpoint whole; removed when the run ends.

Under torchrun the model and optimizer states are gathered to full tensors (DDP replicas, FSDP2 shards
alike) and rank 0 writes; every rank loads the same file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gradscale.parallel import Ranks

log = logging.getLogger(__name__)
FILENAME = "checkpoint.pt"


@dataclass
class LoopState:
    """What the loop carries from step to step, besides the model and the optimizer."""

    next_step: int = 0
    final_loss: float | None = None
    best_eval: float | None = None
    clipped_steps: int = 0


def _state_dicts(model, optimizer, ranks: Ranks) -> tuple[dict, dict]:
    if not ranks.real:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(run_dir: Path, model, optimizer, state: LoopState, ranks: Ranks) -> None:
    model_state, optimizer_state = _state_dicts(model, optimizer, ranks)  # a collective under torchrun
    if ranks.rank != 0:
        return
    path = run_dir / FILENAME
    tmp = path.with_name(f".{FILENAME}.tmp{os.getpid()}")
    torch.save({"model": model_state, "optimizer": optimizer_state, "loop": asdict(state),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp)
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: one line, naming the file and what to do."""


def read(path: Path) -> dict:
    """The checkpoint's contents, loaded with weights_only: tensors, numbers, strings and containers only, so a
    file dropped into a shared run folder runs no code on resume."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page; one of its lines names the object ("... unsupported GLOBAL posix.system ...")
        found = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        what = found[0].rstrip(".") if found else "objects torch will not load as weights"
        raise CheckpointError(f"error: {path}: refused, it holds more than tensors and numbers ({what}): loading it "
                              "could run code; remove it to start this run afresh") from None


def load(run_dir: Path, model, optimizer, ranks: Ranks) -> LoopState | None:
    """Restore the run's last checkpoint into model and optimizer; None when there is none."""
    path = run_dir / FILENAME
    if not path.exists():
        return None
    saved = read(path)
    if ranks.real:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    if saved["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda_rng"])
    state = LoopState(**saved["loop"])
    log.info("resumed from %s at step %d", path, state.next_step)
    return state


def remove(run_dir: Path, ranks: Ranks) -> None:
    if ranks.rank == 0:
        (run_dir / FILENAME).unlink(missing_ok=True)


@dataclass
class Checkpointer:
    """The loop's checkpoints in run_dir, every `every` steps: resumed from, saved, removed at the end."""

    run_dir: Path
    every: int
    ranks: Ranks

    def resume(self, model, optimizer) -> LoopState | None:
        return load(self.run_dir, model, optimizer, self.ranks)

    def due(self, step: int, steps: int) -> bool:
        """After `step`, a checkpoint is due (not after the last step: the run is then done)."""
        return (step + 1) % self.every == 0 and step + 1 < steps

    def save(self, model, optimizer, state: LoopState) -> None:
        save(self.run_dir, model, optimizer, state, self.ranks)

    def remove(self) -> None:
        remove(self.run_dir, self.ranks)
