"""gradscale in a user's environment: one namespaced package from a wheel, used from outside the clone with its
console commands; the audit's and the advisor's imports stay light, and the Hydra plugin imports nothing of
gradscale until a sweep selects it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OFFLINE_ENV, ROOT

WHEEL_ENV = ROOT / ".wheelenv"  # scripts/wheel_env.sh (make wheelenv, part of make test)
CONSOLE_COMMANDS = ("gradscale-run", "gradscale-audit", "gradscale-advise", "gradscale-report")


def imported(code: str, python: str = sys.executable, cwd: Path = ROOT) -> set[str]:
    """Every module `code` imports, from python -X importtime (the device check's import test reads it so too)."""
    proc = subprocess.run([python, "-X", "importtime", "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **OFFLINE_ENV}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("code", ["import gradscale.audit, gradscale.audit.__main__",
                                  "import gradscale.advise, gradscale.analysis.advise"])
def test_the_audit_and_the_advisor_import_no_wandb_and_no_matplotlib(code):
    modules = imported(code)
    assert "gradscale.audit" in modules or "gradscale.analysis.advise" in modules  # the reading is real
    heavy = sorted(m for m in modules if m.split(".")[0] in ("wandb", "matplotlib"))
    assert heavy == []


def test_the_hydra_plugin_imports_nothing_of_gradscale_until_selected():
    """Hydra imports every module under hydra_plugins/ when any Hydra app starts (its plugin scan)."""
    code = ("from hydra.core.plugins import Plugins; Plugins.instance(); import sys; "
            "assert 'hydra_plugins.gradscale_sweeper.sweeper' in sys.modules; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gradscale'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def wheel_env() -> Path:
    if not (WHEEL_ENV / "bin" / "gradscale-run").exists():
        if os.environ.get("GRADSCALE_REQUIRE_WHEELENV"):  # make test builds it: never skip there
            pytest.fail(f"{WHEEL_ENV} is missing: scripts/wheel_env.sh builds it")
        pytest.skip(f"{WHEEL_ENV} is missing: scripts/wheel_env.sh builds it (make test does)")
    return WHEEL_ENV


def run_outside(wheel_env: Path, command: str, *args: str, cwd: Path, timeout: float = 300,
                env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(wheel_env / "bin" / command), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**clean, **OFFLINE_ENV, **(env or {})})


@pytest.mark.slow
@pytest.mark.distributed
def test_the_wheel_works_from_outside_the_clone(wheel_env, tmp_path):
    """From a folder outside the clone, with the wheel's environment only (base install, no extra, no network):
    the console commands, the audit of a user's step, the advisor's gradient-only mode; no generic top-level
    names."""
    outside = tmp_path / "user_project"
    outside.mkdir()
    assert ROOT not in outside.parents
    shutil.copy(ROOT / "examples" / "audit_step.py", outside / "my_training.py")

    for command in CONSOLE_COMMANDS:
        proc = run_outside(wheel_env, command, "--help", cwd=outside)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (command, proc.stderr[-2000:])

    python = str(wheel_env / "bin" / "python")
    where = subprocess.run([python, "-c", "import importlib.util as u, gradscale; print(gradscale.__file__); "
                            "print([n for n in ('experiments', 'analysis') if u.find_spec(n)])"], cwd=outside,
                           capture_output=True, text=True, timeout=60)
    package_file, generic = where.stdout.splitlines()
    assert Path(package_file).is_relative_to(wheel_env) and generic == "[]", where.stdout + where.stderr
    top_level = next((wheel_env / "lib").glob("python*/site-packages/gradscale-*.dist-info/top_level.txt"))
    assert set(top_level.read_text().split()) == {"gradscale", "hydra_plugins"}

    fixed = run_outside(wheel_env, "gradscale-audit", "my_training:fixed_step", "--world-sizes", "1,2", cwd=outside)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert "every configuration gives the global token-mean gradient" in fixed.stdout

    advice = run_outside(wheel_env, "gradscale-advise", "model.init=random", "batch_size=8", "seq_len=64",
                         f"hydra.run.dir={outside / 'advice'}", "--gradient-only", "--world-sizes", "8,64",
                         cwd=outside, env={"GRADSCALE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    assert advice.returncode == 0, advice.stderr[-3000:]
    assert [line.split()[0] for line in advice.stdout.splitlines() if line.startswith("N=")] == ["N=8", "N=64"]
    assert "figure: none (matplotlib is not installed: pip install 'gradscale[report]')" in advice.stdout
