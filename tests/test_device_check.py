"""scripts/device_check.sh and what it needs to work at the first try on the device: where there is no CUDA it
says so and writes nothing; the carry (scripts/device_carry.py) checks its wheels' requirements against the
image; the check's path leaves W&B, GGUF and datasets unimported (so they need not travel); and the
rehearsal (scripts/device_rehearsal.sh) runs the whole check in an environment like the image's, and fails
before any part when a wheel of the carry is missing."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import OFFLINE_ENV, TINY, load_script

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".whl"
REHEARSAL_PYTHON = ROOT / ".rehearsal" / "bin" / "python"


device_carry = load_script("device_carry")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_device_check_skips_without_cuda(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([str(ROOT / "scripts" / "device_check.sh"), str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA"
    assert not out.exists()


def test_device_check_rejects_an_unknown_option(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts" / "device_check.sh"), "--rehears", str(tmp_path / "out")],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    assert proc.returncode == 2 and "'--rehears'" in proc.stderr and "--rehearse" in proc.stderr
    assert not (tmp_path / "out").exists()


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                         f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return wheel


def test_carry_requirements_are_met_by_the_carry_or_the_image(tmp_path):
    from packaging.requirements import Requirement

    image = [Requirement("packaging"), Requirement("pyyaml")]
    wheels = [fake_wheel(tmp_path, "hydra_core", "1.3.8", ["omegaconf<2.4,>=2.2", "packaging",
                                                          'importlib-resources; python_version < "3.9"']),
              fake_wheel(tmp_path, "omegaconf", "2.3.1", ["PyYAML>=5.1", "antlr4-python3-runtime==4.9.*"])]
    problems = device_carry.unmet_requirements(wheels, image)
    # the marker excludes importlib-resources on the device's Python 3.12; antlr4 is neither carried nor there
    assert len(problems) == 1 and "antlr4-python3-runtime" in problems[0], problems
    wheels.append(fake_wheel(tmp_path, "antlr4_python3_runtime", "4.13.2", []))
    problems = device_carry.unmet_requirements(wheels, image)
    assert len(problems) == 1 and "the carry has antlr4-python3-runtime 4.13.2" in problems[0], problems
    wheels[-1] = fake_wheel(tmp_path, "antlr4_python3_runtime", "4.9.3", [])
    assert device_carry.unmet_requirements(wheels, image) == []


def test_the_carry_pins_what_the_tests_run():
    """The device gets the versions this suite is tested with (to the minor version: a patch release on the
    registry after the carry was pinned does not make the carry wrong)."""
    from packaging.version import Version

    for requirement in device_carry.read_list(device_carry.CARRY_LIST):
        carried = Version(device_carry.pinned(requirement))
        tested = Version(importlib.metadata.version(requirement.name))
        assert carried.release[:2] == tested.release[:2], (requirement, tested)


def test_the_checks_path_leaves_wandb_gguf_and_datasets_unimported(tmp_path, cache_dir):
    """They are not carried to the device: a run with W&B disabled, its report and the benchmark's imports
    must not import them (python -X importtime lists every module a process imports)."""
    env = {**os.environ, **OFFLINE_ENV, "GRADSCALE_CACHE": str(cache_dir)}
    commands = [["-m", "gradscale.run", *TINY, "wandb.mode=offline", f"hydra.run.dir={tmp_path / 'run'}"],
                ["-m", "gradscale.analysis.report", str(tmp_path / "run"), "--out", str(tmp_path / "report")],
                ["-c", "import runpy; runpy.run_path('scripts/bench.py', run_name='bench')"]]
    for command in commands:
        proc = subprocess.run([sys.executable, "-X", "importtime", *command], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert not imported & {"wandb", "gguf", "datasets"}, command


def require_rehearsal():
    if CARRY.is_dir() and REHEARSAL_PYTHON.exists():
        return
    message = "the carry (.whl) or the rehearsal environment (.rehearsal) is missing: make carry rehearsal"
    if os.environ.get("GRADSCALE_REQUIRE_REHEARSAL") == "1":
        pytest.fail(message)
    pytest.skip(message)


def rehearse(out: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "device_rehearsal.sh"), str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **OFFLINE_ENV, **env})


@pytest.mark.slow
def test_the_rehearsal_runs_every_part_of_the_check(tmp_path):
    require_rehearsal()
    device_out = tmp_path / "device_out"
    device_out.mkdir()
    proc = rehearse(tmp_path / "check", {"OUT": str(device_out), "GRADSCALE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "import hydra: 1.3.8 " in proc.stdout and "gradscale-carry" in proc.stdout  # hydra came from the carry
    summary = (tmp_path / "check" / "summary.txt").read_text()
    for part in ("default_sweep_fp32", "report_fp32", "default_sweep_bf16", "report_bf16", "gpu_tests",
                 "llama3_2_1b", "bench"):
        assert f"{part}: ok in" in summary, summary
    assert "llama3_2_1b adamw: step-0 grad norm fix off / on = 0.125000" in summary, summary
    for optimizer in ("sgd", "adamw"):  # the user's command sweeps the fix: its c_eff = 1 pair is one run twice
        assert f"default_sweep_fp32 {optimizer}: step-0 grad norm fix off / on = 0.125000" in summary, summary
        assert re.search(f"default_sweep_fp32 {optimizer}: fix off at scale 8 against fix on at scale 1 .*identical$",
                         summary, re.M), summary
    # what comes back from the device: the summary and one archive, with no weights in it
    assert sorted(p.name for p in device_out.iterdir()) == ["device_check.tar.gz", "summary.txt"]
    with tarfile.open(device_out / "device_check.tar.gz") as archive:
        names = archive.getnames()
    assert "check/summary.txt" in names and "check/bench.log" in names
    assert any(n.endswith("report.md") for n in names) and not any(n.endswith(".safetensors") for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("wheel", sorted(p.name.split("-")[0] for p in CARRY.glob("*.whl")) or ["(no carry)"])
def test_the_rehearsal_fails_before_any_part_without_a_carried_wheel(tmp_path, wheel):
    require_rehearsal()
    partial = tmp_path / "carry"
    partial.mkdir()
    for path in CARRY.glob("*.whl"):
        if not path.name.startswith(f"{wheel}-"):
            (partial / path.name).write_bytes(path.read_bytes())
    proc = rehearse(tmp_path / "check", {"GRADSCALE_CARRY": str(partial)})
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "FAILED" in proc.stdout and "no part was started" in proc.stderr
    assert not (tmp_path / "check").exists()
