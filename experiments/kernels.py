"""bf16 autocast's matrix products on a CPU without bf16 matmul units (no AVX-512 BF16, no AMX), where PyTorch's
bf16 kernels run tens of times slower than fp32 ones (bf16_slowdown): the same products by fp32 kernels.
Autocast has rounded the operands to bf16, whose products are exact in fp32; the fp32 kernel sums them in fp32,
as a bf16 kernel does, and the result is rounded to bf16, as a bf16 kernel's is: the same arithmetic but for the
order of the sums, which differs between bf16 kernels too."""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
SLOW = 2.0


class Fp32Matmuls(TorchDispatchMode):
    """Every matmul whose tensors are all bf16 (autocast's forward and the backward's), by an fp32 kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in MATMULS and tensors and all(t.dtype == torch.bfloat16 for t in tensors):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


@functools.cache  # once per process: a sweep's jobs share the CPU it measures
def bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU, one thread (the best of a few
    size^3 products each, after warming up): below 1 with AVX-512 BF16 or AMX, tens without."""
    operands = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype))
                for dtype in (torch.float32, torch.bfloat16)}
    for a, b in operands.values():
        for _ in range(3):
            a @ b

    def best(a, b) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return best(*operands[torch.bfloat16]) / best(*operands[torch.float32])
    finally:
        torch.set_num_threads(threads)


def resolve(choice: str, precision: str, device: torch.device) -> str | None:
    """The matmul kernels a run uses: None (no bf16 autocast on the CPU), "native" or "fp32"."""
    if precision != "bf16" or device.type != "cpu":
        return None
    if choice == "auto":
        return "fp32" if bf16_slowdown() > SLOW else "native"
    return choice


def context(kernels: str | None) -> contextlib.AbstractContextManager:
    return Fp32Matmuls() if kernels == "fp32" else contextlib.nullcontext()
