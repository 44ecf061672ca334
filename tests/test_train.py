"""The training loop's logged update against the parameters' actual change, measured outside the loop."""

from __future__ import annotations

import math

import pytest
import torch

from gradscale import job, model, train
from gradscale.grads import total_norm
from gradscale.hydra_glue import to_object
from gradscale.optimizers import OPTIMIZERS as OPTIMIZER_REGISTRY
from gradscale.optimizers import build_optimizer
from gradscale.parallel import Ranks
from tests.conftest import compose, run_in_process, train_records


def optimizer_cases() -> dict[str, list[str]]:
    """Every optimizer of the registry (SGD with momentum and weight decay, so both act), and two settings
    that change the step: LoRA and clipping. A new registry entry is in every test below without a word."""
    overrides = {"sgd": ["optimizer.momentum=0.9", "optimizer.weight_decay=0.1"]}
    return {**{name: [f"optimizer={name}", *overrides.get(name, [])] for name in OPTIMIZER_REGISTRY},
            "lora": ["optimizer=adamw", "finetune=lora"], "clipped": ["optimizer=adamw", "clip_grad_norm=0.01"]}


OPTIMIZERS = optimizer_cases()


@pytest.mark.parametrize("overrides", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_logged_update_rms_is_the_rms_of_the_parameter_change(tmp_path, cache_dir, monkeypatch, overrides):
    """Every step is logged (TINY): train/update_rms equals, bit for bit, the norm of the weights' change
    over the whole step from a full copy, and the float64 RMS to the fp32 norm's accuracy (torch's CPU
    norm sums squares in fp32: Adam and Lion's near-constant |update| lose digits). The weights are read
    at each zero_grad, which the loop calls once per step, after the (chunked) optimizer step."""
    exact, float64 = [], []
    build = job.build_optimizer

    def build_watched(cfg, named_params):
        optimizer = build(cfg, named_params)
        params = [p for _, p in named_params]
        inner = optimizer.zero_grad
        before = [p.detach().clone() for p in params]

        def zero_grad(*args, **kwargs):
            update = torch._foreach_sub([p.detach() for p in params], before)
            n = sum(p.numel() for p in params)
            exact.append((total_norm(update) / math.sqrt(n)).item())
            float64.append(math.sqrt(sum(u.double().square().sum().item() for u in update) / n))
            before[:] = [p.detach().clone() for p in params]
            return inner(*args, **kwargs)

        optimizer.zero_grad = zero_grad
        return optimizer

    monkeypatch.setattr(job, "build_optimizer", build_watched)
    _, records = run_in_process(tmp_path, overrides)
    logged = [r["train/update_rms"] for r in train_records(records)]
    assert len(logged) == len(exact) == 4
    assert logged == exact
    assert logged == pytest.approx(float64, rel=1e-3)
    assert min(logged) > 0


@pytest.mark.parametrize("chunks", [1, 3, 1000], ids=["one chunk", "three", "a tensor each"])
@pytest.mark.parametrize("name", OPTIMIZER_REGISTRY)
def test_chunked_step_is_one_step_bit_for_bit(monkeypatch, name, chunks):
    """A logged step runs the optimizer a chunk of parameters at a time (train.step_measuring_update):
    weights and optimizer state equal those of one optimizer.step() bit for bit, and the returned norm
    equals the norm of the weights' change computed from a full copy."""
    cfg = to_object(compose(["model.init=random", *OPTIMIZERS[name]]))
    monkeypatch.setattr(train, "UPDATE_CHUNKS", chunks)
    nets = [model.build_model(cfg.model, cfg.seed, torch.device("cpu")) for _ in range(2)]
    params = [list(net.parameters()) for net in nets]
    optimizers = [build_optimizer(cfg.optimizer, list(net.named_parameters())) for net in nets]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator) for p in params[0]]
        grads[1] = None  # a parameter without a gradient stays untouched by both
        for net_params in params:
            for p, g in zip(net_params, grads):
                p.grad = None if g is None else g.clone()
        before = [p.detach().clone() for p in params[0]]
        optimizers[0].step()
        expected = total_norm(torch._foreach_sub([p.detach() for p in params[0]], before))
        measured = train.step_measuring_update(optimizers[1], params[1], Ranks(world_size=1))
        assert torch.equal(measured, expected)
        assert all(p.grad is None for p in params[1])  # each chunk's gradient freed once stepped
        for p, q in zip(*params):
            assert torch.equal(p, q)
            assert sorted(optimizers[0].state[p]) == sorted(optimizers[1].state[q])
            for key, value in optimizers[0].state[p].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizers[1].state[q][key])), key
        assert torch.equal(params[1][1], before[1])
