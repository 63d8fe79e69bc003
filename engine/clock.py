"""Holding a thread until a moment on ``time.perf_counter``, to the microsecond (torch-free).

``time.sleep`` overshoots by a fraction of a millisecond (the kernel's timer slack, 50 us by
default on Linux, plus the wake-up), so ``wait_until`` naps until ``SPIN_S`` before the deadline
and spins the rest. A longer spin would hold the GIL and a core that the process's other threads
(channel port, transports) need. ``precise_timers`` cuts a thread's slack to 1 us (the router's
and each engine loop's thread call it); ``freeze_heap`` keeps the garbage collector's full passes
off the objects of start-up (torch's and Ray's: a pass over them stops every thread of the
process for as long as it scans them).
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from collections.abc import Callable

SPIN_S = 0.00025  # spun, not slept, before a deadline (s)
TIMER_SLACK_NS = 1000  # what ``precise_timers`` sets (the kernel's default: 50 us)
_PR_SET_TIMERSLACK = 29  # prctl(2) option, linux/prctl.h
_heap_frozen = False  # freeze_heap ran in this process


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the collector's reach (``gc.freeze``,
    as vLLM's engine core does after start-up): later full passes scan only what came after.
    Call once a process has loaded what it keeps (its model, the router's workers). Only the
    first call in a process freezes: a frozen object is never collected as part of a cycle,
    so a process that starts many workers or deployments (a test suite) keeps only what was
    alive at the first (its imports, mostly: what a full pass spends its time on)."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.collect()
        gc.freeze()


def precise_timers() -> bool:
    """Let this thread's timed waits (sleep, select, poll timeouts) end within
    ``TIMER_SLACK_NS`` of their time instead of the kernel's 50 us timer slack (prctl(2)
    ``PR_SET_TIMERSLACK``; threads it starts inherit it). True where set; False where the
    platform has no such knob (the waits are then as precise as they are)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def wait_until(deadline: float, idle: Callable[[float], None] | None = None) -> None:
    """Return once ``time.perf_counter() >= deadline``: ``idle(left - SPIN_S)`` (default
    ``time.sleep``; it may return early) while more than ``SPIN_S`` is left, then spin."""
    nap = idle or time.sleep
    while (left := deadline - time.perf_counter()) > SPIN_S:
        nap(left - SPIN_S)
    while time.perf_counter() < deadline:
        pass
