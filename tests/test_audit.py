"""The audit (gradscale/audit): its batch and layout, its comparison on made-up gradients, and on real gloo ranks
every zoo bug flagged with the multiplier its mechanism predicts while every fix passes (its mutation self-test),
the real HF Trainer, a user's own step, and the command's bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradscale.audit import (
    TOLERANCE,
    AuditError,
    Result,
    audit_many,
    batch_size_for,
    compare,
    counts_of,
    global_batch,
    layout,
    meaning,
    report,
    resolve_target,
)
from gradscale.audit.zoo import ZOO
from tests.conftest import OFFLINE_ENV, ROOT

GRID = [(n, k) for n in (1, 2, 4) for k in (1, 4)]


@pytest.mark.parametrize("n,k", GRID)
def test_layout_deals_every_sequence_once_raggedly_with_an_empty_micro_batch_under_accumulation(n, k):
    _, labels = global_batch(2048, batch_size_for([1, 2, 4], [1, 4]))
    counts = counts_of(labels)
    dealt = layout(counts, n, k)
    assert sorted(i for rank in dealt for mb in rank for i in mb) == list(range(len(counts)))
    per_micro_batch = [[sum(counts[i] for i in mb) for mb in rank] for rank in dealt]
    if k > 1:
        assert per_micro_batch[-1][-1] == 0  # the last rank's last micro-batch trains nothing
    if k > 1:  # every rank trains something, and the ranks' counts differ
        assert all(sum(r) > 0 for r in per_micro_batch)
        assert len({sum(r) for r in per_micro_batch}) == n
        assert len({t for r in per_micro_batch for t in r if t > 0}) > 2  # the trained micro-batches differ too
    if k == 1 and n == 2:  # the one layout with a rank that trains nothing (c = 1/2 for a per-rank mean)
        assert sum(per_micro_batch[1]) == 0
    if k == 1 and n > 2:  # every rank trains, so a bug confined to one rank shows without accumulation
        assert all(sum(r) > 0 for r in per_micro_batch) and len({sum(r) for r in per_micro_batch}) == n


def test_the_batch_has_a_label_no_position_predicts_and_ranks_differ_in_trained_sequences():
    from gradscale.audit.contract import IGNORE_INDEX

    _, labels = global_batch(2048, batch_size_for([1, 2, 4], [1, 4]))
    assert int((labels[:, 0] != IGNORE_INDEX).sum()) == 1  # an unshifted count is one token too many
    assert int((labels != IGNORE_INDEX).sum()) == sum(counts_of(labels)) + 1
    trained = [int((labels[i, 1:] != IGNORE_INDEX).any()) for i in range(len(labels))]
    for n, k in [(2, 4), (4, 1), (4, 4)]:  # a per-rank sequence count differs from the global one's share
        per_rank = [sum(trained[i] for mb in rank for i in mb) for rank in layout(counts_of(labels), n, k)]
        assert len(set(per_rank)) > 1, (n, k, per_rank)


def made_up(reference: dict[str, torch.Tensor], **scale_by_group) -> dict[str, torch.Tensor]:
    from gradscale.theory import tensor_group

    return {n: g * scale_by_group.get(tensor_group(n).split()[0], 1.0) for n, g in reference.items()}


@pytest.fixture
def reference():
    gen = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    return {n: torch.randn(7, 5, generator=gen, dtype=torch.float64) for n in names}


def result_of(reference, grads, logged=None, ranks=1):
    return compare(Result(ranks, 1, [[1]] * ranks), [grads] * ranks, [logged] * ranks, reference, TOLERANCE)


def test_compare_finds_a_uniform_multiplier_and_passes_the_reference(reference):
    assert result_of(reference, reference).ok
    half = result_of(reference, {n: g / 2 for n, g in reference.items()})
    assert not half.ok and half.c == pytest.approx(0.5, abs=1e-12) and half.residual < 1e-12
    assert half.reasons == ["gradient x0.5 the global token-mean's"]


def test_compare_names_the_group_that_differs(reference):
    result = result_of(reference, made_up(reference, MLP=4.0))
    assert result.group_c["MLP"] == pytest.approx(4.0) and result.group_c["attention"] == pytest.approx(1.0)
    assert result.reasons == ["tensor groups scaled unequally: MLP x4, embeddings / output x1, attention x1, norms x1 "
                              "(the MLP group alone is off)"]


def test_compare_flags_a_residual_and_a_logged_norm_and_a_nan(reference):
    tilted = dict(reference)
    tilted["model.norm.weight"] = reference["model.norm.weight"] + 0.3 * torch.ones_like(reference["model.norm.weight"])
    assert any(r.startswith("residual") for r in result_of(reference, tilted).reasons)
    true_norm = torch.cat([g.flatten() for g in reference.values()]).norm().item()
    logged = result_of(reference, reference, logged=true_norm / 2 ** 0.5)
    assert logged.logged_over_true == pytest.approx(2 ** -0.5)
    assert any(r.startswith("logged norm") for r in logged.reasons)
    assert result_of(reference, reference, logged=true_norm).ok
    nan = dict(reference)
    nan["model.norm.weight"] = reference["model.norm.weight"] * math.nan
    assert result_of(reference, nan).reasons[0].startswith("NaN in rank 0's gradient")


def test_compare_flags_a_small_group_off_within_the_overall_residual_and_renamed_parameters(reference):
    tilted = dict(reference)
    tilted["model.norm.weight"] = reference["model.norm.weight"] * 1.001  # one small group, 0.1% off
    result = result_of(reference, tilted)
    assert not result.ok and any(r.startswith("tensor groups") for r in result.reasons)
    renamed = {f"base_model.{n}": g for n, g in reference.items()}
    assert result_of(reference, renamed).reasons[0].startswith("the step changed the model's parameters")


def test_compare_reads_the_signatures_of_what_is_no_weighting_bug(reference):
    """A zero gradient says only that; a norm clipped to a round number says clipping; a residual of bf16's size
    says precision; the same gradient as at N = 1, K = 1 says another objective; c = T / (T + 1) an unshifted
    count."""
    zero = result_of(reference, {n: torch.zeros_like(g) for n, g in reference.items()})
    assert zero.reasons == ["the gradient is zero: did the step leave it in .grad?"]
    norm = torch.cat([g.flatten() for g in reference.values()]).norm()
    clipped = result_of(reference, {n: g / norm for n, g in reference.items()})
    assert "||g|| = 1 exactly" in clipped.reasons[0] and "clipped at max_norm 1" in clipped.reasons[0]
    gen = torch.Generator().manual_seed(1)
    rounded = {n: g * (1 + 2e-3 * torch.randn(g.shape, generator=gen, dtype=g.dtype)) for n, g in reference.items()}
    assert "of the order of bf16's rounding" in result_of(reference, rounded).reasons[0]
    other = {n: g.flip(0) for n, g in reference.items()}  # some other objective's gradient, at every layout
    same = compare(Result(2, 4, [[1], [1]]), [other] * 2, [None] * 2, reference, TOLERANCE, baseline=other)
    assert "the same gradient as at N = 1, K = 1" in same.reasons[0] and same.same_at_every_layout(TOLERANCE)
    unshifted = compare(Result(1, 1, [[60, 10]]), [{n: g * 70 / 71 for n, g in reference.items()}], [None], reference,
                        TOLERANCE)
    assert "= 70 / 71: one token too many in the count" in unshifted.reasons[0]


def test_compare_names_the_suspect_or_the_slot_weights_a_failing_gradient_is(reference):
    """Fitted where it fails: a named suspect's gradient, else any weighting of the micro-batches, with the odd one
    out named."""
    half = {n: g.clone() for n, g in reference.items()}
    for g in half.values():
        g[3:] = 0  # one micro-batch's share
    rest = {n: reference[n] - half[n] for n in reference}
    suspect = {n: half[n] + 3 * rest[n] for n in reference}
    fitted = compare(Result(2, 1, [[1], [1]]), [suspect] * 2, [None] * 2, reference, TOLERANCE,
                     suspects={"per-rank token means": suspect})
    assert fitted.reasons[0].endswith("the gradient is that of per-rank token means x1")
    slots = {(0, 0): half, (1, 0): rest}
    weighted = compare(Result(2, 1, [[1], [1]]), [suspect] * 2, [None] * 2, reference, TOLERANCE, slots=slots)
    assert "tokens weighted by where they are" in weighted.reasons[0] and "rank 1 x3" in weighted.reasons[0]


def test_objectives_weight_the_batch_as_named_and_a_bad_one_is_one_line():
    from gradscale.audit import OBJECTIVES, objective
    from gradscale.audit.objectives import trained_mask

    _, labels = global_batch(2048, 16)
    mask = trained_mask(labels)
    trained = mask.sum(1) > 0
    assert OBJECTIVES["token-mean"].weights(mask).sum() == pytest.approx(1)
    seq_mean = OBJECTIVES["seq-mean-token-mean"].weights(mask)
    assert seq_mean[trained].sum(1) == pytest.approx(torch.full((int(trained.sum()),), 1 / int(trained.sum())))
    assert OBJECTIVES["seq-mean-token-sum"].weights(mask).sum() == pytest.approx(mask.sum() / int(trained.sum()))
    assert objective("constant:512").weights(mask).sum() == pytest.approx(mask.sum() / 512)
    for bad in ("mean", "constant:0", "constant:x", "constant:inf"):
        with pytest.raises(AuditError, match=f"--objective {bad}: must be one of token-mean"):
            objective(bad)


def test_the_json_has_no_nan_at_any_depth(reference):
    from gradscale.audit import as_json

    nan = dict(reference)
    nan["model.norm.weight"] = reference["model.norm.weight"] * math.nan
    row = as_json("t", [result_of(reference, nan)], TOLERANCE)
    json.loads(json.dumps(row, allow_nan=False))  # raises on a NaN anywhere


def test_compare_flags_ranks_that_disagree(reference):
    other = {n: g * (1.001 if "norm" in n else 1.0) for n, g in reference.items()}
    result = compare(Result(2, 1, [[1], [1]]), [reference, other], [None, None], reference, TOLERANCE)
    assert any(r.startswith("ranks hold different gradients") for r in result.reasons)


def test_meaning_gives_sgds_lr_factor_and_adams_threshold():
    from gradscale.theory import update_ratio

    text = meaning(0.125)
    assert "SGD: the lr is in effect x0.125" in text and "sqrt(v_hat) < 6.2e-07" in text
    assert update_ratio(0.125, 6.2e-7, 1e-8) == pytest.approx(0.9)
    assert "no coordinate's update moves" in meaning(1.05)
    assert "clips the right gradient at M / 0.125 = 8 M instead" in text and "repair with eps and M both x0.125" in text


def test_a_bad_target_is_one_line_before_any_rank_starts():
    with pytest.raises(AuditError, match=r"target 'nope' is neither a built-in target \(.*hf_trainer"):
        resolve_target("nope")
    with pytest.raises(AuditError, match="cannot import 'no_such_module'"):
        resolve_target("no_such_module:step")
    with pytest.raises(AuditError, match="has no function 'nope'"):
        resolve_target("gradscale.audit.zoo:nope")


@pytest.mark.parametrize("args,message", [
    (["zoo_nope"], "error: target 'zoo_nope' is neither a built-in target"),
    (["global_token_mean", "--world-sizes", "3"], "error: --world-sizes 3: each must be one of 1, 2, 4, 8"),
    (["global_token_mean", "--accumulation", "1,x"], "--accumulation 1,x: comma-separated integers"),
    (["global_token_mean", "--tolerance", "0"], "error: --tolerance 0.0: must be in (0, 1)"),
    (["global_token_mean", "--world-sizes", "2,2"], "error: --world-sizes 2,2: each value once"),
    (["global_token_mean", "--objective", "seq-mean"], "error: --objective seq-mean: must be one of token-mean"),
    (["global_token_mean", "--reference", "nope"], "error: --reference: invalid choice: 'nope'"),
    (["global_token_mean", "--model", "tests.helpers.audit_model"], "error: --model tests.helpers.audit_model: must "
     "be module:factory"),
    (["global_token_mean", "--model", "tests.helpers.audit_model:nope"], "has no function 'nope'"),
    (["global_token_mean", "--model", "tests.helpers.audit_model:no_vocabulary"], "has no config.vocab_size"),
    (["global_token_mean", "--model", "tests.helpers.audit_model:with_dropout"], "drops out (p = 0.1)"),
    (["global_token_mean", "--json", "/nonexistent/x.json"],
     "--json /nonexistent/x.json: its folder '/nonexistent' does not exist"),
])
def test_the_command_refuses_bad_input_in_one_line_before_work(args, message):
    proc = subprocess.run([sys.executable, "-m", "gradscale.audit", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **OFFLINE_ENV})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr


ZOO_TARGETS = [e.name for e in ZOO] + sorted({e.fixed for e in ZOO})
ZOO_BY_NAME = {e.name: e for e in ZOO}
OWN_TARGETS = ["gradscale", "gradscale_global_tokens_no_world_fix", "examples.audit_step:fixed_step"]
FRAMEWORK_TARGETS = ["hf_trainer", "hf_trainer_no_token_average", "accelerate_docs_loop", "accelerate_token_loop"]
OPTIONAL_PEERS = ["trl_sft", "torchtune", "torchtune_pr2172",  # `make test` installs them (make peers)
                  "lightning_docs_loop", "lightning_token_loop"]


def installed(target: str) -> bool:
    try:
        resolve_target(target)
        return True
    except AuditError:
        return False


USER_STEPS = [f"tests.helpers.audit_steps:{name}" for name in (
    "seq_mean", "last_rank_doubled", "clipped_before_reduce", "zeroed_per_micro_batch", "bf16_reduction")]


@pytest.fixture(scope="module")
def audited():
    """Every target below on 1, 2 and 4 real ranks, K = 1 and 4: one launch per world size for all of them; each
    zoo entry against the objective its fix computes (or against its own N = 1, K = 1 gradient, where the fix
    computes no declared objective), every other target against the token mean."""
    layout_mode = {name for e in ZOO if e.reference == "layout" for name in (e.name, e.fixed)}
    targets = [t for t in ZOO_TARGETS if t not in layout_mode] + OWN_TARGETS + USER_STEPS
    objectives = {t: "token-mean" for t in targets} | {name: e.objective for e in ZOO for name in (e.name, e.fixed)}
    return {**audit_many(targets, world_sizes=(1, 2, 4), accumulations=(1, 4), objective=objectives),
            **audit_many(sorted(layout_mode), world_sizes=(1, 2, 4), accumulations=(1, 4), reference="layout")}


@pytest.fixture(scope="module")
def frameworks_audited():
    """The frameworks' own steps (transformers, Accelerate, and TRL and torchtune where installed), the same grid:
    the heaviest audits, in `make test-frameworks`."""
    optional = [t for t in OPTIONAL_PEERS if installed(t)]
    return audit_many(FRAMEWORK_TARGETS + optional, world_sizes=(1, 2, 4), accumulations=(1, 4))


@pytest.mark.distributed
@pytest.mark.slow
def test_every_zoo_bug_is_flagged_as_its_mechanism_predicts_and_every_fix_passes(audited):
    """The audit's mutation self-test: every bug and its fix."""
    results = audited
    for entry in ZOO:
        for r in results[entry.fixed]:
            assert r.ok, f"fix {entry.fixed} at N={r.world_size} K={r.accumulation}: {r.reasons}"
        for r in results[entry.name]:
            n, k = r.world_size, r.accumulation
            where = f"{entry.name} at N={n} K={k}: {r.reasons}"
            assert r.ok is not entry.shows(n, k), where
            if entry.expected_c is not None:
                assert r.c == pytest.approx(entry.expected_c(n, k, sum(map(sum, r.tokens))), rel=1e-5), where
            for group, c in (entry.expected_group_c or {}).items():
                assert r.group_c[group] == pytest.approx(c(n, k), rel=1e-5), where
                assert all(v == pytest.approx(1, rel=1e-5) for g, v in r.group_c.items() if g != group), where
                assert not entry.shows(n, k) or r.reasons[0].startswith("tensor groups scaled unequally"), where

    # the mechanisms that are no multiplier show as a residual, and the shard norm as the logged norm
    # the means show as a residual on every row where two groups with trained tokens are averaged; at N=2, K=1 the
    # second rank trains nothing, so there the mean is exactly half the right gradient (c = 1/2, no residual)
    for name in ("per_rank_mean", "per_microbatch_mean"):
        for r in results[name]:
            if (r.world_size, r.accumulation) == (2, 1):
                assert r.c == pytest.approx(0.5, rel=1e-5) and r.residual < TOLERANCE, name
            elif ZOO_BY_NAME[name].shows(r.world_size, r.accumulation):
                assert r.reasons[0].startswith("residual") and r.residual > 0.01, (name, r.reasons)
    assert all(r.logged_over_true < 1 - 0.1 for r in results["local_shard_norm"] if r.world_size > 1)
    # an auxiliary loss over N: a small residual the layout sets, alike at every K of a world size
    aux = {(r.world_size, r.accumulation): r for r in results["moe_aux_loss_over_dp"]}
    for n in (2, 4):
        assert "an auxiliary loss" in aux[n, 1].reasons[0], aux[n, 1].reasons
        assert aux[n, 1].residual == pytest.approx(aux[n, 4].residual, rel=1e-2)
    assert aux[2, 1].residual < aux[4, 1].residual


@pytest.mark.distributed
@pytest.mark.slow
def test_verdicts_say_what_the_signature_shows(audited):
    """A legitimate other objective is named as one, not as a reduction bug; a bug on the last rank alone shows
    without accumulation (K = 1) and names that rank; clipping, bf16 and zeroed gradients are read as such."""
    seq_mean = audited["tests.helpers.audit_steps:seq_mean"]
    assert all(not r.ok and "the gradient is that of seq-mean-token-mean x1" in r.reasons[0] for r in seq_mean)
    assert "with the same gradient at every layout (N = 1, K = 1 included)" in report("s", seq_mean, TOLERANCE)
    assert all(r.ok for r in audited["seq_mean_global"])  # the same step, declared seq-mean-token-mean
    last = {(r.world_size, r.accumulation): r for r in audited["tests.helpers.audit_steps:last_rank_doubled"]}
    assert not last[4, 1].ok and "rank 3 x2, the rest x1" in last[4, 1].reasons[0]
    assert last[1, 1].ok and last[2, 1].ok  # where the last rank trains nothing, nothing shows
    clipped = audited["tests.helpers.audit_steps:clipped_before_reduce"][0]
    assert "||g|| = 1 exactly" in clipped.reasons[0]
    bf16 = audited["tests.helpers.audit_steps:bf16_reduction"]
    assert all("of the order of bf16's rounding" in r.reasons[0] for r in bf16)
    assert "precision, not a reduction bug" in report("b", bf16, TOLERANCE)
    zeroed = {(r.world_size, r.accumulation): r for r in audited["tests.helpers.audit_steps:zeroed_per_micro_batch"]}
    assert zeroed[1, 4].reasons == ["the gradient is zero: did the step leave it in .grad? (rank 0's last micro-batch "
                                    "trains no token: a step that zeroes the gradients between micro-batches keeps "
                                    "only that one's)"]
    assert "the last micro-batch only x1" in zeroed[2, 4].reasons[0]
    unshifted = audited["unshifted_token_count"]
    assert all("one token too many in the count" in r.reasons[0] for r in unshifted)


@pytest.mark.distributed
def test_the_layout_reference_passes_any_split_invariant_objective_and_flags_a_per_rank_one():
    results = audit_many(["seq_mean_global", "seq_mean_per_rank"], world_sizes=(1, 2), accumulations=(1, 4),
                         reference="layout")
    assert all(r.ok for r in results["seq_mean_global"]), report("g", results["seq_mean_global"], TOLERANCE)
    assert results["seq_mean_global"][0].reference == ("layout: the step's own gradient at N = 1, K = 1, which is "
                                                       "seq-mean-token-mean x1")
    per_rank = results["seq_mean_per_rank"]
    assert [r.ok for r in per_rank] == [True, True, False, False]
    assert "the gradient depends on the layout, a bug whatever the objective" in report("p", per_rank, TOLERANCE)
    assert "per-rank sequence means x1" in per_rank[3].reasons[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_gradscales_own_recipes_and_the_docs_fixed_example_audit_as_documented(audited):
    fixed = audited["examples.audit_step:fixed_step"]
    assert all(r.ok for r in fixed), report("fixed_step", fixed, TOLERANCE)
    assert all(r.ok for r in audited["gradscale"]), report("gradscale", audited["gradscale"], TOLERANCE)
    for r in audited["gradscale_global_tokens_no_world_fix"]:
        assert r.c == pytest.approx(1 / r.world_size, rel=1e-5) and r.ok is (r.world_size == 1)


@pytest.mark.distributed
def test_the_docs_example_step_is_flagged_at_one_over_k_from_the_command_line(tmp_path):
    """examples/audit_step.py, docs/audit.md's example: divided by K on top of the global token count."""
    out = tmp_path / "audit.json"
    proc = subprocess.run([sys.executable, "-m", "gradscale.audit", "examples.audit_step:step", "--world-sizes",
                           "1,2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **OFFLINE_ENV})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "examples.audit_step:step: 2 of 4 configurations FAIL" in proc.stdout
    assert "what c = 0.25 means: SGD: the lr is in effect x0.25" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert [(r["world_size"], r["accumulation"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for r in rows:
        assert r["c"] == pytest.approx(1 / r["accumulation"], rel=1e-5) and r["ok"] is (r["accumulation"] == 1)
    assert "audit examples.audit_step:step: 2 ranks (gloo)" in proc.stderr  # progress, before the work


@pytest.mark.distributed
@pytest.mark.frameworks
def test_hf_trainer_passes_with_token_averaging_and_is_flagged_without_it(frameworks_audited):
    on, off = frameworks_audited["hf_trainer"], frameworks_audited["hf_trainer_no_token_average"]
    assert all(r.ok for r in on), report("hf_trainer", on, TOLERANCE)
    assert all(r.ok for r in off if r.world_size == 1)  # one rank: its own count is the global one
    assert all(not r.ok for r in off if r.world_size > 1), report("hf_trainer_no_token_average", off, TOLERANCE)


@pytest.mark.distributed
@pytest.mark.frameworks
def test_accelerates_first_loop_means_per_micro_batch_and_its_example_counts_unshifted(frameworks_audited):
    first = {(r.world_size, r.accumulation): r for r in frameworks_audited["accelerate_docs_loop"]}
    assert first[1, 1].ok and all(not r.ok for key, r in first.items() if key != (1, 1))
    assert "per-micro-batch token means x1" in first[1, 4].reasons[0]
    for r in frameworks_audited["accelerate_token_loop"]:  # right at every layout but for the one label at position 0
        tokens = sum(map(sum, r.tokens))
        assert r.c == pytest.approx(tokens / (tokens + 1), rel=1e-5) and r.residual < TOLERANCE
        assert "one token too many in the count" in r.reasons[0]


@pytest.mark.distributed
@pytest.mark.frameworks
def test_lightnings_docs_loop_means_per_micro_batch_and_its_token_count_loop_passes(frameworks_audited):
    """Lightning divides training_step's loss by accumulate_grad_batches and DDP averages over ranks: the model's
    own mean loss is a mean of micro-batch means; the loss over the global (shifted) count, x K x N, is right."""
    if not installed("lightning_docs_loop"):
        pytest.skip("lightning is not installed (make peers)")
    first = {(r.world_size, r.accumulation): r for r in frameworks_audited["lightning_docs_loop"]}
    assert first[1, 1].ok and all(not r.ok for key, r in first.items() if key != (1, 1))
    assert "per-micro-batch token means x1" in first[1, 4].reasons[0]
    assert all(r.ok for r in frameworks_audited["lightning_token_loop"]), report(
        "lightning_token_loop", frameworks_audited["lightning_token_loop"], TOLERANCE)


@pytest.mark.distributed
@pytest.mark.frameworks
def test_trl_passes_and_torchtune_weighs_the_micro_batch_with_a_first_label_apart(frameworks_audited):
    """torchtune 0.6.1 multiplies each micro-batch's mean loss by a count taken on unshifted labels (its recipe's
    line 778): the micro-batch holding the batch's one label at position 0 weighs (T_mb + 1) / T_mb as much as the
    rest, every weight over the global count T + 1. Right wherever one micro-batch alone trains."""
    if not all(installed(t) for t in OPTIONAL_PEERS):
        pytest.skip("the peers are not installed (make peers)")
    assert all(r.ok for r in frameworks_audited["trl_sft"]), report("trl_sft", frameworks_audited["trl_sft"], TOLERANCE)
    for r in frameworks_audited["torchtune"]:
        tokens = sum(map(sum, r.tokens))
        alone = sum(t > 0 for rank in r.tokens for t in rank) == 1
        assert r.ok is alone, report("torchtune", frameworks_audited["torchtune"], TOLERANCE)
        if not alone:
            assert f"the rest x{tokens / (tokens + 1):.4g}" in r.reasons[0] and r.residual < 0.05, r.reasons
    for r in frameworks_audited["torchtune_pr2172"]:
        assert r.c == pytest.approx(1 / r.world_size, rel=0.02) and r.ok is ((r.world_size, r.accumulation) == (1, 1))


@pytest.mark.distributed
@pytest.mark.frameworks
def test_deepspeeds_docs_loop_means_per_micro_batch_and_its_token_count_loop_passes():
    """DeepSpeed ZeRO 2 on the CPU, where the environment has deepspeed (`make peers` does not install it: its
    CPU ops compile at first use): engine.backward divides by K and the ranks average, so the model's own mean loss
    is a mean of micro-batch means, and the loss over the global count, x K x N, is right."""
    if not installed("deepspeed_docs_loop"):
        pytest.skip("deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
    results = audit_many(["deepspeed_docs_loop", "deepspeed_token_loop"], world_sizes=(1, 2, 4), accumulations=(1, 4))
    first = {(r.world_size, r.accumulation): r for r in results["deepspeed_docs_loop"]}
    assert first[1, 1].ok and all(not r.ok for key, r in first.items() if key != (1, 1))
    assert "per-micro-batch token means x1" in first[1, 4].reasons[0]
    assert first[2, 1].c == pytest.approx(0.5, rel=1e-5)  # the second rank trains nothing
    assert all(r.ok for r in results["deepspeed_token_loop"]), report(
        "deepspeed_token_loop", results["deepspeed_token_loop"], TOLERANCE)


GRPO_GRID = {"world_sizes": (1, 2), "accumulations": (1, 2, 4)}  # S = 1, 1, 8 (adapters.grpo_steps_per_generation)
GRPO_BEFORE_FIX = ["trl_grpo_1_9_0_dapo", "trl_grpo_1_9_0_cispo", "trl_grpo_1_9_0_vespo"]  # the losses PR 6024 fixed


@pytest.fixture(scope="module")
def grpo_audited():
    """TRL's GRPOTrainer in layout mode: every loss type of the current release (.peers/), and the losses PR 6024
    fixed in the release before it (.peers-trl-1.9.0/), each release in launches of its own (a rank process
    imports one trl)."""
    from gradscale.audit.adapters import GRPO_LOSS_TYPES

    current = [f"trl_grpo_{loss}" for loss in GRPO_LOSS_TYPES]
    if not all(installed(t) for t in current + GRPO_BEFORE_FIX):
        pytest.skip("the peers are not installed (make peers)")
    return {**audit_many(current, reference="layout", **GRPO_GRID),
            **audit_many(GRPO_BEFORE_FIX, reference="layout", **GRPO_GRID)}


def dapo_weights(r: Result, rescaled: bool) -> dict[tuple[int, int], float]:
    """Each trained micro-batch's weight, against the global token mean, under TRL's dapo normalizer: the token
    count of its generation batch over all ranks (num_items_in_batch), times K / S where PR 6024 rescales it. S >= K:
    one generation, the step's K micro-batches repeated S / K times (the adapter's); S < K: the next S micro-batches."""
    from gradscale.audit.adapters import grpo_steps_per_generation

    k, s = r.accumulation, grpo_steps_per_generation(r.accumulation)
    total = sum(map(sum, r.tokens))

    def items(j: int) -> float:
        first = j // s * s
        return total * s / k if s >= k else sum(rank[i] for rank in r.tokens for i in range(first, first + s))

    return {(rank, j): total / items(j) / (k / s if rescaled else 1)
            for rank, counts in enumerate(r.tokens) for j, n in enumerate(counts) if n}


def fitted_weights(r: Result) -> dict[tuple[int, int], float]:
    """The weights of the trained micro-batches as the failing row's reason names them (compare._slot_weights)."""
    import re

    line = r.reasons[0].split("weighted by where they are: ")[1]
    rest = re.search(r"the rest x([-0-9.e+]+)", line)
    named = re.findall(r"rank (\d+)(?: micro-batch (\d+))? x([-0-9.e+]+)", line)
    weights = {}
    for rank, counts in enumerate(r.tokens):
        for j, n in enumerate(counts):
            if n:
                found = [float(w) for a, b, w in named if int(a) == rank and b in ("", str(j))]
                weights[(rank, j)] = found[0] if found else float(rest.group(1))
    return weights


def assert_weighted_as(r: Result, weights: dict[tuple[int, int], float], name: str) -> None:
    """Every trained token weighted alike: a multiplier c of that weight, ok where it is 1. Else flagged with the
    weights predicted, up to the constant of the loss's own N = 1, K = 1 gradient (the 4 digits the reason gives)."""
    where = f"{name} at N={r.world_size} K={r.accumulation}: {r.reasons}"
    values = list(weights.values())
    if max(values) - min(values) <= 1e-9 * max(values):
        assert r.c == pytest.approx(values[0], rel=1e-5) and r.residual < TOLERANCE, where
        assert r.ok is (abs(values[0] - 1) < 1e-9), where
    else:
        assert not r.ok and r.residual > 0.01, where
        fitted = fitted_weights(r)
        ratios = [fitted[slot] / w for slot, w in weights.items()]
        assert max(ratios) == pytest.approx(min(ratios), rel=1e-3), (where, weights, fitted)


@pytest.mark.distributed
@pytest.mark.frameworks
def test_trl_grpo_before_pr_6024_is_flagged_with_k_over_steps_per_generation_and_the_current_release_passes(
        grpo_audited):
    """dapo, cispo and vespo divide by num_items_in_batch, the token count of a whole generation batch of S
    micro-batches: TRL 1.9.0 is flagged with c = K / S at K = 4, S = 8, where 1.16.0 (x K / S since PR 6024) passes.
    Where S < K (K = 2, S = 1) a step holds K / S generations, each over its own count: 1.9.0 sums their token
    means and 1.16.0 averages them, both weighting the tokens by their generation's count (a finding; ok by chance
    at N = 1, where one generation trains nothing under 1.9.0)."""
    for loss in ("dapo", "cispo", "vespo"):
        for rescaled, name in ((True, f"trl_grpo_{loss}"), (False, f"trl_grpo_1_9_0_{loss}")):
            for r in grpo_audited[name]:
                assert_weighted_as(r, dapo_weights(r, rescaled), name)
        for r in grpo_audited[f"trl_grpo_1_9_0_{loss}"]:
            if r.accumulation == 4:  # S = 8: the multiplier of issue 5619
                assert r.c == pytest.approx(4 / 8, rel=1e-5) and r.residual < TOLERANCE
        assert all(r.ok for r in grpo_audited[f"trl_grpo_{loss}"] if r.accumulation != 2), \
            report(loss, grpo_audited[f"trl_grpo_{loss}"], TOLERANCE)


@pytest.mark.distributed
@pytest.mark.frameworks
def test_trl_grpos_other_losses_are_layout_free_but_bnpo_which_means_per_micro_batch(grpo_audited):
    """grpo, sapo (each micro-batch's mean of sequence means / K: every micro-batch holds as many sequences),
    dr_grpo and luspo (a constant divisor) pass everywhere; bnpo divides each micro-batch by its own token count,
    as TRL documents: c = 1/2 where one micro-batch of two trains, elsewhere per-micro-batch token means."""
    for loss in ("grpo", "sapo", "dr_grpo", "luspo"):
        rows = grpo_audited[f"trl_grpo_{loss}"]
        assert all(r.ok for r in rows), report(loss, rows, TOLERANCE)
    for r in grpo_audited["trl_grpo_bnpo"]:
        total = sum(map(sum, r.tokens))
        weights = {(rank, j): total / (n * r.accumulation * r.world_size)
                   for rank, counts in enumerate(r.tokens) for j, n in enumerate(counts) if n}
        if len(set(weights.values())) == 1:
            assert_weighted_as(r, weights, "trl_grpo_bnpo")
        else:  # with one sequence per micro-batch, its token mean is that sequence's
            named = "seq-mean-token-mean" if r.sequences == r.world_size * r.accumulation else \
                "per-micro-batch token means x1"
            assert not r.ok and f"the gradient is that of {named}" in r.reasons[0], r.reasons


def test_the_current_trl_has_pr_6024s_rescaling_and_the_release_before_it_has_not():
    """The two TRL releases the GRPO audit runs, read from their folders without importing either."""
    import importlib.metadata
    import importlib.util

    from gradscale.audit.adapters import PEERS_DIR, TRL_BEFORE_PR_6024

    fix = "normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation"
    current = importlib.util.find_spec("trl")
    folders = {"current": Path(current.origin).parents[1] if current else PEERS_DIR, "before": TRL_BEFORE_PR_6024}
    if not all((f / "trl").is_dir() for f in folders.values()):
        pytest.skip("the peers are not installed (make peers)")
    version = {k: next(importlib.metadata.distributions(name="trl", path=[str(f)])).version for k, f in folders.items()}
    source = {k: (f / "trl" / "trainer" / "grpo_trainer.py").read_text() for k, f in folders.items()}
    assert version["before"] == TRL_BEFORE_PR_6024.name.rsplit("-", 1)[1] and fix not in source["before"]
    assert fix in source["current"], f"trl {version['current']} lacks PR 6024's fix"


def test_a_process_holding_one_trl_release_refuses_the_other_in_one_line(monkeypatch):
    """A launch mixing trl_grpo_* and trl_grpo_1_9_0_* targets: its ranks would import two trl; the second is
    refused (the tests audit each release in launches of their own)."""
    import types

    from gradscale.audit.adapters import TRL_BEFORE_PR_6024, peer

    old = types.ModuleType("trl")
    old.__file__ = str(TRL_BEFORE_PR_6024 / "trl" / "__init__.py")
    monkeypatch.setitem(sys.modules, "trl", old)
    monkeypatch.setattr(sys, "path", list(sys.path))  # peer() puts the folder on it
    with pytest.raises(AuditError, match=r"^error: this process imported trl from .*\.peers-trl-1\.9\.0/trl already: "
                                         r"audit the targets of each trl release in a launch of their own$"):
        peer("trl")
    assert peer("trl", TRL_BEFORE_PR_6024) is old


def test_a_missing_peer_is_one_line_naming_the_install(monkeypatch, tmp_path):
    from gradscale.audit import adapters

    monkeypatch.setattr(adapters, "PEERS_DIR", tmp_path / "none")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(AuditError, match=r"error: torchtune is not installed: pip install 'gradscale\[peers\]' "
                                         r"\(in a clone: make peers\)"):
        resolve_target("torchtune")
    with pytest.raises(AuditError, match=r"^error: trl is not installed in \.peers-trl-1\.9\.0/: make peers "
                                         r"\(in a clone\)$"):
        adapters.find_peer("trl", tmp_path / ".peers-trl-1.9.0")  # a pinned release: never the environment's trl


@pytest.mark.distributed
def test_a_model_of_the_users_own_is_audited_like_the_tiny_llama():
    """--model module:factory: a GPT-2 built by the user's function, the same weights on every rank."""
    results = audit_many(["global_token_mean", "ddp_mean_then_global_tokens"], world_sizes=(1, 2), accumulations=(1, 4),
                         model_spec="tests.helpers.audit_model:tiny_gpt2")
    assert all(r.ok for r in results["global_token_mean"]), report("g", results["global_token_mean"], TOLERANCE)
    for r in results["ddp_mean_then_global_tokens"]:
        assert r.c == pytest.approx(1 / r.world_size, rel=1e-5) and r.ok is (r.world_size == 1)


@pytest.mark.distributed
def test_the_pytest_helper_raises_with_the_table_and_passes_a_fix():
    from gradscale.audit import assert_gradient_matches

    with pytest.raises(AssertionError, match=r"(?s)N=1 K=4: gradient x4 the global.*1 of 2 configurations"):
        assert_gradient_matches("summed_accumulation", world_sizes=(1,), accumulations=(1, 4))
    assert len(assert_gradient_matches("engine_divides_by_accumulation", world_sizes=(1,), accumulations=(1, 4))) == 2


@pytest.mark.distributed
def test_a_step_that_fails_on_one_rank_is_named_with_its_error_and_the_jobs_after_it_still_run():
    results = audit_many(["tests.helpers.audit_failing_step:step", "global_token_mean"], world_sizes=(2,),
                         accumulations=(1, 4))
    failed = results["tests.helpers.audit_failing_step:step"]
    assert [r.reasons for r in failed] == [["the step failed: ZeroDivisionError: rank 1's logging divided by its "
                                            "empty micro-batch"]] * 2
    assert all(r.ok for r in results["global_token_mean"])  # relaunched after each failure
