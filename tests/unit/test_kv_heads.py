"""The KV-head slicing map between tensor-parallel instances, for every (prefill TP, decode TP)
pair up to 8: each decode rank gets exactly its KV heads, once, from a prefill rank that holds
them, and receives the KV-bytes formula over its share."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.kv_cache import KVSpec
from engine.kv_heads import (HeadSlice, bytes_per_decode_rank, kv_heads_of, query_heads_of,
                             sends_of, transfer_map)

HEAD_COUNTS = (1, 2, 3, 4, 8)  # MQA, the tiny model, SmolLM2, and Llama-3-style GQA


def valid_tps(num_kv_heads: int) -> list[int]:
    return [t for t in range(1, 9) if num_kv_heads % t == 0 or t % num_kv_heads == 0]


PAIRS = [(h, p, d) for h in HEAD_COUNTS for p, d in itertools.product(valid_tps(h), repeat=2)]


def test_every_pair_up_to_8_is_covered():
    assert {(p, d) for h, p, d in PAIRS if h == 8} == set(itertools.product((1, 2, 4, 8), repeat=2))
    assert {(p, d) for h, p, d in PAIRS if h == 1} == set(itertools.product(range(1, 9), repeat=2))
    assert {(p, d) for h, p, d in PAIRS if h == 3} == set(itertools.product((1, 3, 6), repeat=2))


def test_ownership_by_hand():
    assert [kv_heads_of(r, 2, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [kv_heads_of(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1),
                                                       range(1, 2), range(1, 2)]
    assert [kv_heads_of(r, 6, 3)[0] for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [query_heads_of(r, 3, 9) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 9)]
    # a rank's query heads all read a KV head it holds (GQA group = H_q / H_kv)
    for tp, hq, hkv in ((2, 4, 2), (4, 4, 2), (3, 9, 3), (8, 32, 8), (8, 8, 1)):
        for r in range(tp):
            assert {q // (hq // hkv) for q in query_heads_of(r, tp, hq)} <= set(kv_heads_of(r, tp, hkv))
    with pytest.raises(ValueError, match="TP 3 must divide or be a multiple of the 2 KV heads"):
        kv_heads_of(0, 3, 2)
    with pytest.raises(ValueError, match="rank 2 is not one of a TP 2"):
        kv_heads_of(2, 2, 4)


def test_maps_by_hand():
    # prefill TP 2 -> decode TP 1, 2 KV heads: one slice from each prefill rank
    assert transfer_map(2, 2, 1) == (HeadSlice(0, 0, range(0, 1), slice(0, 1), slice(0, 1)),
                                     HeadSlice(1, 0, range(1, 2), slice(0, 1), slice(1, 2)))
    # prefill TP 1 -> decode TP 2: each decode rank reads its half from rank 0
    assert transfer_map(2, 1, 2) == (HeadSlice(0, 0, range(0, 1), slice(0, 1), slice(0, 1)),
                                     HeadSlice(0, 1, range(1, 2), slice(1, 2), slice(0, 1)))
    # prefill TP 4 replicates 2 heads: decode TP 4's ranks read from distinct replicas
    assert [(s.prefill_rank, s.decode_rank) for s in transfer_map(2, 4, 4)] == [
        (0, 0), (1, 1), (2, 2), (3, 3)]
    assert [(s.prefill_rank, s.heads) for s in transfer_map(8, 2, 4)] == [
        (0, range(0, 2)), (0, range(2, 4)), (1, range(4, 6)), (1, range(6, 8))]
    assert sends_of(1, transfer_map(8, 2, 4)) == transfer_map(8, 2, 4)[2:]


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", PAIRS)
def test_each_decode_rank_gets_exactly_its_heads_from_holders(num_kv_heads, prefill_tp, decode_tp):
    """Shard a real KV tensor as the prefill ranks hold it, move it by the map, and compare
    each decode rank's assembled KV with its own slice of the whole."""
    layers, tokens, head_dim = 2, 5, 3
    whole = torch.randn(layers, 2, num_kv_heads, tokens, head_dim, generator=torch.Generator().manual_seed(0))
    held = [whole[:, :, list(kv_heads_of(r, prefill_tp, num_kv_heads))] for r in range(prefill_tp)]
    slices = transfer_map(num_kv_heads, prefill_tp, decode_tp)
    for j in range(decode_tp):
        mine = kv_heads_of(j, decode_tp, num_kv_heads)
        got = torch.full((layers, 2, len(mine), tokens, head_dim), float("nan"))
        arrived = []
        for s in (s for s in slices if s.decode_rank == j):
            assert set(s.heads) <= set(kv_heads_of(s.prefill_rank, prefill_tp, num_kv_heads))
            got[:, :, s.dst] = held[s.prefill_rank][:, :, s.src]
            arrived += list(s.heads)
        assert arrived == list(mine)  # each of its heads once, in order, nothing else
        assert torch.equal(got, whole[:, :, list(mine)])
    # one message per run of heads from one sender: at most max(1, H/d) and at least 1
    for j in range(decode_tp):
        n = sum(s.decode_rank == j for s in slices)
        assert 1 <= n <= max(1, num_kv_heads // decode_tp)
    # which prefill ranks send: all of them without replication; with it, each head from as
    # many replicas as decode ranks need it (up to its replica count), spreading the load
    senders = {s.prefill_rank for s in slices}
    if prefill_tp <= num_kv_heads:
        assert senders == set(range(prefill_tp))
    else:
        replicas, readers = prefill_tp // num_kv_heads, max(1, decode_tp // num_kv_heads)
        assert len(senders) == num_kv_heads * min(replicas, readers)


@pytest.mark.parametrize("num_kv_heads,prefill_tp,decode_tp", PAIRS)
def test_bytes_per_decode_rank_is_the_formula_over_its_share(num_kv_heads, prefill_tp, decode_tp):
    spec = KVSpec("m@0", num_layers=30, num_kv_heads=num_kv_heads, head_dim=64, dtype="bfloat16")
    tokens = 1000
    whole = spec.kv_bytes(tokens)  # 2 * L * H_kv * D * T * itemsize
    share = bytes_per_decode_rank(spec, tokens, decode_tp)
    assert share == (whole // decode_tp if decode_tp <= num_kv_heads else whole // num_kv_heads)
    # the map's slices carry exactly that many bytes to each decode rank
    per_head = 2 * spec.num_layers * spec.head_dim * tokens * spec.itemsize
    for j in range(decode_tp):
        received = sum(len(s.heads) * per_head for s in transfer_map(num_kv_heads, prefill_tp, decode_tp)
                       if s.decode_rank == j)
        assert received == share
    assert bytes_per_decode_rank(spec, tokens, decode_tp, num_layers=3) * 10 == share
