#!/usr/bin/env bash
# The GPU check's rehearsal on this CPU machine, so that a missing wheel shows up here and not on the device.
#   scripts/device_rehearsal.sh [--install-only] [--only PART[,PART]] [OUT_DIR]   (as scripts/device_check.sh's)
# An environment like the device image's: this machine's Python with its CPU torch, the image's versions of
# the packages the check imports (scripts/device_image.txt) and nothing else: no hydra, omegaconf, greenlet,
# wandb, gguf or datasets. Built once into .rehearsal/ (about 45 s; rebuilt when device_image.txt
# changes). Then scripts/device_check.sh --rehearse runs there with the carry (.whl/ from
# scripts/device_carry.py, or $GRADSCALE_CARRY): every import check and part, on the CPU, shrunk to seconds.
# The carry's pure-Python wheels are installed as they are; a wheel built for the device's Python 3.12
# (greenlet) cannot load on this Python 3.11, so the same version for this Python stands in for it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GRADSCALE_REHEARSAL_VENV:-.rehearsal}
carry=${GRADSCALE_CARRY:-.whl}
install_only=0
if [ "${1:-}" = "--install-only" ]; then install_only=1; shift; fi

stamp="$venv/.installed-$(sha256sum scripts/device_image.txt | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "rehearsal: building $venv (this machine's Python, CPU torch, the image's package versions; about 45 s, once)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  # each line's requirement, or what its "# rehearsal:" comment puts in its place
  mapfile -t requirements < <(awk '!/^[[:space:]]*#/ && NF { requirement = $1
    if (match($0, /# rehearsal: [^[:space:]]+/)) requirement = substr($0, RSTART + 13, RLENGTH - 13)
    print requirement }' scripts/device_image.txt)
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
  modules="torch, transformers, accelerate, huggingface_hub, tokenizers, safetensors, numpy, pandas, matplotlib, peft"
  if [ "${PIPESTATUS[0]}" != 0 ] || ! "$venv/bin/python" -c "import $modules, yaml, packaging, pytest, jinja2, tqdm"
  then
    echo "error: building $venv failed (pip install ${requirements[*]})" >&2
    exit 1
  fi
  touch "$stamp"
fi
[ $install_only = 1 ] && exit 0

if ! ls "$carry"/*.whl >/dev/null 2>&1; then
  echo "error: no carry in $carry: make it first with python scripts/device_carry.py" >&2
  exit 2
fi
host_carry=$(mktemp -d "${TMPDIR:-/tmp}/gradscale-rehearsal-carry.XXXXXX")
trap 'rm -rf "$host_carry"' EXIT
mkdir -p "$venv/host-wheels"
for wheel in "$carry"/*.whl; do
  case $(basename "$wheel") in
    *-none-any.whl) cp "$wheel" "$host_carry/" ;;
    *) name_version=$(basename "$wheel" | cut -d- -f1,2)
       if ! ls "$venv/host-wheels/$name_version"-*.whl >/dev/null 2>&1 && ! "$venv/bin/python" -m pip download \
           --quiet --no-deps --only-binary=:all: --dest "$venv/host-wheels" "${name_version%-*}==${name_version##*-}"
       then
         echo "error: no wheel of ${name_version%-*}==${name_version##*-} for this Python to stand in for $wheel" >&2
         exit 1
       fi
       cp "$venv/host-wheels/$name_version"-*.whl "$host_carry/" ;;
  esac
done
if [ -z "${GRADSCALE_CACHE:-}" ]; then  # a cache of its own, removed afterwards
  cache=$(mktemp -d "${TMPDIR:-/tmp}/gradscale-rehearsal-cache.XXXXXX")
  trap 'rm -rf "$host_carry" "$cache"' EXIT
else
  cache=$GRADSCALE_CACHE
fi
echo "rehearsal: scripts/device_check.sh --rehearse $* with $venv/bin/python and the carry of $carry"
GRADSCALE_CARRY=$host_carry PYTHON=$venv/bin/python GRADSCALE_CACHE=$cache scripts/device_check.sh --rehearse "$@"
