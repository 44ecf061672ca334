#!/usr/bin/env bash
# gradscale as a user installs it: the wheel built from this clone, in a fresh virtual environment of its own
# (.wheelenv/: this machine's Python, the CPU torch wheel on this disk, the base install's dependencies from the
# package index, no extra), for tests/test_install.py, which uses it from a folder outside the clone.
#   scripts/wheel_env.sh       the environment is built once (about a minute; again when pyproject.toml changes),
#                              the wheel rebuilt and reinstalled on every call (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${GRADSCALE_WHEEL_VENV:-.wheelenv}
py=${PYTHON:-.venv/bin/python}
dist="$venv/dist"
stamp="$venv/.installed-$(sha256sum pyproject.toml | cut -c1-12)"
rm -rf "$dist"
mkdir -p "$dist"
"$py" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dist" . 2>&1 | { grep -v "^WARNING: Location" || true; }
rm -rf build  # setuptools' staging folder in the clone
wheel=$(ls "$dist"/gradscale-*.whl)
if [ ! -f "$stamp" ]; then
  echo "wheel env: building $venv (the CPU torch wheel, then $(basename "$wheel") and its dependencies; about a minute, once)"
  find "$venv" -mindepth 1 -maxdepth 1 ! -name dist -exec rm -rf {} +
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 "$wheel" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
  touch "$stamp"
else
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
fi
"$venv/bin/gradscale-run" --help >/dev/null  # the console commands are there and start
echo "wheel env: $venv has $(basename "$wheel")"
