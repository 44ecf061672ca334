"""bf16 autocast's matrix products on a CPU without bf16 matmul units (no AVX-512 BF16, no AMX), where PyTorch's
bf16 kernels run tens of times slower than fp32 ones (probes.bf16_slowdown): the same products by fp32 kernels.
Autocast has rounded the operands to bf16, whose products are exact in fp32; the fp32 kernel sums them in fp32,
as a bf16 kernel does, and rounds the result to bf16, as a bf16 kernel does: the same arithmetic but for the
order of the sums, which differs between bf16 kernels too (docs/performance.md measures both)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)
aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
SLOW = 2.0  # bf16_matmul=auto takes fp32 kernels where bf16 ones are slower than this many times fp32's


class Fp32Matmuls(TorchDispatchMode):
    """Every matmul whose tensors are all bf16 (autocast's forward and the backward's), by an fp32 kernel."""

    @staticmethod
    def takes(func, args) -> bool:
        """A matmul whose tensors are all bf16: the products this mode runs by an fp32 kernel."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return func in MATMULS and bool(tensors) and all(t.dtype == torch.bfloat16 for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.takes(func, args):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def resolve(choice: str, precision: str, device: torch.device) -> str | None:
    """The matmul kernels a job uses (config bf16_matmul): None where there is no bf16 autocast on the CPU,
    else "native" or "fp32" (auto: by probes.bf16_slowdown, said in the log)."""
    from gradscale.probes import bf16_slowdown

    if precision != "bf16" or device.type != "cpu":
        return None
    slowdown = bf16_slowdown() if choice != "fp32" else None
    if choice == "auto":
        choice = "fp32" if slowdown > SLOW else "native"
        if choice == "fp32":
            log.info("bf16 matmuls by fp32 kernels on the bf16 operands (bf16_matmul=auto): this CPU's bf16 kernels "
                     "are %.0f times slower (no AVX-512 BF16 or AMX)", slowdown)
    elif choice == "native" and slowdown > SLOW:
        log.warning("bf16_matmul=native: this CPU multiplies bf16 matrices %.0f times slower than fp32 (no AVX-512 "
                    "BF16 or AMX); every step will crawl: bf16_matmul=auto is faster here", slowdown)
    return choice


def matmuls(kernels: str | None) -> contextlib.AbstractContextManager:
    """The context a job's forward and backward run in: Fp32Matmuls for "fp32", else nothing."""
    return Fp32Matmuls() if kernels == "fp32" else contextlib.nullcontext()
