#!/usr/bin/env bash
# Real data-parallel run (or sweep) of gradscale on N local ranks:
#   scripts/torchrun.sh N [ddp|fsdp2] [hydra overrides ...]
#   scripts/torchrun.sh 8 fsdp2 -m optimizer=sgd,adamw fix=true,false
# gloo on CPU, NCCL on CUDA. The output folder is fixed here once, so every rank writes to the same one.
set -euo pipefail
nproc=${1:?usage: scripts/torchrun.sh N [ddp|fsdp2] [overrides ...]}
shift
strategy=ddp
if [[ "${1:-}" == ddp || "${1:-}" == fsdp2 ]]; then strategy=$1; shift; fi
stamp=$(date +%Y-%m-%d/%H-%M-%S)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m gradscale.run \
  dist.strategy="$strategy" hydra.run.dir="outputs/$stamp" hydra.sweep.dir="multirun/$stamp" "$@"
