"""Which worker gets a request: pure functions over load snapshots (no I/O, no state). ``loads``:
worker -> tokens (a prefill worker's prompt tokens not yet prefilled, a decode or colocated
worker's ``prompt + max_tokens`` in whole KV blocks), charged at assignment so a burst spreads.
Round robin takes one ``counter`` per pool. ``cache_aware`` is SGLang's gateway policy
(``sgl-router`` ``CacheAwarePolicy``, ``--balance-abs-threshold 32``, ``--balance-rel-threshold
1.0001``): the longest cached prefix match (``matches``, whole blocks) unless requests per worker
are imbalanced past both thresholds (then the least loaded); ties and no match go to the least
loaded, where SGLang takes the smallest tree below its ``cache_threshold``."""

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
    """The worker with the least load (ties: the first). Raises ValueError with no workers."""
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
    """The longest prefix match, unless ``imbalanced(counts)``: then ``least_loaded``. Ties, and
    no match: the least loaded of the best. Raises ValueError with no workers."""
    if not workers:
        raise ValueError("no live worker to route to")
    if imbalanced([counts.get(w, 0) for w in workers], abs_threshold, rel_threshold):
        return least_loaded(workers, loads)
    best = max(matches.get(w, 0) for w in workers)
    return least_loaded([w for w in workers if matches.get(w, 0) == best], loads)


def pick(policy: str, workers: list[str], loads: dict[str, int], counter: int,
         matches: dict[str, int] | None = None, counts: dict[str, int] | None = None) -> str:
    """Apply ``policy`` (``POLICIES``). Raises ValueError for an unknown policy."""
    if policy == "round_robin":
        return round_robin(workers, counter)
    if policy == "least_loaded":
        return least_loaded(workers, loads)
    if policy == "cache_aware":
        return cache_aware(workers, loads, matches or {}, counts or {})
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
