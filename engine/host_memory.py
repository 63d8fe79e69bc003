"""Keep a CPU forward's freed activations mapped: glibc malloc's thresholds, set once per process.

glibc serves a block above its (dynamic) mmap threshold with a fresh ``mmap`` and returns a freed
heap top above its trim threshold to the kernel, so each prefill step would fault in and zero its
megabytes of activations again (``benchmarks.host_memory`` measures it). ``keep_freed_memory()``
raises both thresholds (``MMAP_THRESHOLD``, or glibc's 64-bit maximum of 32 MiB where refused;
``TRIM_THRESHOLD``) and ends their dynamic adjustment (mallopt(3)), as vLLM's recommended
tcmalloc would. Not glibc, or ``PDLAB_MALLOC_TUNING=0``: nothing changes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

ENV_SWITCH = "PDLAB_MALLOC_TUNING"  # "0": leave glibc's malloc as it is (A/B runs)
# mallopt(3) parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# bytes: a step's largest temporary up to 8B-parameter models at 2,048-token steps (Llama-3-8B's
# gate/up output is 235 MB) stays on the heap; KV caches above it are mapped on their own.
MMAP_THRESHOLD = 256 << 20
MMAP_THRESHOLD_FALLBACK = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept mapped instead of returned

_lock = threading.Lock()
_state: dict | None = None  # what keep_freed_memory() did, once per process


def keep_freed_memory() -> dict:
    """Raise glibc's mmap and trim thresholds once for this process (idempotent; thread-safe).

    Returns:
        ``{"applied": bool, "mmap_threshold": bytes or None, "trim_threshold": bytes or
        None, "why": str}``: a threshold is None where it was left at glibc's default;
        ``applied`` False where both were: switched off (``PDLAB_MALLOC_TUNING=0``) or the C
        library has no ``mallopt`` (not glibc), ``why`` says which. Never raises."""
    global _state
    with _lock:
        if _state is None:
            _state = _apply()
        return dict(_state)


def _apply() -> dict:
    off = {"applied": False, "mmap_threshold": None, "trim_threshold": None}
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return {**off, "why": f"${ENV_SWITCH}=0"}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {**off, "why": "no mallopt in the C library (not glibc)"}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = next((v for v in (MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK)
                 if mallopt(_M_MMAP_THRESHOLD, v) == 1), None)
    trim = TRIM_THRESHOLD if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 else None
    return {"applied": mmap is not None or trim is not None, "mmap_threshold": mmap,
            "trim_threshold": trim, "why": "glibc mallopt"}


def describe() -> str:
    """One line for run headers: what ``keep_freed_memory()`` set (``"not set"`` before it
    ran), e.g. ``"glibc mallopt: mmap threshold 256 MiB, trim threshold 1024 MiB"``."""
    if _state is None:
        return "not set"
    if not _state["applied"]:
        return f"unchanged ({_state['why']})"
    mib = lambda v: "default" if v is None else f"{v >> 20} MiB"  # noqa: E731
    return (f"{_state['why']}: mmap threshold {mib(_state['mmap_threshold'])}, "
            f"trim threshold {mib(_state['trim_threshold'])}")
