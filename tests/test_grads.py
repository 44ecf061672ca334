"""Physics 1 (docs/design.md): the bug is a pure rescale, and the pipeline matches real per-rank averaging.
Every test runs on the full fine-tune and on LoRA, where the pipeline sees only the adapters' gradients."""

from __future__ import annotations

import pytest
import torch

from gradscale.grads import GradPipeline, count_trained_tokens, token_loss_sum, total_norm
from gradscale.recipes import normalization_in_effect
from tests.conftest import compose


@pytest.fixture(scope="module", params=["full", "lora"])
def model_and_batch(cache_dir, request):
    from gradscale import model
    from gradscale.hydra_glue import to_object
    from gradscale.job import build_batches

    cfg = to_object(compose(["batch_size=16", "seq_len=64", f"finetune={request.param}"]))
    batches = build_batches(cfg)
    net = model.apply_finetune(model.build_model(cfg.model, cfg.seed, torch.device("cpu")), cfg.finetune)
    if request.param == "lora":  # B = 0 at init leaves A without gradient: one step of B makes both non-zero
        torch.nn.init.normal_(next(p for n, p in net.named_parameters() if "lora_B" in n), std=0.02)
    return net, batches.train_batch(0)


def trainable(net) -> list[torch.Tensor]:
    return [p for p in net.parameters() if p.requires_grad]


def summed_grads(net, inputs, targets) -> list[torch.Tensor]:
    """One device: backward of the summed token loss over the whole global batch."""
    net.zero_grad(set_to_none=True)
    token_loss_sum(net(input_ids=inputs).logits, targets).backward()
    return [p.grad for p in trainable(net)]


def pipeline_grads(net, inputs, targets, pipeline: GradPipeline) -> list[torch.Tensor]:
    summed_grads(net, inputs, targets)
    params = trainable(net)
    pipeline.apply(params, count_trained_tokens(targets))
    return [p.grad.clone() for p in params]


def assert_grads_close(actual, expected, rtol=1e-5):
    # fp32 summation order differs between the paths: compare whole-tensor relative error
    for a, e in zip(actual, expected):
        err = (a - e).norm() / e.norm().clamp_min(1e-30)
        assert err < rtol, f"relative error {err:.2e}"


def test_no_fix_is_exactly_one_over_world_size(model_and_batch):
    net, (inputs, targets) = model_and_batch
    fixed = pipeline_grads(net, inputs, targets, GradPipeline(world_size=8, scale=1.0))
    unfixed = pipeline_grads(net, inputs, targets,
                             GradPipeline(world_size=8, scale=1.0, recipe="global_tokens_no_world_fix"))
    assert_grads_close(unfixed, [g / 8 for g in fixed], rtol=1e-6)
    assert total_norm(unfixed) / total_norm(fixed) == pytest.approx(1 / 8, rel=1e-6)


def test_fixed_gradient_is_the_token_mean_gradient(model_and_batch):
    net, (inputs, targets) = model_and_batch
    fixed = pipeline_grads(net, inputs, targets, GradPipeline(world_size=8, scale=1.0))
    net.zero_grad(set_to_none=True)
    mean_loss = torch.nn.functional.cross_entropy(net(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
    mean_loss.backward()
    assert_grads_close(fixed, [p.grad for p in trainable(net)])


@pytest.mark.parametrize("fix", [True, False])
def test_emulated_ranks_match_real_per_rank_averaging(model_and_batch, fix):
    """Each of N ranks sums its own slice, DDP averages, then the fix factor: the same as emulation."""
    net, (inputs, targets) = model_and_batch
    world_size = 4
    per_rank = [[g.clone() for g in summed_grads(net, i, t)]
                for i, t in zip(inputs.chunk(world_size), targets.chunk(world_size))]
    averaged = [torch.stack(rank_grads).mean(0) for rank_grads in zip(*per_rank)]  # all-reduce AVG
    factor = (world_size if fix else 1) / count_trained_tokens(targets)
    expected = [g * factor for g in averaged]
    pipeline = GradPipeline(world_size, scale=1.0, recipe=normalization_in_effect(fix, "global_tokens"))
    emulated = pipeline_grads(net, inputs, targets, pipeline)
    assert_grads_close(emulated, expected)


@pytest.mark.parametrize("scale", [3.0, 1e-4, 1e4])
def test_scale_multiplies_the_grad_norm(model_and_batch, scale):
    net, (inputs, targets) = model_and_batch
    params = trainable(net)
    summed_grads(net, inputs, targets)
    norm_1, _ = GradPipeline(world_size=8, scale=1.0).apply(params, count_trained_tokens(targets))
    summed_grads(net, inputs, targets)
    norm_c, _ = GradPipeline(world_size=8, scale=scale).apply(params, count_trained_tokens(targets))
    assert (norm_c / norm_1).item() == pytest.approx(scale, rel=1e-5)  # fp32 norms of rounded products


def test_clipping_reports_pre_clip_norm_and_caps_the_gradient(model_and_batch):
    net, (inputs, targets) = model_and_batch
    params = trainable(net)
    summed_grads(net, inputs, targets)
    norm, coef = GradPipeline(8, scale=100.0, clip_grad_norm=0.5).apply(params, count_trained_tokens(targets))
    assert norm.item() > 0.5 and coef.item() == pytest.approx(0.5 / (norm.item() + 1e-6), rel=1e-6)
    assert total_norm([p.grad for p in params]).item() == pytest.approx(0.5, rel=1e-4)
    summed_grads(net, inputs, targets)
    _, coef = GradPipeline(8, scale=1e-6, clip_grad_norm=0.5).apply(params, count_trained_tokens(targets))
    assert coef.item() == 1.0


def test_unlogged_steps_skip_the_norm_unless_clipping_needs_it(model_and_batch):
    net, (inputs, targets) = model_and_batch
    params = trainable(net)
    summed_grads(net, inputs, targets)
    expected = pipeline_grads(net, inputs, targets, GradPipeline(world_size=8, scale=3.0))
    summed_grads(net, inputs, targets)
    assert GradPipeline(8, scale=3.0).apply(params, count_trained_tokens(targets), measure=False) == (None, None)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))  # scaled all the same
    summed_grads(net, inputs, targets)
    norm, coef = GradPipeline(8, scale=3.0, clip_grad_norm=1e-3).apply(
        params, count_trained_tokens(targets), measure=False)
    assert coef.item() < 1 and norm.item() > 1e-3  # clipping needs the norm on every step


def test_fix_is_resolved_into_the_normalization_once():
    """fix=false is the short switch for the pre-fix recipe: resolved when the config becomes dataclasses,
    so the pipeline, summary.json and the analysis see one recipe and one c_eff."""
    from gradscale.hydra_glue import to_object
    from gradscale.job import build_pipeline
    from gradscale.recipes import c_eff

    for overrides, recipe in ([[], "global_tokens"], [["fix=false"], "global_tokens_no_world_fix"],
                              [["normalization=global_tokens_no_world_fix"], "global_tokens_no_world_fix"],
                              [["normalization=local_mean"], "local_mean"]):
        cfg = to_object(compose(["scale=4", "world_size=8", *overrides]))
        assert cfg.normalization.name == recipe
        pipeline = build_pipeline(cfg, cfg.world_size)
        assert pipeline.recipe == recipe
        assert pipeline.c_eff == c_eff(4.0, recipe, 8) == (0.5 if recipe == "global_tokens_no_world_fix" else 4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4000, 2**22])  # 4 rows a block (33 tokens: the last has 1), and all
def test_token_losses_have_the_bits_of_cross_entropy_and_its_gradient(monkeypatch, dtype, block):
    """The loss a block of rows at a time: the same losses and logits gradient, bit for bit, as
    F.cross_entropy over the whole [tokens, vocabulary] matrix (and 0 for untrained targets)."""
    from gradscale import grads
    from gradscale.data import IGNORE_INDEX

    monkeypatch.setattr(grads, "CROSS_ENTROPY_BLOCK", block)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 1000, generator=generator) * 4).to(dtype)
    targets = torch.randint(0, 1000, (3, 11), generator=generator)
    targets[:, :2] = IGNORE_INDEX
    weights = torch.rand(3, 11, generator=generator)
    results = []
    for losses_of in (grads.token_losses, lambda x, t: torch.nn.functional.cross_entropy(
            x.flatten(0, 1).float(), t.flatten(), ignore_index=IGNORE_INDEX, reduction="none").view(t.shape)):
        x = logits.clone().requires_grad_()
        losses = losses_of(x, targets)
        (losses * weights).sum().backward()
        results.append((losses.detach(), x.grad))
    (losses, grad), (expected_losses, expected_grad) = results
    assert losses.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(losses, expected_losses) and torch.equal(grad, expected_grad)
    assert (losses[:, :2] == 0).all() and (losses[:, 2:] > 0).all()
