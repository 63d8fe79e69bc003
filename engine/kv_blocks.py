"""KV block accounting with automatic prefix caching (no torch), as vLLM v1's
(``kv_cache_utils.hash_block_tokens``, ``BlockPool``, ``get_computed_blocks``).

A full block of ``B`` tokens is named by a chained hash, ``h_0 = H(NONE_HASH, tokens[0:B])``,
``h_i = H(h_{i-1}, tokens[iB:(i+1)B])``, ``H`` = SHA-256; a partial block has no hash and is
never shared. No process salt, so a router can compare a prompt's ``block_hashes`` with a
worker's (``pop_events``). At zero references a hashed block stays cached (evictable).
``allocate`` hands out unhashed blocks first (the lowest run of consecutive free blocks, else the
lowest), then evicts cached blocks, least recently freed first: unlike vLLM's single LRU queue, a
cached block goes only when no uncached one is left. Only the first block per hash is registered."""

from __future__ import annotations

import array
import bisect
import collections
import hashlib
import struct
import sys
from dataclasses import dataclass

# Starts ``allocate`` tries for a run of consecutive free blocks before taking scattered ones.
RUN_SEARCH_LIMIT = 64

# The first block's parent hash (vLLM's NONE_HASH from its DEFAULT_NONE_HASH_SEED for sha256).
NONE_HASH = hashlib.sha256(b"pdlab-prefix-cache").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids) -> bytes:
    """SHA-256 (32 bytes) of the parent hash and the block's token ids (int64 little endian);
    ``parent_hash`` None = first block."""
    tokens = tuple(token_ids)
    data = (NONE_HASH if parent_hash is None else parent_hash) + struct.pack(
        f"<{len(tokens)}q", *tokens)
    return hashlib.sha256(data).digest()


def block_hashes(token_ids, block_size: int, hashes: list[bytes] | None = None) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``; ``hashes``, those already computed
    for a prefix, is extended in place and returned."""
    hashes = [] if hashes is None else hashes
    first, last = len(hashes), len(token_ids) // block_size
    if first >= last:
        return hashes
    # one packing for all new blocks (the simulator admits thousands of prompts per run)
    packed = array.array("q", token_ids[first * block_size:last * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    data, step, sha = packed.tobytes(), 8 * block_size, hashlib.sha256
    parent = hashes[-1] if hashes else NONE_HASH
    for offset in range(0, len(data), step):
        parent = sha(parent + data[offset:offset + step]).digest()
        hashes.append(parent)
    return hashes


def prompt_block_hashes(request, block_size: int) -> tuple[bytes, ...]:
    """``block_hashes`` of the prompt, computed once per request and block size and kept on it."""
    by_size = request._prompt_hashes
    if by_size is None:
        by_size = {}
        object.__setattr__(request, "_prompt_hashes", by_size)  # frozen: a cache, not a field
    hashes = by_size.get(block_size)
    if hashes is None:
        hashes = by_size[block_size] = tuple(block_hashes(request.prompt_token_ids, block_size))
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix cache lookups in tokens (vLLM's ``PrefixCacheStats``): ``queries`` looked up at
    admission, ``hits`` found cached; preempted requests' lookups apart. ``transfer_*``: a decode
    worker's lookups of remote prompts (hits are KV it need not receive again)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    transfer_queries: int = 0
    transfer_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """The blocks of one paged KV store: reference counts, the hash table of cached full blocks,
    the free and evictable lists. ``enable_caching`` off: a freed block is simply free.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free = list(range(num_blocks))  # uncached, ascending
        # cached blocks at zero references, least recently freed first (the eviction order)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._cached: dict[bytes, int] = {}  # hash -> block
        # KV events, kept only once someone asked (record_events): unmirrored, never grows
        self.record_events = False
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: free ones plus cached ones at zero references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered by hash (held or evictable)."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def fits_ever(self, num_tokens: int) -> bool:
        """True if ``num_tokens`` fit the whole cache."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    def allocate(self, num_tokens: int) -> list[int]:
        """``blocks_needed(num_tokens)`` new blocks at one reference each, in table order (module
        docstring's allocation order).

        Raises:
            ValueError: fewer free blocks than needed, or ``num_tokens`` < 1."""
        n = self.blocks_needed(num_tokens)
        if n < 1 or n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks for {num_tokens} tokens: "
                             f"{self.num_free_blocks} free")
        free = self._free
        if n == 1 and free:  # on-demand growth, the common case: the lowest free block
            block = free.pop(0)
            self.ref_cnt[block] = 1
            return [block]
        if len(free) >= n:
            # ascending and distinct: a span of n - 1 is a run; cached blocks fragment the list,
            # so only RUN_SEARCH_LIMIT starts are tried (a full scan was the simulator's hot spot)
            start = next((i for i in range(min(len(free) - n + 1, RUN_SEARCH_LIMIT))
                          if free[i + n - 1] - free[i] == n - 1), 0)
            block_ids = free[start:start + n]
            del free[start:start + n]
        else:
            block_ids = free[:]
            free.clear()
            while len(block_ids) < n:
                block, _ = self._evictable.popitem(last=False)
                self._evict(block)
                block_ids.append(block)
        ref = self.ref_cnt
        for block in block_ids:
            ref[block] = 1
        return block_ids

    def _evict(self, block: int) -> None:
        digest = self.block_hash[block]
        self.block_hash[block] = None
        if self._cached.get(digest) == block:
            del self._cached[digest]
            if self.record_events:
                self._removed.append(digest)

    def touch(self, block_ids: list[int]) -> None:
        """One more reference to each block (shared cached blocks); evictable ones stop being so."""
        ref, evictable = self.ref_cnt, self._evictable
        for block in block_ids:
            if ref[block] == 0:
                del evictable[block]  # KeyError: a free uncached block has nothing to share
            ref[block] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (a table, freed tail first); at zero a block becomes
        evictable (cached) or free.

        Raises:
            ValueError: a block has no reference to drop (double free); nothing changes."""
        ref, hashed = self.ref_cnt, self.block_hash
        if min((ref[b] for b in block_ids), default=1) < 1:
            bad = [b for b in block_ids if ref[b] < 1]
            raise ValueError(f"blocks {bad[:4]} are not allocated here")
        uncached = []
        for block in reversed(block_ids):
            ref[block] -= 1
            if ref[block]:
                continue
            if hashed[block] is not None:
                self._evictable[block] = None
            else:
                uncached.append(block)
        if uncached:
            uncached.reverse()
            self._give_back(uncached)

    def _give_back(self, block_ids: list[int]) -> None:
        free, first, last = self._free, block_ids[0], block_ids[-1]
        if last - first == len(block_ids) - 1 and block_ids == list(range(first, last + 1)):
            i = bisect.bisect_left(free, first)
            if i == len(free) or free[i] > last:
                free[i:i] = block_ids
                return
        free.extend(block_ids)
        free.sort()  # timsort: two sorted runs, linear

    def cache(self, block: int, digest: bytes) -> bool:
        """Register a held full ``block`` under ``digest``; False (no change) when caching is off,
        the block has a hash, or another block holds ``digest``."""
        if (not self.enable_caching or self.block_hash[block] is not None
                or digest in self._cached):
            return False
        self.block_hash[block] = digest
        self._cached[digest] = block
        if self.record_events:
            self._stored.append(digest)
        return True

    def cache_table(self, block_ids: list[int], hashes: list[bytes], start: int,
                    end: int) -> list[int]:
        """``cache(block_ids[i], hashes[i])`` for i in ``[start, end)``; returns those registered."""
        if not self.enable_caching:
            return []
        registered, cached, block_hash = [], self._cached, self.block_hash
        record = self._stored if self.record_events else None
        for i in range(start, end):
            block, digest = block_ids[i], hashes[i]
            if block_hash[block] is not None or digest in cached:
                continue
            block_hash[block] = digest
            cached[digest] = block
            registered.append(block)
            if record is not None:
                record.append(digest)
        return registered

    def uncache(self, block: int) -> None:
        """Forget ``block``'s hash (the step computing it failed); an evictable block becomes free."""
        if self.block_hash[block] is None:
            return
        self._evict(block)
        if self.ref_cnt[block] == 0 and block in self._evictable:
            del self._evictable[block]
            self._give_back([block])

    def lookup(self, hashes: list[bytes], max_blocks: int,
               exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes`` (at most ``max_blocks``),
        stopping at the first block in ``exclude``; references unchanged."""
        cached, found = self._cached, []
        for digest in hashes[:max_blocks]:
            block = cached.get(digest)
            if block is None or block in exclude:
                break
            found.append(block)
        return found

    def num_evictable_in(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` are at zero references."""
        ref = self.ref_cnt
        return sum(1 for b in block_ids if ref[b] == 0)

    def reset_cache(self) -> int:
        """Forget every unheld cached block (vLLM's ``reset_prefix_cache``); returns how many."""
        evictable = list(self._evictable)
        for block in evictable:
            self._evict(block)
        self._evictable.clear()
        if evictable:
            self._give_back(sorted(evictable))
        return len(evictable)

    def holds(self, digest: bytes) -> bool:
        """True if a block with this hash is cached here (held or evictable)."""
        return digest in self._cached

    def cached_hashes(self) -> set[bytes]:
        """Every hash cached here now."""
        return set(self._cached)

    def pop_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes registered, hashes evicted) since the last call, in order: vLLM's ``BlockStored``
        / ``BlockRemoved`` KV events. The first call turns recording on."""
        self.record_events = True
        events = (self._stored, self._removed)
        self._stored, self._removed = [], []
        return events
