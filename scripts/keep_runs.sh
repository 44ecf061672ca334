#!/usr/bin/env bash
# Keep a long study's finished runs in the repository, so that the next working session finds them (run
# folders outside it may not survive) and its re-run of the same sweep skips them:
#   scripts/keep_runs.sh SWEEP_DIR          e.g. scripts/keep_runs.sh studies/smollm2_long_finetune
# For every job folder whose summary.json says completed, diverged or failed: adam_stats.jsonl is gzipped
# (analysis reads ADAM_STATS.jsonl.gz the same way; about 5 MB a 600-step SmolLM2 run before) and the folder
# is staged with git add (checkpoints and W&B files are ignored by .gitignore). A running or killed job is
# left alone: its checkpoint, not its half-written metrics, is what resumes it. Commit afterwards.
set -euo pipefail
sweep=${1:-}
if [ -z "$sweep" ] || [ ! -d "$sweep" ]; then
  echo "error: '${sweep}' is not a sweep folder (usage: scripts/keep_runs.sh SWEEP_DIR)" >&2
  exit 2
fi
kept=0
for run in "$sweep"/*/; do
  status=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("status", ""))' \
    "$run/summary.json" 2>/dev/null || true)
  case $status in completed|diverged|failed) ;; *) continue ;; esac
  [ -f "$run/adam_stats.jsonl" ] && gzip -9 -n -f "$run/adam_stats.jsonl"
  git -C "$run" add -- .
  [ -f "$sweep/multirun.yaml" ] && git -C "$sweep" add -- multirun.yaml
  echo "kept $run ($status, $(du -sh "$run" | cut -f1))"
  kept=$((kept + 1))
done
echo "$kept finished runs of $sweep staged; commit them"
