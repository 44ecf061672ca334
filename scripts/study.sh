#!/usr/bin/env bash
# One study preset (gradscale/conf/experiment/NAME.yaml), then its report:
#   scripts/study.sh NAME [OVERRIDES...]        e.g. scripts/study.sh scale_sweep
#   scripts/study.sh clipping smoke=on          every job shrunk to seconds, to check the command
# The sweep goes to multirun/studies/NAME/DATE_TIME (STUDY_DIR=... to choose; re-using one is refused by
# nothing here, so pick a new one), the report to its report/ folder. The report is written even when a
# run failed; the script then exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
studies=$(cd gradscale/conf/experiment && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
name=${1:-}
if [ -z "$name" ] || [ ! -f "gradscale/conf/experiment/$name.yaml" ]; then
  echo "error: study '${name}' is not one of: ${studies% }" >&2
  echo "usage: scripts/study.sh NAME [OVERRIDES...]" >&2
  exit 2
fi
shift
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
dir=${STUDY_DIR:-multirun/studies/$name/$(date +%Y-%m-%d_%H-%M-%S)}
WANDB_MODE=${WANDB_MODE:-offline} "$PY" -m gradscale.run -m experiment="$name" hydra.sweep.dir="$dir" "$@"
status=$?
[ -d "$dir" ] && "$PY" -m gradscale.analysis.report "$dir" || status=$((status ? status : 1))
if [ "$name" = width_scaling ] && [ -d "$dir" ]; then  # its question is answered by the fit, not the pairs
  "$PY" -m gradscale.analysis.scaling "$dir" || status=$((status ? status : 1))
fi
exit "$status"
