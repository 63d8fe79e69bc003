"""Which worker gets a request: pure functions over load snapshots (no I/O, no state).

``loads`` maps worker name -> load in tokens: for prefill workers the prompt tokens of the requests
assigned there and not yet prefilled, for decode (and colocated) workers the KV tokens (prompt +
max_tokens, rounded up to whole KV blocks: the blocks the worker reserves) of the requests assigned
there and not yet ended. The router counts a request against each of its workers from the moment it
assigns it (so a burst spreads out) and releases each charge once. Round robin takes one ``counter``
per pool.

``cache_aware`` is SGLang's gateway policy (``sgl-router`` ``CacheAwarePolicy``; its options
``--balance-abs-threshold 32``, ``--balance-rel-threshold 1.0001``): when the pool is balanced, the
worker with the longest cached prefix match of the prompt (``matches``: whole KV blocks,
``router.prefix_index``); when the number of requests per worker (``counts``) is imbalanced past
**both** thresholds, ``max - min > abs_threshold`` and ``max > min * rel_threshold``, the
least-loaded worker. Departures: ties (and no match at all) go to the least-loaded of the tied
workers, where SGLang takes the worker with the smallest tree below its ``cache_threshold``; loads
are pdlab's tokens."""

from __future__ import annotations

POLICIES = ("round_robin", "least_loaded", "cache_aware")

BALANCE_ABS_THRESHOLD = 32  # requests (SGLang's default)
BALANCE_REL_THRESHOLD = 1.0001  # SGLang's default


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


def imbalanced(counts: list[int], abs_threshold: float = BALANCE_ABS_THRESHOLD,
               rel_threshold: float = BALANCE_REL_THRESHOLD) -> bool:
    """SGLang's test: ``max - min > abs_threshold`` and ``max > min * rel_threshold``
    (requests per worker)."""
    if not counts:
        return False
    hi, lo = max(counts), min(counts)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


def cache_aware(workers: list[str], loads: dict[str, int], matches: dict[str, int],
                counts: dict[str, int], abs_threshold: float = BALANCE_ABS_THRESHOLD,
                rel_threshold: float = BALANCE_REL_THRESHOLD) -> str:
    """The longest prefix match (``matches``: cached blocks per worker), unless the pool is
    ``imbalanced`` by ``counts`` (requests per worker): then ``least_loaded``. Ties, and a prompt
    cached nowhere: the least loaded of the best. Raises ValueError with no workers."""
    if not workers:
        raise ValueError("no live worker to route to")
    if imbalanced([counts.get(w, 0) for w in workers], abs_threshold, rel_threshold):
        return least_loaded(workers, loads)
    best = max(matches.get(w, 0) for w in workers)
    return least_loaded([w for w in workers if matches.get(w, 0) == best], loads)


def pick(policy: str, workers: list[str], loads: dict[str, int], counter: int,
         matches: dict[str, int] | None = None, counts: dict[str, int] | None = None) -> str:
    """Apply ``policy`` (one of POLICIES; ``matches`` and ``counts`` feed ``cache_aware``,
    empty by default). Raises ValueError for an unknown policy."""
    if policy == "round_robin":
        return round_robin(workers, counter)
    if policy == "least_loaded":
        return least_loaded(workers, loads)
    if policy == "cache_aware":
        return cache_aware(workers, loads, matches or {}, counts or {})
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
