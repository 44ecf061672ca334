#!/usr/bin/env bash
# Regenerates docs/figures/ (the figures and report.md of every study preset, as docs/findings.md cites
# them) and the committed notebook outputs, from real runs: the tiny presets on the pretrained tiny base
# (about 50 minutes on 2 CPU cores; width_scaling and its two other arms about 16 more), then the two
# SmolLM2 presets (about 25 and 30 more) and the advisor on SmolLM2 (about 9); each study is
# `scripts/study.sh NAME`, i.e.
#   python -m gradscale.run -m experiment=NAME
# Sweeps go to multirun/figures/NAME (replaced). One thread per run, as the findings were measured.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export WANDB_MODE=disabled OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# every preset, less the long studies that sweep into studies/ (their figures come from their kept runs)
presets=$(cd gradscale/conf/experiment && grep -L "hydra.sweep.dir=studies/" -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
studies=${*:-$presets}
# the user's command as `make sweep` runs it (README's first screen quotes its report; tests/test_cli.py checks it)
if [ -z "${*:-}" ]; then
  rm -rf multirun/figures/default_sweep
  env -u OMP_NUM_THREADS make sweep SWEEP_DIR=multirun/figures/default_sweep
  "$PY" -m gradscale.analysis.report multirun/figures/default_sweep --out docs/figures/default_sweep
fi
for name in $studies; do
  rm -rf "multirun/figures/$name"
  STUDY_DIR="multirun/figures/$name" PYTHON="$PY" scripts/study.sh "$name" wandb.mode=disabled
  "$PY" -m gradscale.analysis.report "multirun/figures/$name" --out "docs/figures/$name"
done
if [[ " $studies " == *" smollm2_breakdown "* ]]; then  # docs/analysis.md's advisor output on SmolLM2, and its figure
  rm -rf multirun/figures/advise_smollm2
  "$PY" -m gradscale.advise model=smollm2_135m optimizer.lr=1e-5 batch_size=8 seq_len=64 \
    hydra.run.dir=multirun/figures/advise_smollm2 --world-sizes 8,64,512,4096 --json multirun/figures/advise_smollm2/advice.json
  mkdir -p docs/figures/advise_smollm2
  cp multirun/figures/advise_smollm2/advice.{png,json} docs/figures/advise_smollm2/
fi
# width_scaling's other two arms (depth; the pretrained base at three widths), fitted with the first, and
# SmolLM2's advisor run beside the fits when it is there
if [[ " $studies " == *" width_scaling "* ]]; then
  for arm in "depth model.hidden_size=64 model.num_hidden_layers=1,2,4,8" \
             "pretrained model.init=pretrained model.hidden_size=32,64,128"; do
    rm -rf "multirun/figures/width_scaling_${arm%% *}"
    "$PY" -m gradscale.run -m experiment=width_scaling ${arm#* } hydra.sweep.dir="multirun/figures/width_scaling_${arm%% *}"
  done
  point=multirun/figures/advise_smollm2
  "$PY" -m gradscale.analysis.scaling multirun/figures/width_scaling{,_depth,_pretrained} --out docs/figures/width_scaling \
    $([ -d "$point" ] && echo --point "$point")
fi
for pair in 01_world_size_fix:world_size_fix 02_adam_invariance_breakdown:scale_sweep; do
  notebook=${pair%%:*} sweep=multirun/figures/${pair##*:}
  if [ -d "$sweep" ]; then  # --out: the committed notebook, on purpose
    "$PY" -m gradscale.analysis.notebook "gradscale/analysis/notebooks/$notebook.py" "$sweep" --out "gradscale/analysis/notebooks/$notebook.ipynb"
  fi
done
