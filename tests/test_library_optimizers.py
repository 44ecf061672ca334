"""The hand-written Lion and Adam-atan2 (gradscale/optimizers/_lion.py, _adam_atan2.py) against their PyPI packages,
lion-pytorch and adam-atan2-pytorch: the same lr, betas, weight decay (and a, b) give the same parameters and moments
over 20 steps of random gradients, on tensors of several shapes in two parameter groups (docs/optimizers.md).

Both libraries define weight decay as ours does, theta *= 1 - lr*wd before the update, when their
decoupled flag is off (their default); with it on they divide wd by the initial lr, so wd' = lr*wd maps onto
ours. adam-atan2-pytorch's defaults differ from the suite's (betas (0.9, 0.99), a = 1.27 instead of 4/pi), so every
argument is passed explicitly."""

from __future__ import annotations

import math

import pytest
import torch

from gradscale.optimizers._adam_atan2 import AdamAtan2
from gradscale.optimizers._lion import Lion

lion_pytorch = pytest.importorskip("lion_pytorch")
adam_atan2_pytorch = pytest.importorskip("adam_atan2_pytorch")

STEPS = 20
SHAPES = [(7, 5), (13,), (3, 4, 2), ()]
# Same math, different order of float32 operations: lerp against mul + add for the moments, b * sqrt(v / bc2)
# against sqrt(v * b^2 / bc2) for the denominator. Each step adds a few ulps (~1.2e-7 relative), so after 20
# steps the parameters (of order 1) agree to ~1e-7; 1e-6 leaves room and is still 1e-4 of one step's update
# (lr * a), so a different a, b, beta, bias correction or decay is far outside it.
TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def trajectory(optimizer_class, group_options: list[dict], seed: int = 0, skip=lambda step, i: False):
    """STEPS steps on SHAPES split into two parameter groups (the second with group_options[1], when given);
    gradients span four decades, as a model's do. skip(step, i): parameter i gets no gradient at that step.
    Returns (parameters, optimizer)."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in SHAPES]
    groups = [{"params": params[:2]}, {"params": params[2:], **(group_options[1] if len(group_options) > 1 else {})}]
    optimizer = optimizer_class(groups, **group_options[0])
    for step in range(STEPS):
        for i, p in enumerate(params):
            magnitude = 10 ** torch.empty(p.shape).uniform_(-3, 1, generator=generator)
            p.grad = None if skip(step, i) else torch.randn(p.shape, generator=generator) * magnitude
        optimizer.step()
    return params, optimizer


def assert_same(ours, theirs, moments: list[str]):
    (ours_params, ours_opt), (their_params, their_opt) = ours, theirs
    for p, q in zip(ours_params, their_params):
        torch.testing.assert_close(p, q, **TOLERANCE)
        for key in moments:
            torch.testing.assert_close(ours_opt.state[p][key], their_opt.state[q][key], **TOLERANCE)


def moved(params, seed: int = 0) -> float:
    """The largest distance a parameter travelled from its start (that the runs trained, and how far)."""
    generator = torch.Generator().manual_seed(seed)
    return max((p - torch.randn(shape, generator=generator)).abs().max().item() for p, shape in zip(params, SHAPES))


LION_SETTINGS = [
    [dict(lr=3e-4, betas=(0.9, 0.99), weight_decay=0.0)],  # gradscale/conf/optimizer/lion.yaml
    [dict(lr=1e-2, betas=(0.95, 0.98), weight_decay=0.5), dict(lr=3e-3, weight_decay=0.0)],
]
ATAN2_SETTINGS = [
    [dict(lr=1e-3, betas=(0.9, 0.999), a=4 / math.pi, b=1.0, weight_decay=0.0)],  # conf/optimizer/adam_atan2.yaml
    [dict(lr=1e-2, betas=(0.8, 0.95), a=1.5, b=2.0, weight_decay=0.5), dict(lr=3e-3, weight_decay=0.0, a=0.7)],
]


@pytest.mark.parametrize("settings", LION_SETTINGS, ids=["suite-defaults", "decay-two-groups"])
def test_lion_matches_lion_pytorch(settings):
    ours = trajectory(Lion, settings)
    assert_same(ours, trajectory(lion_pytorch.Lion, settings), ["exp_avg"])
    assert moved(ours[0]) > 0.5 * STEPS * settings[0]["lr"]  # sign updates of size lr: it trained


@pytest.mark.parametrize("settings", ATAN2_SETTINGS, ids=["suite-defaults", "decay-a-b-two-groups"])
def test_adam_atan2_matches_adam_atan2_pytorch(settings):
    ours = trajectory(AdamAtan2, settings)
    assert_same(ours, trajectory(adam_atan2_pytorch.AdamAtan2, settings), ["exp_avg", "exp_avg_sq"])
    assert moved(ours[0]) > 0.5 * STEPS * settings[0]["lr"]


def test_the_libraries_decoupled_flag_is_our_decay_divided_by_lr():
    """lion-pytorch's decoupled_weight_decay and adam-atan2-pytorch's decoupled_wd divide wd by the initial lr:
    theta *= 1 - wd'. Our theta *= 1 - lr*wd is theirs with wd' = lr*wd (equal up to the rounding of lr*wd/lr)."""
    lr, wd = 1e-2, 0.5
    assert_same(trajectory(Lion, [dict(lr=lr, weight_decay=wd)]),
                trajectory(lion_pytorch.Lion, [dict(lr=lr, weight_decay=lr * wd, decoupled_weight_decay=True)]),
                ["exp_avg"])
    common = dict(lr=lr, betas=(0.9, 0.999), a=4 / math.pi, b=1.0)
    assert_same(trajectory(AdamAtan2, [dict(common, weight_decay=wd)]),
                trajectory(adam_atan2_pytorch.AdamAtan2, [dict(common, weight_decay=lr * wd, decoupled_wd=True)]),
                ["exp_avg", "exp_avg_sq"])


def late_second(step: int, i: int) -> bool:
    """The first group's second parameter gets its first gradient at step 5."""
    return i == 1 and step < 5


def test_lion_skips_parameters_without_a_gradient_as_the_library_does():
    """A parameter without a gradient at a step keeps its value and momentum (weight decay included) in both."""
    settings = LION_SETTINGS[1]
    assert_same(trajectory(Lion, settings, skip=late_second), trajectory(lion_pytorch.Lion, settings, skip=late_second),
                ["exp_avg"])


def test_adam_atan2_counts_steps_per_parameter_as_the_library_does():
    """A parameter whose first gradient comes later than its group's first parameter's is bias-corrected with
    its own count, as the library (and torch's AdamW) does."""
    settings = ATAN2_SETTINGS[1]
    assert_same(trajectory(AdamAtan2, settings, skip=late_second),
                trajectory(adam_atan2_pytorch.AdamAtan2, settings, skip=late_second), ["exp_avg", "exp_avg_sq"])
