#!/usr/bin/env bash
# Regenerates docs/figures/ (the figures and report.md of every study preset, as docs/findings.md cites
# them) and the committed notebook outputs, from real runs: the tiny presets on the pretrained tiny base
# (about 50 minutes on 2 CPU cores), then the two SmolLM2 presets (about 25 and 30 more); each study is
# `scripts/study.sh NAME`, i.e.
#   python -m experiments.run -m experiment=NAME
# Sweeps go to multirun/figures/NAME (replaced). One thread per run, as the findings were measured.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
studies=${*:-world_size_fix scale_sweep eps_vs_scale lr_vs_scale clipping precision smollm2_world_size_fix smollm2_breakdown}
for name in $studies; do
  rm -rf "multirun/figures/$name"
  STUDY_DIR="multirun/figures/$name" PYTHON="$PY" scripts/study.sh "$name" wandb.mode=disabled
  "$PY" -m analysis.report "multirun/figures/$name" --out "docs/figures/$name"
done
for pair in 01_world_size_fix:world_size_fix 02_adam_invariance_breakdown:scale_sweep; do
  notebook=${pair%%:*} sweep=multirun/figures/${pair##*:}
  if [ -d "$sweep" ]; then  # --out: the committed notebook, on purpose
    "$PY" -m analysis.notebook "analysis/notebooks/$notebook.py" "$sweep" --out "analysis/notebooks/$notebook.ipynb"
  fi
done
