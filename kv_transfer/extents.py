"""First-fit placement of transfers in a producer's arena (shared by ``shm`` and ``nixl``).

An arena is ``capacity`` bytes; each transfer held in it is one extent ``[start, end)``. A new
transfer goes to the lowest offset where ``need`` bytes fit between the extents held (first fit,
lowest address: in steady state the same, already mapped pages are reused)."""

from __future__ import annotations

from collections.abc import Iterable


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to`` (> 0)."""
    return (n + to - 1) // to * to


def first_fit(held: Iterable[tuple[int, int]], need: int, capacity: int) -> int | None:
    """Lowest offset of a gap of ``need`` bytes among the ``held`` extents ``(start, end)``
    inside ``[0, capacity)``, or None when no gap is large enough."""
    offset = 0
    for start, end in sorted(held):
        if start - offset >= need:
            break
        offset = max(offset, end)
    return offset if offset + need <= capacity else None
