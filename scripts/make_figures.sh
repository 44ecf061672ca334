#!/usr/bin/env bash
# Regenerates docs/figures/ and the committed notebook outputs from two real sweeps at the default
# (tiny) model size, about 6 minutes on 2 CPU cores:
#   world_size_fix: python -m experiments.run -m optimizer=sgd,adamw fix=true,false
#   scale_sweep:    python -m experiments.run -m optimizer=sgd,adamw scale=1e-8,1e-6,1e-4,1e-2,1,100
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=multirun/figures
rm -rf "$out/world_size_fix" "$out/scale_sweep"
export WANDB_MODE=disabled
"$PY" -m experiments.run -m optimizer=sgd,adamw fix=true,false wandb.mode=disabled \
  hydra.sweep.dir="$out/world_size_fix"
"$PY" -m experiments.run -m optimizer=sgd,adamw scale=1e-8,1e-6,1e-4,1e-2,1,100 wandb.mode=disabled \
  hydra.sweep.dir="$out/scale_sweep"
for sweep in world_size_fix scale_sweep; do
  "$PY" -m analysis.report "$out/$sweep" --out "docs/figures/$sweep"
done
"$PY" -m analysis.notebook analysis/notebooks/01_world_size_fix.py "$out/world_size_fix"
"$PY" -m analysis.notebook analysis/notebooks/02_adam_invariance_breakdown.py "$out/scale_sweep"
