"""The block allocator with prefix caching (engine.kv_blocks), pure Python: the hash chain,
reference counts, eviction order, KV events."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.kv_blocks import NONE_HASH, BlockAllocator, block_hashes, hash_block_tokens


def test_hash_chain_is_sha256_of_the_parent_hash_and_the_block_tokens():
    tokens = list(range(100, 140))  # 2 full blocks of 16 + 8 tokens
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2  # the partial block has no hash
    h0 = hashlib.sha256(NONE_HASH + struct.pack("<16q", *tokens[:16])).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<16q", *tokens[16:32])).digest()
    assert hashes == [h0, h1] and NONE_HASH == hashlib.sha256(b"pdlab-prefix-cache").digest()
    assert hash_block_tokens(None, tokens[:16]) == h0 and hash_block_tokens(h0, tokens[16:32]) == h1


def test_equal_prefixes_share_hashes_and_a_change_changes_every_later_block():
    a = list(range(48))
    b = a[:16] + [999] + a[17:]  # differs in block 1 only
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # block 2's tokens are equal
    c = a[:32] + [7] * 16  # same first two blocks
    assert block_hashes(c, 16)[:2] == ha[:2]


def test_block_hashes_extend_incrementally():
    tokens = list(range(70))
    hashes = block_hashes(tokens[:20], 16)
    assert len(hashes) == 1
    same = block_hashes(tokens, 16, hashes)
    assert same is hashes and hashes == block_hashes(tokens, 16) and len(hashes) == 4


def _cached(alloc: BlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate a table for ``tokens`` and register its full blocks."""
    table = alloc.allocate(len(tokens))
    for block, digest in zip(table, block_hashes(tokens, alloc.block_size)):
        assert alloc.cache(block, digest)
    return table


def test_freed_full_blocks_stay_cached_and_are_shared_by_reference():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = _cached(alloc, list(range(10)))  # blocks 0, 1 full (cached), 2 partial
    assert a == [0, 1, 2] and alloc.num_cached_blocks == 2
    alloc.free(a)
    assert alloc.num_free_blocks == 8 and alloc.num_used_blocks == 0
    assert alloc.ref_cnt == [0] * 8 and alloc.num_cached_blocks == 2  # cached, no reference
    hit = alloc.lookup(block_hashes(list(range(9)) + [55], 4), max_blocks=2)
    assert hit == [0, 1] and alloc.num_evictable_in(hit) == 2
    alloc.touch(hit)
    assert alloc.ref_cnt[:2] == [1, 1] and alloc.num_free_blocks == 6
    alloc.touch(hit[:1])  # a second request shares block 0
    assert alloc.ref_cnt[:2] == [2, 1]
    alloc.free(hit)
    alloc.free(hit[:1])
    assert alloc.ref_cnt == [0] * 8 and alloc.num_free_blocks == 8
    with pytest.raises(ValueError, match=r"blocks \[0\] are not allocated here"):
        alloc.free([0])
    # lookup stops at the first miss, at max_blocks, and at an excluded block
    hashes = block_hashes(list(range(12)), 4)
    assert alloc.lookup(hashes, 3) == [0, 1] and alloc.lookup(hashes, 1) == [0]
    assert alloc.lookup(hashes, 3, exclude={1}) == [0]


def test_uncached_blocks_go_first_then_cached_ones_least_recently_freed_tail_first():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    a = _cached(alloc, [1, 2, 3, 4])  # blocks 0, 1
    b = _cached(alloc, [5, 6, 7, 8])  # blocks 2, 3
    alloc.free(a)  # a's blocks freed first: tail first, so 1 then 0 in eviction order
    alloc.free(b)  # then 3, 2
    assert alloc.allocate(4) == [4, 5]  # the uncached ones before any cached block
    assert alloc.num_cached_blocks == 4
    assert alloc.allocate(2) == [1]  # the least recently freed cached block: a's tail
    assert alloc.allocate(6) == [0, 3, 2]
    assert alloc.num_cached_blocks == 0 and alloc.num_free_blocks == 0
    assert alloc.lookup(block_hashes([1, 2, 3, 4], 2), 2) == []  # evicted: no longer found


def test_touch_moves_a_block_out_of_the_eviction_order():
    alloc = BlockAllocator(num_blocks=3, block_size=2)
    a = _cached(alloc, [1, 2, 3, 4, 5, 6])  # all three blocks, cached
    alloc.free(a)  # eviction order: 2, 1, 0
    alloc.touch([0])  # block 0 shared again, then freed again: now the most recent
    alloc.free([0])
    assert alloc.allocate(2) == [2] and alloc.allocate(2) == [1] and alloc.allocate(2) == [0]


def test_one_block_per_hash_and_uncache():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    digest = block_hashes([1, 2], 2)[0]
    a, b = alloc.allocate(2), alloc.allocate(2)
    assert alloc.cache(a[0], digest) and not alloc.cache(b[0], digest)  # first one wins
    assert not alloc.cache(a[0], block_hashes([3, 4], 2)[0])  # a block keeps its hash
    alloc.free(b)  # unregistered: plainly free
    alloc.free(a)
    assert alloc.num_cached_blocks == 1 and alloc.holds(digest)
    alloc.uncache(a[0])  # its KV is not what the hash says: forgotten, plainly free
    assert alloc.num_cached_blocks == 0 and not alloc.holds(digest)
    assert alloc.num_free_blocks == 4 and alloc._free == [0, 1, 2, 3]


def test_caching_off_registers_nothing():
    alloc = BlockAllocator(num_blocks=2, block_size=2, enable_caching=False)
    table = alloc.allocate(4)
    assert not alloc.cache(table[0], block_hashes([1, 2], 2)[0])
    alloc.free(table)
    assert alloc.num_cached_blocks == 0 and alloc._free == [0, 1]


def test_kv_events_are_recorded_once_asked_for():
    alloc = BlockAllocator(num_blocks=2, block_size=2)
    _cached(alloc, [1, 2])
    assert alloc.pop_events() == ([], [])  # nobody listened before: nothing was kept
    alloc.free([0])
    h1, h2 = block_hashes([1, 2, 3, 4], 2)
    table = alloc.allocate(2)  # the uncached block 1 first
    assert alloc.cache(table[0], h2)
    alloc.free(table)
    alloc.allocate(4)  # evicts both: block 0 (freed first), then 1
    assert alloc.pop_events() == ([h2], [block_hashes([1, 2], 2)[0], h2])
    assert alloc.pop_events() == ([], []) and alloc.cached_hashes() == set()


def test_cache_table_registers_a_range_as_cache_does_one_by_one():
    alloc = BlockAllocator(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, 2)
    a, b = alloc.allocate(6), alloc.allocate(6)
    assert alloc.cache_table(a, hashes, 0, 2) == a[:2]  # block 2 of a: not in the range
    assert alloc.cache_table(b, hashes, 0, 3) == [b[2]]  # the first two hashes are a's
    assert [alloc.block_hash[x] for x in a + b] == hashes[:2] + [None, None, None, hashes[2]]
