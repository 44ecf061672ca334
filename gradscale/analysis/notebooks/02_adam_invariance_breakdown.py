# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 — Where Adam's scale invariance breaks down
#
# AdamW(c*g, eps) == AdamW(g, eps/c): the update of a coordinate shrinks by r = c*s / (c*s + eps),
# where s is its sqrt(v_hat) at c = 1. The critical multiplier c* = eps/s differs across coordinates,
# so the breakdown is a band, not a cliff. This notebook puts the measured breakdown next to the band
# predicted from the reference run's measured sqrt(v_hat) quantiles, and next to SGD (which feels every
# factor) and the eps-free contrasts Adam-atan2 and Lion (which feel none).
#
# The sweep: `python -m gradscale.run -m experiment=scale_sweep` (made by `scripts/make_figures.sh`).

# %% tags=["parameters"]
import os

SWEEP_DIR = os.environ.get("GRADSCALE_SWEEP", "../../multirun/figures/scale_sweep")

# %%
# %matplotlib inline
from gradscale import theory
from gradscale.analysis import plots
from gradscale.analysis.load import load
from gradscale.analysis.tables import measured_bands, summary_table, theory_table

runs, curves = load(SWEEP_DIR)
bands = measured_bands(runs, curves)
summary_table(runs, curves).drop(columns=["reference"])

# %% [markdown]
# Predicted band: between eps/s_q90 (nine tenths of coordinates eps-dominated) and eps/s_q10 (the
# lowest tenth), with s the numel-weighted median over tensors of each quantile, spanning every step
# recorded in `adam_stats.jsonl` (early in training s is smaller, so the breakdown starts at larger c).

# %%
{name: {"c_start": c_start, "c_all": c_all} for name, (c_start, c_all) in bands.items()}

# %%
plots.breakdown(runs, curves, bands)

# %% [markdown]
# Where each setup's deviation passes 1% of the reference's final loss, against the predicted band.

# %%
theory_table(runs, curves)

# %% [markdown]
# The measured eps-dominated share (coordinates with sqrt(v_hat) < eps) and the update RMS: as c falls
# below the band, eps takes over the denominator and the update RMS collapses (Wortsman et al. 2023).

# %%
plots.adam_state(runs, curves)

# %% [markdown]
# The eps/c trade, from the theory: the run at scale c with eps behaves as scale 1 with eps/c.

# %%
{f"c={c:g}": f"eps_equivalent={theory.twin_value(1e-8, c, -1):.1e}" for c in sorted(set(runs.c_eff))}
