#!/usr/bin/env bash
# Keep a long study's finished runs in the repository, so that the next working session finds them (run
# folders outside it may not survive) and its re-run of the same sweep skips them:
#   scripts/keep_runs.sh SWEEP_DIR          e.g. scripts/keep_runs.sh studies/smollm2_long_finetune
# A run is kept when it is finished as a re-run sees it (gradscale.sweep.is_finished: completed or
# diverged) and holds no checkpoint. Its adam_stats.jsonl is gzipped (analysis reads FILE.jsonl.gz the same
# way; about 5 MB a 600-step SmolLM2 run before), and only what the analysis reads is staged with git add:
# .hydra/, metrics.jsonl, adam_stats.jsonl.gz, summary.json, run.log. A running, killed or failed job is left
# alone: its checkpoint resumes it. The sweep folder must be inside the repository (studies/). Commit afterwards.
set -euo pipefail
sweep=${1:-}
if [ -z "$sweep" ] || [ ! -d "$sweep" ]; then
  echo "error: '${sweep}' is not a sweep folder (usage: scripts/keep_runs.sh SWEEP_DIR)" >&2
  exit 2
fi
if git -C "$sweep" check-ignore -q . 2>/dev/null || ! git -C "$sweep" rev-parse --show-toplevel >/dev/null 2>&1; then
  echo "error: $sweep is not a folder git keeps (ignored, or outside a repository): use studies/NAME" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3 )}
kept=0
for run in "$sweep"/*/; do
  finished=$(cd "$root" && "$PY" -c 'import sys; from pathlib import Path; from gradscale.sweep import is_finished
print(is_finished(Path(sys.argv[1])))' "$run")
  if [ "$finished" != True ] || ls "$run"/checkpoint.pt "$run"/.checkpoint.pt.tmp* >/dev/null 2>&1; then
    continue
  fi
  if [ -f "$run/adam_stats.jsonl" ]; then gzip -9 -n -f "$run/adam_stats.jsonl"; fi
  for name in .hydra metrics.jsonl adam_stats.jsonl.gz summary.json run.log; do
    if [ -e "$run/$name" ]; then git -C "$run" add -- "$name"; fi
  done
  echo "kept $run ($(du -sh "$run" | cut -f1))"
  kept=$((kept + 1))
done
if [ -f "$sweep/multirun.yaml" ]; then git -C "$sweep" add -- multirun.yaml; fi
echo "$kept finished runs of $sweep staged; commit them"
