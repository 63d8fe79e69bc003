"""Each rank's share of a TP-to-TP transfer over shared memory, in one process (ranks as
arguments, one ``KVStore`` per rank): the slices a prefill rank puts are its heads, a decode
rank's store gets exactly its heads past the cached prefix, and a rank's failure frees what
the others put."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVSpec, KVStore
from engine.kv_heads import kv_heads_of, transfer_map
from kv_transfer.rank_kv import get_own_slices, put_on_ranks, put_own_slices
from kv_transfer.shm import SharedMemoryTransport
from kv_transfer.transport import TransferFailed

SPEC = KVSpec("test-model", num_layers=3, num_kv_heads=4, head_dim=8, dtype="float32")
BLOCK = 4


def _store(tp: int, rank: int) -> KVStore:
    local = KVSpec(SPEC.model_fingerprint, SPEC.num_layers, len(kv_heads_of(rank, tp, 4)),
                   SPEC.head_dim, SPEC.dtype)
    return KVStore(local, num_blocks=8, block_size=BLOCK)


class _Ranks:
    """An ``InstanceKVStore`` stand-in: ``each_rank`` runs on each rank's store here."""

    def __init__(self, stores):
        self.stores = stores

    def each_rank(self, fn, *args, **here):
        out = []
        for rank, store in enumerate(self.stores):
            try:
                out.append((True, fn(store, rank, *args, **here)))
            except Exception as err:
                out.append((False, f"{type(err).__name__}: {err}"))
        return out


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
def test_each_decode_rank_writes_exactly_its_heads_past_the_cached_prefix(prefill_tp, decode_tp):
    torch.manual_seed(0)
    num_tokens, block_ids = 10, [5, 2, 7]  # 3 blocks of 4; the first is cached at decode
    whole = torch.randn(SPEC.kv_shape(num_tokens))
    prefill = [_store(prefill_tp, r) for r in range(prefill_tp)]
    for r, store in enumerate(prefill):
        heads = kv_heads_of(r, prefill_tp, 4)
        store.write(block_ids, whole[:, :, heads.start:heads.stop].contiguous())
    transport = SharedMemoryTransport(capacity_bytes=1 << 20, num_slots=64)
    slices = transfer_map(4, prefill_tp, decode_tp)
    handles = put_on_ranks(_Ranks(prefill), transport, None, "r", SPEC, block_ids, num_tokens,
                           slice(None), 0, 0, slices, (prefill_tp, decode_tp), None)
    assert [(h.decode_rank, h.num_bytes) for h in handles] == [
        (s.decode_rank, SPEC.kv_bytes(num_tokens) * len(s.heads) // 4) for s in slices]
    by_rank = [[h for h in handles if h.decode_rank == j] for j in range(decode_tp)]
    for j in range(decode_tp):
        store = _store(decode_tp, j)
        get_own_slices(store, j, None, "r", SPEC, by_rank, [1, 3], BLOCK, 0, num_tokens,
                       decode_tp, "decode-0", 5.0, transport=transport)
        heads = kv_heads_of(j, decode_tp, 4)
        got = store.read([1, 3], num_tokens - BLOCK)
        assert torch.equal(got, whole[:, :, heads.start:heads.stop, BLOCK:])
    assert transport.num_held() == 0  # every decode rank freed what it got


def test_a_decode_rank_refuses_a_slice_for_another_rank():
    store = _store(1, 0)
    store.write([0, 1], torch.randn(SPEC.kv_shape(6)))
    transport = SharedMemoryTransport(capacity_bytes=1 << 20, num_slots=8)
    slices = transfer_map(4, 1, 2)
    handles = put_own_slices(store, 0, None, "r", SPEC, [0, 1], 6, slice(None), 0, 0, slices,
                             (1, 2), None, transport=transport)
    with pytest.raises(ValueError, match=r"expected \[\(0, 1, 2, 2\)\], got \[\(0, 0, 0, 2\)\]"):
        get_own_slices(_store(2, 1), 1, None, "r", SPEC, [[], [handles[0]]], [0, 1], 0, 0, 6,
                       2, "decode-0", 5.0, transport=transport)
    assert transport.num_held() == 1  # the refused handle was freed; the other is still held


def test_a_failing_rank_frees_every_slice_the_others_put():
    store = _store(2, 0)
    store.write([0], torch.randn(SPEC.kv_shape(4))[:, :, :2].contiguous())
    transport = SharedMemoryTransport(capacity_bytes=1 << 20, num_slots=8)

    class _Rank1Fails(_Ranks):
        def each_rank(self, fn, *args, **here):
            return [(True, fn(store, 0, *args, **here)), (False, "TransferFailed: arena full")]

    with pytest.raises(TransferFailed, match="KV of request r: prefill rank 1: TransferFailed: "
                                             "arena full$"):
        put_on_ranks(_Rank1Fails([]), transport, None, "r", SPEC, [0], 4, slice(None), 0, 0,
                     transfer_map(4, 2, 2), (2, 2), None)
    assert transport.num_held() == 0


@pytest.mark.parametrize("rank_to_rank,prefill_tp,decode_tp,heads", [
    (True, 2, 2, 2), (True, 2, 1, 2), (True, 4, 2, 1), (False, 2, 2, 4), (False, 1, 2, 4)])
def test_a_put_asks_rank_0_for_the_bytes_one_rank_sends(rank_to_rank, prefill_tp, decode_tp,
                                                        heads):
    """Rank to rank, each rank's buffer holds its own share (the largest rank's, 2 of 4 heads
    at TP 2); through rank 0 it holds every slice (4 heads)."""
    from types import SimpleNamespace

    from prefill_worker.worker import PrefillWorker
    worker = SimpleNamespace(_kv_start={"r": 4}, _slices=transfer_map(4, prefill_tp, decode_tp),
                             _rank_factory=object() if rank_to_rank else None,
                             _tps=(prefill_tp, decode_tp), engine=SimpleNamespace(kv_spec=SPEC))
    state = SimpleNamespace(request_id="r", num_prompt_tokens=12)
    assert PrefillWorker._put_bytes(worker, state) == SPEC.kv_bytes(8) * heads // 4
