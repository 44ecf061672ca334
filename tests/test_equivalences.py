"""Physics 2-3 (docs/design.md) on real training runs: SGD is linear in c, AdamW trades c for eps.
Also: every run in a comparison sees the same batches."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose, run_in_process, train_records


def losses(records):
    return [r["train/loss"] for r in train_records(records)]


def test_sgd_scale_equals_lr_times_scale(tmp_path, cache_dir):
    _, scaled = run_in_process(tmp_path / "a", ["optimizer=sgd", "optimizer.lr=0.05", "scale=8"])
    _, lr_scaled = run_in_process(tmp_path / "b", ["optimizer=sgd", "optimizer.lr=0.4", "scale=1"])
    assert losses(scaled) == pytest.approx(losses(lr_scaled), rel=1e-6, abs=0)
    assert losses(scaled)[-1] < losses(scaled)[0]  # it trained: the equality is not of two frozen runs


def test_sgd_coupled_weight_decay_breaks_the_equivalence(tmp_path, cache_dir):
    wd = "optimizer.weight_decay=0.5"
    _, scaled = run_in_process(tmp_path / "a", ["optimizer=sgd", "optimizer.lr=0.05", "scale=8", wd])
    _, lr_scaled = run_in_process(tmp_path / "b", ["optimizer=sgd", "optimizer.lr=0.4", "scale=1", wd])
    assert losses(scaled)[-1] != pytest.approx(losses(lr_scaled)[-1], rel=1e-4)


@pytest.mark.parametrize("scale", [8.0, 1000.0])
def test_adamw_scale_equals_eps_over_scale(tmp_path, cache_dir, scale):
    eps = 1e-8
    _, scaled = run_in_process(tmp_path / "a", ["optimizer=adamw", f"scale={scale}", f"optimizer.eps={eps}"])
    _, eps_traded = run_in_process(tmp_path / "b", ["optimizer=adamw", "scale=1", f"optimizer.eps={eps / scale}"])
    assert losses(scaled) == pytest.approx(losses(eps_traded), rel=1e-5)
    pairs = zip(train_records(scaled), train_records(eps_traded))
    grad_ratio = [a["train/grad_norm"] / b["train/grad_norm"] for a, b in pairs]
    assert grad_ratio == pytest.approx([scale] * len(grad_ratio), rel=1e-4)


def test_adamw_is_not_invariant_once_eps_dominates(tmp_path, cache_dir):
    """The contrast that makes the equivalence test meaningful: at c = 1e-9, eps swamps sqrt(v_hat)."""
    _, reference = run_in_process(tmp_path / "a", ["optimizer=adamw", "scale=1"])
    _, tiny = run_in_process(tmp_path / "b", ["optimizer=adamw", "scale=1e-9"])
    assert train_records(tiny)[-1]["adam/eps_dominated_frac"] > 0.99
    assert train_records(reference)[-1]["adam/eps_dominated_frac"] < 0.5
    assert abs(losses(tiny)[-1] - losses(reference)[-1]) > 1e-2


def test_batches_are_identical_across_optimizers_scales_and_world_sizes(tmp_path, cache_dir):
    runs = [
        ["optimizer=sgd", "scale=1", "world_size=8"],
        ["optimizer=adamw", "scale=8", "world_size=8", "fix=false"],
        ["optimizer=adamw", "scale=1", "world_size=1", "grad_accum=2"],
        ["optimizer=sgd", "scale=0.5", "world_size=4"],
    ]
    records = [train_records(run_in_process(tmp_path / str(i), r)[1]) for i, r in enumerate(runs)]
    tokens = [[r["train/tokens"] for r in rec] for rec in records]
    assert all(t == tokens[0] for t in tokens)
    assert len(set(tokens[0])) > 1  # trained-token counts differ from step to step
    first_losses = [rec[0]["train/loss"] for rec in records]  # same weights, same first batch
    assert first_losses == pytest.approx([first_losses[0]] * len(runs), rel=1e-6)


def test_batch_order_is_a_pure_function_of_seed_and_step(cache_dir):
    from gradscale.hydra_glue import to_object
    from gradscale.job import build_batches

    def batches(seed: int, world_size: int):
        return build_batches(to_object(compose([f"seed={seed}", f"world_size={world_size}"])))

    a, b, other_seed = batches(0, 8), batches(0, 1), batches(1, 8)
    n_steps = 3 * len(a.train) // a.batch_size  # crosses epoch boundaries
    for step in (0, 1, n_steps // 3, n_steps):
        for x, y in zip(a.train_batch(step), b.train_batch(step)):
            assert torch.equal(x, y)
    assert not torch.equal(a.train_batch(0)[0], other_seed.train_batch(0)[0])
    # each epoch visits every sequence once
    per_epoch = len(a.train) // a.batch_size
    seen = torch.cat([a.indices(s) for s in range(per_epoch)])
    assert len(set(seen.tolist())) == len(seen)


def test_bf16_autocast_trains_and_differs_from_fp32(tmp_path, cache_dir):
    """Also with either matmul kernels (gradscale/kernels.py): fp32 kernels on bf16 operands train as the bf16
    kernels do, closer to them than bf16 is to fp32 at the first step."""
    _, fp32 = run_in_process(tmp_path / "a", ["precision=fp32"])
    summary, bf16 = run_in_process(tmp_path / "b", ["precision=bf16", "bf16_matmul=native"])
    emulated_summary, emulated = run_in_process(tmp_path / "c", ["precision=bf16", "bf16_matmul=fp32"])
    assert (summary["bf16_matmul"], emulated_summary["bf16_matmul"]) == ("native", "fp32")
    assert losses(bf16)[-1] < losses(bf16)[0]
    assert losses(bf16) != losses(fp32)  # autocast really changed the arithmetic
    assert losses(bf16) == pytest.approx(losses(fp32), rel=2e-2)
    assert abs(losses(emulated)[0] - losses(bf16)[0]) < abs(losses(fp32)[0] - losses(bf16)[0]) / 5
    assert losses(emulated) == pytest.approx(losses(bf16), rel=2e-2)


def test_same_config_and_seed_give_identical_metrics(tmp_path, cache_dir):
    def without_timings(records):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]

    _, first = run_in_process(tmp_path / "a", ["optimizer=adamw", "seed=5"])
    _, second = run_in_process(tmp_path / "b", ["optimizer=adamw", "seed=5"])
    _, other_seed = run_in_process(tmp_path / "c", ["optimizer=adamw", "seed=6"])
    assert without_timings(first) == without_timings(second)
    assert without_timings(first) != without_timings(other_seed)
