"""Which worker gets a request: pure functions over load snapshots (no I/O, no state).

``loads`` maps worker name -> load in tokens: for prefill workers the prompt tokens of the
requests assigned there and not yet prefilled, for decode (and colocated) workers the KV
tokens (prompt + max_tokens, rounded up to whole KV blocks: the blocks the worker reserves)
of the requests assigned there and not yet ended. The router
counts a request against each of its workers from the moment it assigns it (so a burst
spreads out) and releases each charge once. Round robin takes one ``counter`` per pool.
"""

from __future__ import annotations

POLICIES = ("round_robin", "least_loaded")


def round_robin(workers: list[str], counter: int) -> str:
    """The ``counter``-th worker, cycling. Raises ValueError with no workers."""
    if not workers:
        raise ValueError("no live worker to route to")
    return workers[counter % len(workers)]


def least_loaded(workers: list[str], loads: dict[str, int]) -> str:
    """The worker with the least load (ties: the first in ``workers``). Raises ValueError
    with no workers."""
    if not workers:
        raise ValueError("no live worker to route to")
    return min(workers, key=lambda w: loads.get(w, 0))


def pick(policy: str, workers: list[str], loads: dict[str, int], counter: int) -> str:
    """Apply ``policy`` (one of POLICIES). Raises ValueError for an unknown policy."""
    if policy == "round_robin":
        return round_robin(workers, counter)
    if policy == "least_loaded":
        return least_loaded(workers, loads)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
