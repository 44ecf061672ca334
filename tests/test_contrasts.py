"""Physics 7 (docs/design.md): Adam-atan2 and Lion have no eps, so with c = 2^k their fp32 trajectories equal the
c = 1 trajectory bit for bit; AdamW's does not (the contrast that shows the check can fail). Also why the
suite refuses AdamW at eps = 0, and LoRA: only the adapters train, through the same loop."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gradscale import model
from gradscale.checks import ConfigError
from gradscale.config import validate
from gradscale.hydra_glue import to_object
from gradscale.job import build_batches, build_job
from gradscale.optimizers._adam_atan2 import AdamAtan2
from gradscale.optimizers._lion import Lion
from gradscale.train import LoopConfig, train
from tests.conftest import compose

STEPS = 4
# the random init (no pretrained base to build), STEPS steps, every step logged, no statistics
LOOP = ["model.init=random", "batch_size=8", "seq_len=64", f"steps={STEPS}", "log_every=1", f"eval_every={STEPS}",
        "eval_batches=1", "adam_stats_every=null"]


@pytest.fixture(scope="module")
def batches(cache_dir):
    return build_batches(config([]))


def config(overrides: list[str]):
    return to_object(compose([*LOOP, *overrides]))


def trajectory(batches, cfg, scale: float) -> tuple[torch.nn.Module, float]:
    """STEPS steps of the suite's own loop at this scale; returns the trained model and its final loss."""
    job = build_job(replace(cfg, scale=scale), batches=batches)
    result = train(job, LoopConfig.of(cfg))
    return job.model, result.final_loss


def identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam_atan2", "lion"])
def test_eps_free_optimizers_are_exactly_scale_invariant(batches, name):
    cfg = config([f"optimizer={name}"])
    reference, reference_loss = trajectory(batches, cfg, 1.0)
    different = [k for k in range(-10, 11) if not identical(trajectory(batches, cfg, 2.0**k)[0], reference)]
    assert different == [], f"scale 2^k differs from scale 1 for k in {different}"
    init = model.build_model(cfg.model, cfg.seed, torch.device("cpu"))
    assert not identical(reference, init)  # it trained: the equality is not of two frozen models
    assert reference_loss == trajectory(batches, cfg, 2.0**-10)[1]


def test_adamw_is_not_bit_for_bit_invariant(batches):
    """eps = 1e-8 against sqrt(v_hat): the same check on AdamW fails at 2^-10, so the check above can fail."""
    cfg = config(["optimizer=adamw"])
    reference, _ = trajectory(batches, cfg, 1.0)
    scaled, _ = trajectory(batches, cfg, 2.0**-10)
    assert not identical(scaled, reference)


def test_adamw_eps_zero_is_nan_on_a_coordinate_without_gradient_and_refused():
    """Why eps = 0 is no invariance test: a coordinate whose gradient is always 0 (an unused embedding row)
    gets m_hat / sqrt(v_hat) = 0/0. The suite refuses the value before any work starts."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([weight], lr=1e-3, eps=0.0, weight_decay=0.0)
    weight.grad = torch.tensor([0.5, 0.0])
    optimizer.step()
    assert torch.isfinite(weight[0]) and torch.isnan(weight[1])
    with pytest.raises(ConfigError, match=r"optimizer.eps=0.0 is not allowed"):
        validate(compose(["optimizer=adamw", "optimizer.eps=0"]))


def test_contrast_update_rules_match_their_definitions():
    """One step from zero state, written out: Adam-atan2's update is lr*a*atan2(g, b*|g|) (bias-corrected
    moments of one gradient are g and g^2); Lion's is lr*sign(g); decoupled weight decay first."""
    g = torch.tensor([3.0, -2e-9, 0.0])
    for opt_cls, kwargs, update in [
        (AdamAtan2, dict(a=1.5, b=2.0), 1.5 * torch.atan2(g, 2.0 * g.abs())),
        (Lion, {}, torch.sign(g)),
    ]:
        weight = torch.nn.Parameter(torch.ones(3))
        optimizer = opt_cls([weight], lr=0.1, weight_decay=0.5, **kwargs)
        weight.grad = g.clone()
        optimizer.step()
        expected = torch.ones(3) * (1 - 0.1 * 0.5) - 0.1 * update
        assert torch.allclose(weight.detach(), expected, rtol=1e-6, atol=0), opt_cls.__name__


def test_lora_trains_only_the_adapters(batches):
    cfg = config(["finetune=lora", "optimizer=adamw"])
    base = model.build_model(cfg.model, cfg.seed, torch.device("cpu"))
    tuned, final_loss = trajectory(batches, cfg, 1.0)
    adapters = {n: p for n, p in tuned.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert {"lora_A", "lora_B"} == {part for n in adapters for part in n.split(".") if part.startswith("lora_")}
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
              for n, p in tuned.named_parameters() if not p.requires_grad}
    base_params = dict(base.named_parameters())
    assert frozen.keys() == base_params.keys()
    assert all(torch.equal(frozen[n], base_params[n]) for n in base_params)  # the base never moved
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # B starts at zero: it trained
    assert final_loss is not None
