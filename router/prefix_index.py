"""What prefix each worker probably caches, as the router sees it: per worker, the chained block
hashes (``engine.kv_blocks.block_hashes``) of the prompts it was sent; owned by ``Assigner``. It
is SGLang's approximate tree (``sgl-router`` ``cache_aware``: insert what is routed, never ask the
worker): an evicted block stays credited until the index forgets it, LRU past
``capacity_blocks`` per worker. A dead worker's entries are dropped, ``reset`` drops all. A hash
names its whole prefix, so a prompt's match is its leading hashes present, in blocks."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY_BLOCKS = 1 << 16  # per worker: ~1M tokens of 16-token blocks, ~2 MiB of hashes


class PrefixIndex:
    """Per-worker LRU sets of block hashes; ``capacity_blocks`` kept per worker.

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
