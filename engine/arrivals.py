"""When each request of a workload arrives: seeded arrival processes (vLLM's
``benchmarks/benchmark_serving.py`` semantics), the one definition a real replay
(``experiments.workloads.with_arrivals``) and the planner's simulation (``planner.search``)
both draw from, so the same seed gives the same arrival times in both. No torch.
"""

from __future__ import annotations

import math

import numpy as np


PROCESSES = ("poisson", "gamma", "burst")


def arrival_times(num_requests: int, rate: float, seed: int, process: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival offsets in seconds, ``[num_requests]``, cumulative from the first
    inter-arrival gap (vLLM benchmark_serving.py semantics).

    ``rate`` is requests/s. Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)):
    mean 1/rate; ``"poisson"`` is burstiness 1 (exponential gaps), ``"gamma"`` uses
    ``burstiness`` (< 1 burstier, > 1 steadier). ``"burst"`` or ``rate=inf``: all at 0.

    Raises:
        ValueError: unknown process, rate not > 0, burstiness not > 0 (or != 1 with
            ``"poisson"``), num_requests < 0.
    """
    check_count(num_requests)
    if process not in PROCESSES:
        raise ValueError(f"process must be one of {PROCESSES}, got {process!r}")
    if not rate > 0:  # also rejects NaN
        raise ValueError(f"rate must be > 0 requests/s (inf = all at once), got {rate!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if process == "poisson" and burstiness != 1.0:
        raise ValueError(f"burstiness applies to process='gamma' only (poisson is 1.0), got {burstiness!r}")
    if process == "burst" or math.isinf(rate):
        return np.zeros(num_requests)
    shape = 1.0 if process == "poisson" else float(burstiness)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=num_requests)
    return np.cumsum(gaps)


def check_count(num_requests: int) -> None:
    """Raise ValueError unless ``num_requests`` is an integer >= 0."""
    if not isinstance(num_requests, (int, np.integer)) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
