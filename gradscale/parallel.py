"""Ranks: one process emulating `world_size` ranks, or one of `world_size` real ranks under torchrun.

Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment) the process group uses gloo on
CPU and NCCL on CUDA (with gloo beside it for CPU tensors), and the model is wrapped by a real
engine that averages gradients over ranks: DistributedDataParallel (`dist.strategy=ddp`) or FSDP2
(`dist.strategy=fsdp2`: `fully_shard` per decoder layer and on the root). Each rank takes its block
of the same global batch the emulated run uses: rank r gets sequences [r*B/N, (r+1)*B/N).

Every collective of the training loop goes through `Ranks.sum`, which runs it on the backend's
device: NCCL refuses CPU tensors ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

def adopt_slurm_tasks() -> None:
    """Under the SLURM launcher (submitit, one task per GPU), export the variables torchrun would set."""
    if under_torchrun() or int(os.environ.get("SLURM_NTASKS", "1")) < 2 or "SUBMITIT_FOLDER" not in os.environ:
        return
    import submitit

    # LOCAL_RANK picks the GPU. overwrite: without it export raises when MASTER_PORT is already set, the one
    # variable it reads to keep (a port chosen in the job's setup lines); MASTER_ADDR becomes the first node.
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port free on this host now, for a process group of spawned ranks (the parity oracle, the audit)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Ranks:
    world_size: int
    rank: int = 0
    real: bool = False  # False: ranks emulated in this one process
    strategy: str = "ddp"
    device: torch.device = torch.device("cpu")  # where collectives run: the training device

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state are shards: norms need a sum over ranks."""
        return self.real and self.strategy == "fsdp2"

    def local_block(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's block of each global-batch tensor (all of it when emulated)."""
        if not self.real:
            return tensors
        return tuple(t.chunk(self.world_size)[self.rank] for t in tensors)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM on the collective device, returned on value's own device (identity when emulated)."""
        if not self.real:
            return value
        on_device = value.to(self.device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        return on_device.to(value.device)

    def sum_if_sharded(self, value: torch.Tensor) -> torch.Tensor:
        return self.sum(value) if self.sharded else value


def setup(strategy: str, world_size: int, timeout_s: float, device: torch.device) -> Ranks:
    """Join the torchrun process group if there is one; `world_size` is then already the env's."""
    if not under_torchrun():
        return Ranks(world_size=world_size)
    if not dist.is_initialized():  # a sweep under torchrun runs many jobs in the same processes
        if device.type == "cuda":  # before the group: NCCL binds each rank to its current device
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(finish)
    ranks = Ranks(world_size=dist.get_world_size(), rank=dist.get_rank(), real=True, strategy=strategy,
                  device=device)
    log.info("rank %d of %d (%s, %s)", ranks.rank, ranks.world_size, strategy, dist.get_backend())
    return ranks


def device_for(device_cfg: str) -> torch.device:
    if device_cfg == "cpu" or (device_cfg == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def wrap(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """The engine that averages gradients over ranks; the model itself when emulated."""
    if not ranks.real:
        return model
    if ranks.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ranks.device.index] if ranks.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # an explicit mesh: FSDP2's default is the machine's accelerator, even for a CPU run on a GPU node
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft LoRA wrapper
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor (the tensor itself otherwise)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def finish() -> None:
    """At exit: wait (30 s at most) until every rank is done before tearing down, so that no rank's
    gloo threads see a peer's connections close under them (an occasional SIGABRT at exit otherwise)."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        else:
            dist.barrier(device_ids=[torch.cuda.current_device()])
    except Exception as e:  # a peer already gone: tear down all the same
        log.warning("ranks did not meet at exit (%s)", e)
    dist.destroy_process_group()
