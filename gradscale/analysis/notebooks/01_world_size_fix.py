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
# # 01 — The world-size fix: what the original bug report saw
#
# Data-parallel engines average gradients over N ranks; dividing the summed token loss by the global
# token count afterwards leaves the gradient N times too small (torchtune PR 2172). Reported: grad norms
# off by exactly N, AdamW loss curves that barely moved, SGD curves that moved a lot.
#
# The sweep: `python -m gradscale.run -m experiment=world_size_fix` (made by `scripts/make_figures.sh`;
# world_size = 8 emulated ranks): fix on, fix off, and the report's third run, fix on at lr / 8.

# %% tags=["parameters"]
import os

SWEEP_DIR = os.environ.get("GRADSCALE_SWEEP", "../../multirun/figures/world_size_fix")

# %%
# %matplotlib inline
from gradscale.analysis import plots
from gradscale.analysis.load import load
from gradscale.analysis.tables import equivalence_table, summary_table

runs, curves = load(SWEEP_DIR)
summary_table(runs, curves).drop(columns=["reference"])

# %% [markdown]
# Without the fix the optimizer is handed exactly 1/N of the gradient: the ratio to the fixed run is
# flat at c_eff = 1/N (dotted) for as long as the two trajectories coincide.

# %%
plots.grad_norm_ratio(runs, curves)

# %% [markdown]
# SGD feels the factor as a learning-rate cut of N; AdamW divides it out (up to eps).

# %%
plots.loss_curves(runs, curves)

# %%
plots.divergence(runs, curves)

# %% [markdown]
# The theory calls SGD's bug an exact learning-rate cut: SGD(lr, c = 1/N) == SGD(lr / N, c = 1). The
# report's third run (fix on at lr / N) is that pair; AdamW's lr / N run, by contrast, is a different run.

# %%
equivalence_table(runs, curves)
