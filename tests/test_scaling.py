"""analysis.scaling: s quantiles from the histograms, the power-law fit, N_1%, and its command on a real sweep."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from gradscale import theory
from gradscale.analysis import advise, scaling
from gradscale.records import HIST_BINS, HIST_BINS_PER_DECADE, HIST_LOG10_MIN
from tests.conftest import OFFLINE_ENV, ROOT


def histogram_of_values(s: np.ndarray) -> theory.Histogram:
    counts = np.zeros(1 + HIST_BINS)
    index = np.floor((np.log10(s) - HIST_LOG10_MIN) * HIST_BINS_PER_DECADE).astype(int).clip(0, HIST_BINS - 1) + 1
    np.add.at(counts, index, 1)
    return theory.Histogram(counts, counts.copy())  # energy: one per coordinate


def test_quantile_is_the_values_quantile_to_bin_resolution():
    s = 10 ** np.random.default_rng(0).normal(-5, 1, 100_000)
    h = histogram_of_values(s)
    for q in (0.1, 0.5, 0.9):
        assert abs(math.log10(scaling.quantile(h, q) / np.quantile(s, q))) < 1 / HIST_BINS_PER_DECADE


def test_fit_recovers_a_power_law_and_its_interval_covers_the_truth():
    p = np.logspace(4, 7, 6)
    exact = scaling.fit_power_law(p, 3e-2 * p**-0.4)
    assert exact["b"] == pytest.approx(-0.4, abs=1e-9) and exact["b_stderr"] < 1e-9 and exact["r2"] == pytest.approx(1)
    noisy = scaling.fit_power_law(p, 3e-2 * p**-0.4 * 10 ** np.random.default_rng(1).normal(0, 0.05, p.size))
    centre, low, high = noisy["predict"](3e9)
    assert low < 3e-2 * 3e9**-0.4 < high and low < centre < high
    assert abs(noisy["b"] + 0.4) < 3 * noisy["b_stderr"] + 1e-3
    assert scaling.fit_power_law(p[:2], p[:2]) is None  # two points: no fit with an uncertainty
    assert scaling.student_t_975(4) == 2.776 and scaling.student_t_975(30) == pytest.approx(2.042, abs=1e-3)


def test_critical_world_size_is_where_the_update_is_cut_by_one_percent():
    h = histogram_of_values(10 ** np.random.default_rng(2).normal(-5, 1, 50_000))
    n = scaling.critical_world_size(h, 1e-8)
    assert theory.update_rms_ratio(h, 1 / n, 1e-8, 1e-8) == pytest.approx(advise.WITHIN, abs=1e-6)
    assert theory.update_rms_ratio(h, 1 / (2 * n), 1e-8, 1e-8) < advise.WITHIN


def analysis_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradscale.analysis.scaling", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **OFFLINE_ENV})


def test_width_sweep_to_fits_table_and_figure(cli, tmp_path):
    sweep = tmp_path / "widths"
    proc = cli(["-m", "experiment=width_scaling", "model.hidden_size=32,64,128", "steps=3", "eval_every=3",
                "eval_batches=1", "batch_size=8", "seq_len=64", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    point = next(sweep.glob("*hidden_size=128*"))
    proc = analysis_cli(str(sweep), "--point", str(point), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(tmp_path / "out" / "scaling.csv")
    assert list(table.hidden_size) == [32, 64, 128, 128]  # the three runs, then the --point
    assert table.parameters.is_monotonic_increasing and (table["s_median all"] > 0).all()
    assert (table.n_1pct > 1).all()
    text = (tmp_path / "out" / "scaling.md").read_text()
    assert "Llama 3.2 3B (95% interval)" in text and "s_median embeddings / output" in text
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 10_000


def test_bad_input_is_one_line(tmp_path):
    missing = str(tmp_path / "nope")
    proc = analysis_cli(missing)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: sweep folder {missing!r} does not exist"
    proc = analysis_cli(str(tmp_path))  # a folder without runs (an SGD run is refused by analysis.advise's loader)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"error: no AdamW run with sqrt(v_hat) " \
        f"histograms in {tmp_path}"
    proc = analysis_cli(str(tmp_path), "--eps", "-1")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --eps=-1.0 must be > 0"
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = analysis_cli(str(tmp_path), "--out", str(blocker / "report"))  # checked before the runs are read
    assert proc.returncode == 2 and proc.stderr.strip() == (f"error: --out={str(blocker / 'report')!r} cannot be "
                                                            f"written: {blocker} is not a folder")
