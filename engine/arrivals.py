"""When each request of a workload arrives: seeded arrival processes (vLLM's benchmark_serving
semantics), shared by the real replay and the planner's simulation so one seed gives one timing."""

from __future__ import annotations

import math

import numpy as np


PROCESSES = ("poisson", "gamma", "burst")


def arrival_times(num_requests: int, rate: float, seed: int, process: str = "poisson",
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival offsets in seconds, ``[num_requests]``, cumulative from the first inter-arrival gap
    (vLLM benchmark_serving.py semantics).

    ``rate`` is requests/s. Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean
    1/rate; ``"poisson"`` is burstiness 1 (exponential gaps), ``"gamma"`` uses ``burstiness`` (< 1
    burstier, > 1 steadier). ``"burst"`` or ``rate=inf``: all at 0.

    Raises:
        ValueError: unknown process, rate not > 0, burstiness not > 0 (or != 1 with
            ``"poisson"``), num_requests < 0."""
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


class Chains:
    """Closed-loop arrivals of chained requests (multi-turn conversations), for the real replay
    (``experiments.workloads.ConversationReplay``) and the planner's simulator alike.

    Chain ``c``'s link 0 arrives at ``starts_s[c]`` (``[num_chains]``, s); link ``k > 0`` arrives
    ``think_s[c][k]`` (``[num_chains][num_links]``, s) after link ``k - 1`` ended (its last token,
    or its error). A failed link ends its chain: its later links never arrive (``num_dropped``).

    Raises:
        ValueError: the two disagree in length, a chain has no link, or a time is negative
            or not finite."""

    def __init__(self, starts_s, think_s) -> None:
        if len(starts_s) != len(think_s):
            raise ValueError(f"{len(starts_s)} start times for {len(think_s)} chains")
        for c, (start, thinks) in enumerate(zip(starts_s, think_s)):
            if not thinks:
                raise ValueError(f"chain {c} has no link")
            if not all(math.isfinite(t) and t >= 0 for t in (start, *thinks)):
                raise ValueError(f"chain {c}: times must be finite and >= 0, got "
                                 f"{start!r}, {list(thinks)!r}")
        self.starts_s = [float(t) for t in starts_s]
        self.think_s = [[float(t) for t in thinks] for thinks in think_s]
        self._next = [0] * len(self.starts_s)  # the link of each chain that may arrive next
        self._open = set(range(len(self.starts_s)))
        self.num_dropped = 0  # links never released because an earlier one failed

    def first(self) -> list[tuple[int, float]]:
        """``(chain, arrival s)`` of every chain's link 0, in arrival order (ties: chain order)."""
        return sorted(((c, t) for c, t in enumerate(self.starts_s)), key=lambda ct: ct[1])

    def ended(self, chain: int, link: int, end_s: float, ok: bool) -> float | None:
        """Link ``link`` of ``chain`` ended at ``end_s`` (``ok``: it completed); returns when link
        ``link + 1`` arrives, or None (the chain is over: that was its last link, or it failed).

        Raises:
            ValueError: ``(chain, link)`` is not the open link of an open chain."""
        if chain not in self._open or self._next[chain] != link:
            raise ValueError(f"link {link} of chain {chain} is not the one in flight")
        num_links = len(self.think_s[chain])
        if not ok or link + 1 == num_links:
            self._open.discard(chain)
            self.num_dropped += 0 if ok else num_links - link - 1
            return None
        self._next[chain] = link + 1
        return float(end_s) + self.think_s[chain][link + 1]

    @property
    def done(self) -> bool:
        """Every chain ended."""
        return not self._open
