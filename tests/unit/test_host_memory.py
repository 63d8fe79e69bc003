"""engine/host_memory.py: glibc's malloc thresholds raised once, and what that changes.

Each case runs in a fresh interpreter: the thresholds are process-wide and permanent, and
this test process has set them already if it built a CPU engine.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLIBC = sys.platform == "linux" and "libc.so" in (ctypes.util.find_library("c") or "")

# A 40 MiB block malloc'd, written and freed, 5 times, through the C library itself (torch's
# 64-byte-aligned allocations add glibc's memalign padding, which a same-size hole never
# fits). 40 MiB is over glibc's 32 MiB ceiling of its dynamic mmap threshold, so untuned it is
# mapped afresh each time; tuned it comes from the heap, which keeps it. Minor page faults
# are counted over rounds 2-5.
PATTERN = """
import ctypes, json, resource
from engine import host_memory
state = host_memory.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def block():
    p = libc.malloc(40 << 20)
    ctypes.memset(p, 1, 40 << 20)
    libc.free(p)
block()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    block()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"state": state, "again": host_memory.keep_freed_memory(),
                  "line": host_memory.describe(), "faults": faults}))
"""


def run_pattern(switch: str) -> dict:
    env = {"PDLAB_MALLOC_TUNING": switch, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PATTERN], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's (mallopt)")
def test_raised_thresholds_keep_the_temporaries_mapped():
    tuned = run_pattern("1")
    assert tuned["state"] == {"applied": True, "mmap_threshold": 256 << 20,
                              "trim_threshold": 1 << 30, "why": "glibc mallopt"}
    assert tuned["again"] == tuned["state"]  # once per process
    assert tuned["line"] == "glibc mallopt: mmap threshold 256 MiB, trim threshold 1024 MiB"
    # 4 rounds x 40 MiB mapped afresh = 40,960 pages of 4 KiB without the tuning; with it the
    # heap is reused: a handful of faults at most (the interpreter's own allocations)
    untuned = run_pattern("0")
    assert untuned["state"]["applied"] is False
    assert untuned["line"] == "unchanged ($PDLAB_MALLOC_TUNING=0)"
    assert untuned["faults"] >= 4 * (40 << 20) // 4096
    assert tuned["faults"] < 200


def test_the_backend_records_the_policy():
    """The CPU backend's describe() and summary() carry host_memory's line (run headers)."""
    import torch

    from engine import host_memory, ops

    cpu = ops.select_ops(torch.device("cpu"), torch.float32, torch.float32)
    assert isinstance(cpu, ops.CpuOps)
    assert cpu.describe()["malloc"] == host_memory.describe() != "not set"
    assert cpu.summary().endswith(f"; malloc {host_memory.describe()}")
