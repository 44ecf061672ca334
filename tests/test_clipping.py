"""Physics 13 (docs/design.md): the world-size bug under gradient clipping, on real AdamW runs of the tiny model.

Case (a), both runs clip at every step: the bug vanishes up to torch's 1e-6 term. Case (b), only the fixed run
clips: the bug stays, and Adam's update follows the norm-weighting prediction. The repair without the fix is
eps / N and max_norm / N; eps / N alone repairs nothing once the loop clips.
"""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from gradscale import theory
from gradscale.analysis.advise import advise, load_histograms, multipliers
from tests.conftest import TINY, compose, read_metrics, run_in_process, train_records

N = 8  # the bug at world_size 8: c = 1/8
EPS = 1e-8
MAX_NORM = 0.5  # the tiny model's grad norms are about 0.6-1.2: the fixed run clips at every step, the bug at none
ALWAYS = 0.01  # below ||g|| / N at every step: both runs clip at every step
RUNS = {  # the fixed runs record sqrt(v_hat) histograms at every step: the advisor's input
    "fixed": [f"clip_grad_norm={MAX_NORM}", "adam_stats_every=1"],
    "bug": ["fix=false", f"clip_grad_norm={MAX_NORM}"],
    "repair": ["fix=false", f"clip_grad_norm={MAX_NORM / N}", f"optimizer.eps={EPS / N}"],
    "eps_only": ["fix=false", f"clip_grad_norm={MAX_NORM}", f"optimizer.eps={EPS / N}"],
    "fixed_always": [f"clip_grad_norm={ALWAYS}", "adam_stats_every=1"],
    "bug_always": ["fix=false", f"clip_grad_norm={ALWAYS}"],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, cache_dir):
    """name -> the run's folder, with its metrics and its composed config in .hydra/ (as a run writes it)."""
    root = tmp_path_factory.mktemp("clipping")
    common = ["optimizer=adamw", f"optimizer.eps={EPS}", "steps=40", "log_every=1", "eval_every=40"]
    for name, extra in RUNS.items():
        run_in_process(root / name, [*common, *extra])
        (root / name / ".hydra").mkdir()
        OmegaConf.save(compose([*TINY, *common, *extra]), root / name / ".hydra" / "config.yaml")
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def runs(folders):
    return {name: train_records(read_metrics(folder)) for name, folder in folders.items()}


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


def test_a_few_clipped_steps_name_the_case_they_nearly_are():
    """20 fixed-run norms of 2-8.9 at max_norm 1, as SmolLM2's first steps: at N = 8 the bug run clips only
    the step at 8.9 (1 of 20), case (b) as over the whole fine-tune; three such steps are a mix."""
    norms = np.r_[8.9, np.linspace(2.0, 7.0, 19)]
    assert theory.clipped_share(1 / 8, norms, 1.0) == 0.05 and theory.clipped_share(1.0, norms, 1.0) == 1.0
    assert theory.clipping_case(norms, 1 / 8, 1.0) == "b"
    assert theory.clipping_case(np.r_[8.9, 8.5, 8.2, norms[3:]], 1 / 8, 1.0) == "mixed"
    assert theory.clipping_case(norms, 1 / 8, 0.1) == "a" and theory.clipping_case(norms / 100, 1 / 8, 1.0) == "c"
    assert theory.clipping_case(norms, 1 / 8, 0.26) == "a"  # 19 of 20 bug steps clip: the one at 2.0 does not
    # few clipped steps, but large early ones: sqrt(v_hat) remembers them, and neither (a) nor (c) holds
    few_large = np.r_[30.0, 30.0, np.full(18, 2.0)]  # the fixed run clips 2 of 20 at max_norm 5
    assert theory.clipping_case(few_large, 1 / 8, 5.0) == "mixed"
    assert theory.clipped_update_ratio(few_large, 1 / 8, 5.0)[-1] < 0.5
    assert theory.clipping_case(np.r_[np.full(18, 18.0), 0.5, 0.5], 1 / 8, 0.26) == "mixed"  # 18 of 20 both clip


def test_a_norm_logged_every_kth_step_stands_for_the_steps_since_the_last():
    """A run logs its grad norm every 5th step and at its last: the advisor's multipliers from those norms equal
    those of a run that logged every step with each logged norm held over the steps since the one before."""
    steps, logged = [0, 5, 10, 12], [9.0, 6.0, 3.0, 2.0]
    held = np.repeat(logged, [1, 5, 5, 2])  # steps 0, 1-5, 6-10, 11-12
    clip = {"max_norm": 1.0, "steps": steps, "grad_norms": logged}
    for step, upto in ((0, 1), (7, 6), (12, 13)):  # step 7: the norms logged up to step 5 (the last at or before it)
        every_step = held[:upto]
        expected = (theory.handed_multiplier(every_step, 1 / 8, 1.0)[-1],
                    theory.clipped_update_ratio(every_step, 1 / 8, 1.0)[-1])
        assert multipliers(clip, 1 / 8, step) == pytest.approx(expected)
    assert multipliers(None, 1 / 8, 12) == (1 / 8, 1.0)


def test_the_advisor_meets_eps_at_the_multiplier_clipping_hands_adam(folders, runs):
    """Where the loop clips, eps meets the handed gradient, min(c ||g||, M), not c g: in case (a) both runs are
    handed M g / ||g||, and the advisor predicts the update ratio 1 that the runs measure, where eps at c = 1/N
    would predict a cut (the negative control); in case (b) it follows the measured ratio step by step."""
    for fixed, bug, case in (("fixed_always", "bug_always", "a"), ("fixed", "bug", "b")):
        advice = advise(folders[fixed], [1 / N])
        predicted = np.array([s["predictions"][0]["update_rms_ratio"] for s in advice["steps"]])
        measured = column(runs[bug], "train/update_rms") / column(runs[fixed], "train/update_rms")
        assert advice["clipping"]["predictions"][0]["case"] == case and len(predicted) == len(measured) == 40
        assert np.abs(predicted - measured).max() < 0.02, (case, predicted, measured)
        seen = [s["predictions"][0]["handed_multiplier"] for s in advice["steps"]]
        assert seen == pytest.approx([1.0] * 40) if case == "a" else 1 / N < min(seen) <= max(seen) < 1
    eps, histograms = load_histograms(folders["fixed_always"])
    at_c = np.array([theory.update_rms_ratio(h["all"], 1 / N, eps, eps) for h in histograms.values()])
    measured = column(runs["bug_always"], "train/update_rms") / column(runs["fixed_always"], "train/update_rms")
    assert np.abs(at_c - measured).max() > 0.02  # c = 1/N at eps, clipping left out, fails the same tolerance


def test_the_report_reads_eps_dominated_shares_at_the_multiplier_sqrt_v_carries(folders):
    """In case (a) the bug hands Adam the fixed run's gradient: at c = 1/N, sqrt(v_hat) carries 1 and eps
    dominates no more coordinates than at c = 1. Read at c itself (the loop's clipping left out), it would."""
    from gradscale.analysis.advise import handed_multipliers
    from gradscale.analysis.load import load
    from gradscale.analysis.tables import eps_share_table

    runs, _ = load([folders["fixed_always"]])
    shares = eps_share_table(runs, handed_multipliers)
    assert (shares["c=1/8"] == shares["c=1"]).all()
    assert shares["handed multiplier"].str.startswith("1/8: 1, ").all()
    blind = eps_share_table(runs)
    assert (blind["c=1/1024"] > shares["c=1/1024"]).any() and "handed multiplier" not in blind


def test_the_report_pairs_the_repair_with_the_fixed_run_and_not_eps_alone(folders):
    """The theory's twin of the bug clipped at M is eps / N with max_norm M / N, not eps / N alone; and the advisor,
    which predicts the bug at the reference's eps and max_norm, is compared with the bug's run only."""
    from gradscale.analysis.advise import advisor_vs_measured
    from gradscale.analysis.load import load
    from gradscale.analysis.tables import equivalent_references

    runs, curves = load([folders[name] for name in ("fixed", "bug", "repair", "eps_only")])
    names = dict(zip(runs.path, runs.run))
    pairs = {(r.run, r.equivalent) for r in equivalent_references(runs).itertuples()}
    assert pairs == {(names[str(folders["repair"])], names[str(folders["fixed"])])}
    assert set(advisor_vs_measured(runs, curves).run) == {names[str(folders["bug"])]}
