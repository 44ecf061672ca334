# make sweep: the default sweep (8 fine-tunes: the fix on and off) on this machine.   make test: ruff + the pytest suite
# but the framework audits, which make test-frameworks runs (CI runs both).
# make test-fast: ruff + the tests not marked slow, distributed or gpu (the edit loop).
# Both create .venv if missing and install the project into it (editable, with the dev extra).
# make test also prepares the GPU check's carry (.whl/) and its rehearsal environment (.rehearsal/), which
# tests/test_device_check.py runs the check in (scripts/device_rehearsal.sh; docs/scaling-out.md), and the wheel's
# environment (.wheelenv/), which tests/test_install.py uses from outside the clone (scripts/wheel_env.sh).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SWEEP_ARGS ?=

.PHONY: sweep test test-frameworks test-fast install carry rehearsal peers wheelenv clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

carry: .whl/.complete

.whl/.complete: scripts/device_carry.py scripts/device_carry.txt scripts/device_image.txt | $(VENV)/.installed
	$(PY) scripts/device_carry.py --dir .whl
	touch $@

# The audit's peer frameworks (pyproject's `peers` extra, its pins) in a folder of their own, put on the path only by
# the adapters that need them (gradscale/audit/adapters.py says why). An older release audited beside the current one
# (TRL 1.9.0, before PR 6024) goes into a folder of its own, .peers-NAME-VERSION/, whose name adapters.py holds.
PINNED_PEERS := $(sort $(shell grep -o '\.peers-[a-z_]*-[0-9][0-9.]*[0-9]' gradscale/audit/adapters.py))
peers: .peers/.complete $(PINNED_PEERS:%=%/.complete)

.peers/.complete: pyproject.toml | $(VENV)/.installed
	rm -rf .peers
	$(PY) -m pip install --quiet --no-deps --target .peers $$($(PY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["peers"]))')
	touch $@

.peers-%/.complete: | $(VENV)/.installed
	rm -rf .peers-$*
	$(PY) -m pip install --quiet --no-deps --target .peers-$* $$(echo $* | sed 's/-\([0-9]\)/==\1/')
	touch $@

rehearsal: .rehearsal/.complete

.rehearsal/.complete: scripts/device_image.txt scripts/device_rehearsal.sh
	scripts/device_rehearsal.sh --install-only
	touch $@

# gradscale as a user installs it: the wheel of this clone in a fresh environment of its own (.wheelenv/), which
# tests/test_install.py uses from outside the clone. Built once, the wheel reinstalled on every call.
wheelenv: | $(VENV)/.installed
	PYTHON=$(PY) scripts/wheel_env.sh

ifndef SWEEP_DIR
SWEEP_DIR := multirun/$(shell date +%Y-%m-%d/%H-%M-%S)
endif

# Two jobs side by side, cores/2 threads each: measured faster than one after another (docs/performance.md).
sweep: install
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m experiments.run -m optimizer=sgd,adamw scale=1,8 \
		hydra/launcher=local_parallel hydra.sweep.dir=$(SWEEP_DIR) $(SWEEP_ARGS)
	$(PY) -m gradscale.analysis.report $(SWEEP_DIR)

test: install carry rehearsal peers wheelenv
	$(VENV)/bin/ruff check .
	WANDB_MODE=disabled GRADSCALE_REQUIRE_REHEARSAL=1 GRADSCALE_REQUIRE_WHEELENV=1 $(PY) -m pytest -n 2 --dist loadfile -m "not frameworks"

# The audits of the peer frameworks' own steps (HF Trainer, Accelerate, Lightning, TRL, torchtune): the heaviest, apart so that
# make test stays within its time; CI runs both.
test-frameworks: install peers
	WANDB_MODE=disabled $(PY) -m pytest -m frameworks

test-fast: install
	$(VENV)/bin/ruff check .
	WANDB_MODE=disabled $(PY) -m pytest -m "not slow and not distributed and not gpu and not frameworks"

clean:
	rm -rf $(VENV) .whl .rehearsal .peers .peers-* .wheelenv device_check outputs multirun .pytest_cache .ruff_cache
