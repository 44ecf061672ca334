"""scripts/device_check.sh where there is no CUDA: it says so and succeeds, writing nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_device_check_skips_without_cuda(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([str(ROOT / "scripts" / "device_check.sh"), str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "skipped: no CUDA"
    assert not out.exists()
