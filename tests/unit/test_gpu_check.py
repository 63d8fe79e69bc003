"""``make gpu-check`` run by a Python without torch: one line naming what is missing and how
to choose another interpreter, a non-zero exit, no traceback. ``python -S`` skips
site-packages, so this test's own interpreter plays a system ``python3`` without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _without_site_packages(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_check_py_names_the_missing_modules_in_one_line():
    result = _without_site_packages([sys.executable, "-S", "tests/gpu/check.py"])
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gpu-check: {sys.executable} has no torch, transformers, "
                               "msgpack, numpy ")
    assert "make gpu-check GPU_PYTHON=" in lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_with_such_a_python_fails_with_that_line_and_no_traceback():
    result = _without_site_packages(["make", "--no-print-directory", "gpu-check",
                                     f"GPU_PYTHON={sys.executable} -S"])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("gpu-check:")]
    assert len(ours) == 1 and " has no torch" in ours[0] and "GPU_PYTHON=" in ours[0], ours
