"""What prefix each worker probably caches, as the router sees it: per worker, the chained block
hashes (``engine.kv_blocks.block_hashes``, the engine's own scheme, 16-token blocks by default) of
the prompts it was sent. Owned by ``router.assignment.Assigner``, so the online router and the
planner's simulator match prompts against the same index.

It is SGLang's approximate tree (``sgl-router`` ``cache_aware``: the router inserts what it routes
and never asks the worker): a worker that evicted a block is still credited with it until the index
forgets it, least recently used first, past ``capacity_blocks`` per worker. A dead worker's entries
are dropped (its replacement starts cold), and ``reset`` drops all (between runs). Because a hash
names its whole prefix (it is chained through its parent's), the match of a prompt is its leading
hashes present, counted in blocks. No I/O, no clock, no torch."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY_BLOCKS = 1 << 16  # per worker: ~1M tokens of 16-token blocks, ~2 MiB of hashes


class PrefixIndex:
    """Per-worker LRU sets of block hashes (module docstring).

    Args:
        workers: the worker names.
        capacity_blocks: hashes kept per worker (>= 1); the least recently inserted or
            matched go first.

    Raises:
        ValueError: ``capacity_blocks`` < 1."""

    def __init__(self, workers: Iterable[str], capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
                 ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, collections.OrderedDict[bytes, None]] = {
            name: collections.OrderedDict() for name in workers}

    def match(self, worker: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` that ``worker`` is credited with (0 .. len)."""
        blocks = self._blocks[worker]
        n = 0
        for digest in hashes:
            if digest not in blocks:
                break
            n += 1
        return n

    def insert(self, worker: str, hashes: Sequence[bytes]) -> None:
        """Credit ``worker`` with ``hashes`` (a prompt sent there), most recent last."""
        blocks = self._blocks[worker]
        for digest in hashes:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def forget(self, worker: str) -> None:
        """Drop everything credited to ``worker`` (it died: its cache went with it)."""
        self._blocks[worker].clear()

    def reset(self) -> None:
        """Drop every entry (the workers' caches were reset)."""
        for blocks in self._blocks.values():
            blocks.clear()

    def num_blocks(self, worker: str) -> int:
        return len(self._blocks[worker])
