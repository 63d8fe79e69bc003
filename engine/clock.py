"""Holding a thread until a moment on ``time.perf_counter``, to the microsecond (torch-free).

``time.sleep`` overshoots by a fraction of a millisecond (the kernel's timer slack, 50 us by
default on Linux, plus the wake-up), so ``wait_until`` naps until ``SPIN_S`` before the deadline
and spins the rest. A longer spin would hold the GIL and a core that the process's other threads
(channel port, transports) need.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SPIN_S = 0.00025  # spun, not slept, before a deadline (s)


def wait_until(deadline: float, idle: Callable[[float], None] | None = None) -> None:
    """Return once ``time.perf_counter() >= deadline``: ``idle(left - SPIN_S)`` (default
    ``time.sleep``; it may return early) while more than ``SPIN_S`` is left, then spin."""
    nap = idle or time.sleep
    while (left := deadline - time.perf_counter()) > SPIN_S:
        nap(left - SPIN_S)
    while time.perf_counter() < deadline:
        pass
