"""Physics 13 (docs/design.md): the world-size bug under gradient clipping, on real AdamW runs of the tiny model.

Case (a), both runs clip at every step: the bug vanishes up to torch's 1e-6 term. Case (b), only the fixed run
clips: the bug stays, and Adam's update follows the norm-weighting prediction. The repair without the fix is
eps / N and max_norm / N; eps / N alone repairs nothing once the loop clips.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradscale import theory
from tests.conftest import run_in_process, train_records

N = 8  # the bug at world_size 8: c = 1/8
EPS = 1e-8
MAX_NORM = 0.5  # the tiny model's grad norms are about 0.6-1.2: the fixed run clips at every step, the bug at none
ALWAYS = 0.01  # below ||g|| / N at every step: both runs clip at every step
RUNS = {
    "fixed": [f"clip_grad_norm={MAX_NORM}"],
    "bug": ["fix=false", f"clip_grad_norm={MAX_NORM}"],
    "repair": ["fix=false", f"clip_grad_norm={MAX_NORM / N}", f"optimizer.eps={EPS / N}"],
    "eps_only": ["fix=false", f"clip_grad_norm={MAX_NORM}", f"optimizer.eps={EPS / N}"],
    "fixed_always": [f"clip_grad_norm={ALWAYS}"],
    "bug_always": ["fix=false", f"clip_grad_norm={ALWAYS}"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("clipping")
    common = ["optimizer=adamw", f"optimizer.eps={EPS}", "steps=40", "log_every=1", "eval_every=40"]
    return {name: train_records(run_in_process(root / name, [*common, *extra])[1]) for name, extra in RUNS.items()}


def column(records, key):
    return np.array([r[key] for r in records])


def loss_gap(runs, a, b) -> float:
    return float(np.abs(column(runs[a], "train/loss") - column(runs[b], "train/loss")).max())


def tolerance(runs) -> float:
    """What torch's 1e-6 term allows. Clipped at M (or c M at c = 1/N), the gradient handed to Adam is
    g M / (||g|| + 1e-6) in the fixed run and g M / (||g|| + N 1e-6) in the bug's: relative difference
    delta_t <= (N - 1) 1e-6 / min ||g||. Adam cancels a constant delta (it reaches only eps), so no step moves
    by more than delta relative, and the loss's path from L_0 by more than delta of its length, plus fp32's
    rounding of the loss itself."""
    norms, losses = column(runs["fixed"], "train/grad_norm"), column(runs["fixed"], "train/loss")
    delta = (N - 1) * 1e-6 / norms.min()
    return float(delta * np.abs(losses - losses[0]).max() + 4 * np.spacing(np.float32(losses[0])))


def test_the_setups_are_the_cases_they_claim(runs):
    norms = column(runs["fixed"], "train/grad_norm")  # before clipping: the gradient at c = 1
    assert theory.clipping_case(norms, 1 / N, MAX_NORM) == "b"
    assert theory.clipping_case(norms, 1 / N, ALWAYS) == "a"
    assert column(runs["fixed"], "train/clipped").all() and not column(runs["bug"], "train/clipped").any()
    assert column(runs["bug_always"], "train/clipped").all()
    coef = column(runs["fixed"], "train/clip_coef")
    assert coef == pytest.approx(MAX_NORM / (norms + 1e-6), rel=1e-6)  # the logged coefficient is torch's
    assert (column(runs["bug"], "train/clip_coef") == 1.0).all()


def test_repair_is_eps_and_max_norm_over_n_and_eps_alone_is_not(runs):
    tol = tolerance(runs)
    assert loss_gap(runs, "repair", "fixed") < tol
    assert loss_gap(runs, "eps_only", "fixed") > 100 * tol  # the unclipped repair does nothing here
    assert column(runs["repair"], "train/clipped").all()


def test_case_a_erased_case_b_not(runs):
    tol = tolerance(runs)
    assert loss_gap(runs, "bug_always", "fixed_always") < tol
    assert loss_gap(runs, "bug", "fixed") > 100 * tol
    losses = column(runs["fixed"], "train/loss")
    assert losses[-1] < losses[0] - 0.5  # it trained: the equalities are not of frozen runs


def test_case_b_update_follows_the_norm_weighting(runs):
    """The bug run's update over the fixed run's, step by step, against EMA(n) / sqrt(EMA(n^2)) of the grad norms."""
    norms = column(runs["fixed"], "train/grad_norm")
    predicted = theory.clipped_update_ratio(norms, 1 / N, MAX_NORM)
    measured = column(runs["bug"], "train/update_rms") / column(runs["fixed"], "train/update_rms")
    assert np.abs(measured - predicted).max() < 0.02
    assert measured.min() < 0.95  # the effect is there to be predicted: not a flat 1
    assert theory.clipped_update_ratio(norms, 1 / N, ALWAYS) == pytest.approx(1.0)  # case (a)
    assert theory.clipped_update_ratio(norms, 1 / N, None) == pytest.approx(1.0)  # no clipping: invariant
