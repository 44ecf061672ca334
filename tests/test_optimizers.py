"""The registries (gradscale/optimizers/, gradscale/recipes.py) are the one place each optimizer and recipe
is defined, and every consumer reads them; and the two optimizers added through them, the Muon hybrid and
Adafactor, with their physics (docs/design.md): exactly invariant to c = 2^k until an eps binds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradscale.checks import ConfigError
from gradscale.optimizers import OPTIMIZERS, advisable, build_optimizer
from gradscale.recipes import RECIPES, c_eff, normalization_in_effect
from tests.conftest import CONF, compose
from tests.test_contrasts import LOOP, config, identical, trajectory


def test_every_option_file_is_a_registry_entry_and_back():
    assert sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml")) == sorted(OPTIMIZERS)
    assert sorted(p.stem for p in (CONF / "normalization").glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_entry_composes_validates_and_trains(name, cache_dir, tmp_path):
    """Its yaml fills its dataclass; the scale rule names keys the config has; one step through the suite's
    own job builder; and the entry's adam_state says truly whether its state holds Adam's moments with an
    eps (what the adam/* metrics, the histograms and the advisor read)."""
    from gradscale.config import validate
    from gradscale.job import build_job
    from gradscale.optimizer_stats import adam_moments
    from gradscale.train import LoopConfig, train

    entry = OPTIMIZERS[name]
    fields = {f.name for f in dataclasses.fields(entry.config)}
    rule = entry.scale_rule
    assert rule.eps_key is None or rule.eps_key in fields
    assert {key for key, _ in rule.twin} <= {"lr", rule.eps_key}  # what the analysis' twin rows can read
    raw = compose([f"optimizer={name}", *LOOP, "steps=1"])
    validate(raw, [])
    cfg = config([f"optimizer={name}", "steps=1"])
    assert type(cfg.optimizer) is entry.config
    job = build_job(cfg)
    assert train(job, LoopConfig.of(cfg)).status == "completed"
    covered = {id(moment[0]) for moment in adam_moments(job.optimizer)}
    trained = [p for p in job.model.parameters() if p.requires_grad]
    expected = {"all": len(trained), "part": "some", None: 0}[entry.adam_state]
    assert (0 < len(covered) < len(trained) if expected == "some" else len(covered) == expected), name
    # its state resumes through a checkpoint loaded with weights_only (no pickled objects in it)
    from gradscale import checkpoint

    checkpoint.save(tmp_path, job.model, job.optimizer, checkpoint.LoopState(next_step=1), job.ranks)
    assert checkpoint.load(tmp_path, job.model, job.optimizer, job.ranks).next_step == 1


def test_an_unknown_name_is_an_error_everywhere():
    from gradscale.config import validate
    from gradscale.grads import GradPipeline

    bad_optimizer = compose(["optimizer.name=adamm"])
    with pytest.raises(ConfigError, match=r"optimizer.name='adamm' is not allowed: one of adafactor, .*sgd"):
        validate(bad_optimizer, [])
    with pytest.raises(ConfigError, match="adamm"):
        build_optimizer(bad_optimizer.optimizer, [("w", torch.nn.Parameter(torch.ones(2)))])
    with pytest.raises(ConfigError, match="recipe='global_token' is not allowed"):
        GradPipeline(world_size=2, scale=1.0, recipe="global_token")  # never a silent factor of 1
    for call in (lambda: normalization_in_effect(False, "global_token"), lambda: c_eff(1.0, "global_token", 8)):
        with pytest.raises(ConfigError, match="normalization.name='global_token'"):
            call()
    with pytest.raises(ConfigError, match="normalization.name='local_means'"):
        validate(compose(["normalization.name=local_means"]), [])


def test_the_advisor_takes_the_optimizers_whose_update_eps_cuts():
    assert advisable() == ("adamw", "muon")
    assert advisable(whole_model=True) == ("adamw",)  # the hybrid's Muon part is not in its histograms


# ---------------------------------------------------------------------------------------------
# The Muon hybrid


def tiny_named_params():
    from gradscale import model

    cfg = config(["optimizer=muon"])
    net = model.build_model(cfg.model, 0, torch.device("cpu"))
    return cfg, net, [(n, p) for n, p in net.named_parameters() if p.requires_grad]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    cfg, _, named = tiny_named_params()
    optimizer = build_optimizer(cfg.optimizer, named)
    muon_group, adamw_group = optimizer.param_groups
    names = {id(p): n for n, p in named}
    muon = sorted(names[id(p)] for p in muon_group["params"])
    adamw = sorted(names[id(p)] for p in adamw_group["params"])
    assert muon and all(p.ndim == 2 for p in muon_group["params"])
    assert {n.rsplit(".", 2)[-2] for n in muon} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"}
    assert "model.embed_tokens.weight" in adamw and all("norm" in n or "embed" in n for n in adamw)
    assert len(muon) + len(adamw) == len(named)
    assert (muon_group["lr"], adamw_group["lr"], adamw_group["eps"]) == (0.02, 1e-3, 1e-8)


def test_the_muon_hybrid_resumes_from_its_state_dict_exactly():
    cfg, net, named = tiny_named_params()
    params = [p for _, p in named]
    torch.manual_seed(0)
    grads = [[torch.randn_like(p) * 1e-2 for p in params] for _ in range(4)]

    def steps(optimizer, grad_lists):
        for grad_list in grad_lists:
            for p, g in zip(params, grad_list):
                p.grad = g.clone()
            optimizer.step()

    start = [p.detach().clone() for p in params]
    straight = build_optimizer(cfg.optimizer, named)
    steps(straight, grads)
    after_straight = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    first = build_optimizer(cfg.optimizer, named)
    steps(first, grads[:2])
    resumed = build_optimizer(cfg.optimizer, named)
    resumed.load_state_dict(first.state_dict())
    steps(resumed, grads[2:])
    assert all(torch.equal(p, q) for p, q in zip(params, after_straight))
    assert resumed.parts[0].state is resumed.state and resumed.parts[1].param_groups[0] is resumed.param_groups[1]


def test_muon_on_fsdp2_shards_is_refused_in_one_line():
    from gradscale.config import validate

    with pytest.raises(ConfigError, match=r"^error: dist.strategy='fsdp2' is not allowed: optimizer=muon"):
        validate(compose(["optimizer=muon", "dist.strategy=fsdp2"]), [])


@pytest.fixture(scope="module")
def batches(cache_dir):
    from gradscale.job import build_batches

    return build_batches(config([]))


@pytest.mark.slow
def test_the_muon_hybrid_is_exactly_invariant_at_powers_of_two_but_for_its_adamw_eps(batches):
    """With the AdamW part's eps negligible (1e-30) the whole hybrid trains bit for bit the same at c = 2^k;
    at its default eps 1e-8 and c = 2^-10 it does not: the bug reaches Muon runs through the AdamW part."""
    cfg = config(["optimizer=muon", "optimizer.adamw_eps=1e-30"])
    reference, _ = trajectory(batches, cfg, 1.0)
    assert [k for k in (-10, -3, 3) if not identical(trajectory(batches, cfg, 2.0**k)[0], reference)] == []
    default = config(["optimizer=muon"])
    assert not identical(trajectory(batches, default, 2.0**-10)[0], trajectory(batches, default, 1.0)[0])


def test_muons_own_update_ignores_a_power_of_two_on_the_first_step(batches):
    """One step at c = 1 and c = 2^-10 from the same weights: the Muon part's matrices move the same to the
    bit, the AdamW part's embedding does not (its eps binds on the rarely seen rows)."""
    cfg = config(["optimizer=muon", "steps=1"])
    one, _ = trajectory(batches, cfg, 1.0)
    small, _ = trajectory(batches, cfg, 2.0**-10)
    for name, p in one.named_parameters():
        q = dict(small.named_parameters())[name]
        if p.ndim == 2 and "embed" not in name:
            assert torch.equal(p, q), name
    assert not torch.equal(one.model.embed_tokens.weight, small.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------
# Adafactor


@pytest.mark.slow
def test_adafactor_is_exactly_invariant_at_powers_of_two_until_eps1_binds(batches):
    cfg = config(["optimizer=adafactor", "optimizer.eps1=1e-30"])
    reference, _ = trajectory(batches, cfg, 1.0)
    assert [k for k in (-10, -3, 3) if not identical(trajectory(batches, cfg, 2.0**k)[0], reference)] == []
    default = config(["optimizer=adafactor"])  # eps1 = fp32's machine epsilon, 1.19e-7
    assert not identical(trajectory(batches, default, 2.0**-10)[0], trajectory(batches, default, 1.0)[0])


def test_adafactor_has_no_twin_and_no_adam_state():
    """Its eps1 enters twice, scaling as eps1 / c and eps1 / c^2: no c = 1 run equals the run at c."""
    entry = OPTIMIZERS["adafactor"]
    assert entry.scale_rule.kind == "eps" and entry.scale_rule.twin == () and entry.adam_state is None
    assert config(["optimizer=adafactor"]).optimizer.eps1 is None
