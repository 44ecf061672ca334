"""bf16 autocast's matmuls by fp32 kernels (gradscale/kernels.py): the bf16 kernels' arithmetic but for the order
of the fp32 sums, in the forward and the backward, against the negative control of no autocast at all; which
kernels bf16_matmul picks, and what it says."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from gradscale import kernels, probes


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
        self.calls += self.takes(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_fp32_kernels_give_the_bf16_kernels_results_to_their_rounding():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32))
    x = torch.randn(128, 64)
    native = forward_backward(net, x, contextlib.nullcontext())
    counting = CountingFp32Matmuls()
    emulated = forward_backward(net, x, counting)
    assert counting.calls == 2 + 3  # two forward products, three backward (the input needs no gradient)
    net.zero_grad()
    y = net(x)
    (y ** 2).mean().backward()
    fp32 = [y.detach(), *(p.grad.clone() for p in net.parameters())]
    for a, b, c in zip(native, emulated, fp32):
        near = ((a - b).norm() / a.norm()).item()
        control = ((a - c).norm() / a.norm()).item()  # no autocast: bf16's own rounding, which the mode keeps
        assert near < 1e-3 and near < control / 5, (near, control)


def test_products_not_all_bf16_are_left_alone():
    a, b = torch.randn(8, 4), torch.randn(4, 8)
    with CountingFp32Matmuls() as mode:
        fp32 = a @ b
        with pytest.raises(RuntimeError):  # a mixed product fails as it does without the mode
            a.bfloat16() @ b
    assert mode.calls == 0 and fp32.dtype == torch.float32


@pytest.mark.parametrize(
    ("choice", "precision", "slowdown", "kernels_used", "said"),
    [
        ("auto", "bf16", 23.0, "fp32", "bf16 kernels are 23 times slower"),
        ("auto", "bf16", 0.4, "native", None),
        ("native", "bf16", 23.0, "native", "bf16_matmul=native: this CPU multiplies bf16 matrices 23 times slower"),
        ("native", "bf16", 0.4, "native", None),
        ("fp32", "bf16", 0.4, "fp32", None),
        ("auto", "fp32", 23.0, None, None),
    ],
)
def test_bf16_matmul_picks_the_kernels_and_says_why(monkeypatch, caplog, choice, precision, slowdown,
                                                    kernels_used, said):
    monkeypatch.setattr(probes, "bf16_slowdown", lambda: slowdown)
    with caplog.at_level(logging.INFO, logger="gradscale.kernels"):
        assert kernels.resolve(choice, precision, torch.device("cpu")) == kernels_used
    lines = [r.getMessage() for r in caplog.records]
    assert (lines == []) if said is None else (len(lines) == 1 and said in lines[0]), lines


def test_the_probe_measures_a_positive_ratio():
    assert probes.bf16_slowdown(size=64, repeats=1) > 0


def test_a_bad_choice_is_refused_in_one_line(cli, tmp_path):
    run_dir = tmp_path / "run"
    proc = cli(["bf16_matmul=fast", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: bf16_matmul='fast' is not allowed: one of auto, native, fp32", proc.stderr
    assert not run_dir.exists()


def test_both_kernels_round_the_exact_product_alike():
    """Against the float64 product of the bf16 operands, correctly rounded to bf16: both kernels miss it on a few
    elements in ten thousand (a sum's last bit deciding a rounding), in the forward's and the backward's layouts."""
    torch.manual_seed(0)
    layouts = {"x W^T": (torch.randn(128, 96), torch.randn(192, 96).t()),
               "g^T x": (torch.randn(128, 192).t(), torch.randn(128, 96))}
    for name, (a, b) in layouts.items():
        a, b = a.bfloat16(), b.bfloat16()
        exact = a.double() @ b.double()
        with kernels.Fp32Matmuls():
            emulated = a @ b
        for kernel, product in (("native", a @ b), ("fp32", emulated)):
            assert product.dtype == torch.bfloat16
            missed = (product != exact.bfloat16()).float().mean().item()
            assert missed < 1e-3, (name, kernel, missed)
        assert not torch.equal(emulated.double(), exact)  # rounded to bf16: not the exact product
