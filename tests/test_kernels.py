"""bf16 autocast's matmuls by fp32 kernels (experiments/kernels.py): the native bf16 arithmetic but for the order
of fp32 sums, in the forward and the backward, against the negative control of no autocast at all."""

from __future__ import annotations

import contextlib

import torch

from experiments import kernels


def forward_backward(net, x, mode):
    net.zero_grad()
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(x)
        (y.float() ** 2).mean().backward()
    return [y.detach().float(), *(p.grad.clone() for p in net.parameters())]


class CountingFp32Matmuls(kernels.Fp32Matmuls):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in kernels.MATMULS
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_fp32_kernels_give_the_bf16_kernels_results_to_their_rounding():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32))
    x = torch.randn(128, 64)
    native = forward_backward(net, x, contextlib.nullcontext())
    counting = CountingFp32Matmuls()
    emulated = forward_backward(net, x, counting)
    assert counting.calls == 2 + 3  # two forward products, three backward (the first layer's input needs none)
    with torch.enable_grad():
        net.zero_grad()
        y = net(x)
        (y ** 2).mean().backward()
    fp32 = [y.detach(), *(p.grad.clone() for p in net.parameters())]
    for a, b, c in zip(native, emulated, fp32):
        near = ((a - b).norm() / a.norm()).item()
        control = ((a - c).norm() / a.norm()).item()  # no autocast: bf16's own rounding, which the mode keeps
        assert near < 1e-3 and near < control / 5, (near, control)


def test_only_bf16_autocast_on_the_cpu_is_changed():
    cpu = torch.device("cpu")
    assert kernels.resolve("fp32", "fp32", cpu) is None
    assert kernels.resolve("native", "bf16", cpu) == "native"
    assert kernels.resolve("fp32", "bf16", cpu) == "fp32"
    assert kernels.resolve("auto", "bf16", cpu) in ("native", "fp32")


def test_a_bad_choice_is_refused_in_one_line(cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(["bf16_matmul=fast", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: bf16_matmul='fast' is not allowed: one of auto, native, fp32", proc.stderr
    assert not run_dir.exists()
