"""A request's KV between tensor-parallel instances, rank to rank where the transport allows,
and the checks every received message passes, whichever process gets it.

Rank to rank (a TP > 1 instance whose transport has a ``Transport.rank_factory``: shared
memory): each prefill rank puts its ``engine.kv_heads.sends_of`` slices from its own KV store
(``put_on_ranks``); each decode rank gets its own slices into its own store (``get_on_ranks``).
Rank 0 only gathers handles, outcomes and records (``InstanceKVStore.each_rank``); the other
ranks build their transport once from ``rank_factory``. Else, the rank-0 path: rank 0 gathers
every head and puts every slice; decode rank 0 gets them all and scatters the heads. A rank's
failure fails the request (``TransferFailed`` naming each failing rank and its cause) and
frees every handle put; every rank still takes part in the same collectives.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch

from engine.kv_heads import HeadSlice, kv_heads_of, sends_of, transfer_map
from kv_transfer.payload import KVHeader, RankPart
from kv_transfer.transport import KVHandle, TransferFailed, TransferRecord, Transport

_RANK_TRANSPORTS: dict[bytes, Transport] = {}  # a rank process's transports, by factory


def rank_factory(transport: Transport, tp: int) -> Callable[[], Transport] | None:
    """How a TP-``tp`` instance's other ranks build ``transport``'s equal; None: rank-0 path."""
    return transport.rank_factory() if tp > 1 else None


def _transport_of(factory: Callable[[], Transport], here: Transport | None) -> Transport:
    if here is not None:
        return here
    key = pickle.dumps(factory)
    if key not in _RANK_TRANSPORTS:
        _RANK_TRANSPORTS[key] = factory()
    return _RANK_TRANSPORTS[key]


def _free(transport: Transport, handles) -> None:
    for handle in handles:
        try:
            transport.free(handle)
        except Exception:  # best effort: a dead owner's bytes are gone already
            pass


def _raise_failed(outcomes: list[tuple[bool, object]], ranks: str, what: str) -> None:
    failed = [f"{ranks} {rank}: {err}" for rank, (ok, err) in enumerate(outcomes) if not ok]
    if failed:
        raise TransferFailed(f"{what}: " + "; ".join(failed))


def _held_here(store, rank: int, factory, transport: Transport | None = None) -> int:
    return _transport_of(factory, transport).num_held()


def num_held(kv_store, transport: Transport, factory) -> int:
    """``Transport.num_held`` summed over the instance's ranks (rank 0's alone when
    ``factory`` is None); TransferFailed where a rank cannot count."""
    if factory is None:
        return transport.num_held()
    outcomes = kv_store.each_rank(_held_here, factory, transport=transport)
    _raise_failed(outcomes, "rank", "transfers held")
    return sum(held for _, held in outcomes)


# ---- prefill side ------------------------------------------------------------------------

def put_own_slices(store, rank: int, factory, request_id: str, spec, block_ids: list[int],
                   num_tokens: int, layers: slice, token_start: int, layer_start: int,
                   slices: tuple[HeadSlice, ...], tps: tuple[int, int], dst_rank: int | None,
                   transport: Transport | None = None) -> list[KVHandle]:
    """On prefill rank ``rank``: put its slices of a request's KV (blocks ``block_ids``,
    ``num_tokens`` tokens, ``layers``), ``spec`` the instance's; a failure frees, then raises."""
    transport = _transport_of(factory, transport)
    mine = sends_of(rank, slices)
    if not mine:
        return []
    kv = store.read(block_ids, num_tokens, layers, may_view=transport.copies_on_put)
    handles: list[KVHandle] = []
    try:
        for s in mine:
            heads = kv[:, :, s.src]
            handles.append(transport.portable(transport.put(
                request_id, spec, heads if transport.copies_on_put else heads.contiguous(),
                token_start=token_start, layer_start=layer_start, dst_rank=dst_rank,
                part=RankPart(s.heads.start, s.prefill_rank, s.decode_rank, *tps))))
    except Exception:
        _free(transport, handles)
        raise
    return handles


def put_on_ranks(kv_store, transport: Transport, factory, request_id: str, spec,
                 block_ids: list[int], num_tokens: int, layers: slice, token_start: int,
                 layer_start: int, slices: tuple[HeadSlice, ...], tps: tuple[int, int],
                 dst_rank: int | None) -> list[KVHandle]:
    """Prefill rank 0: every rank puts its slices (``put_own_slices``); the handles in
    ``slices``' order. TransferFailed (module docstring) when a rank's put failed."""
    outcomes = kv_store.each_rank(put_own_slices, factory, request_id, spec, list(block_ids),
                                  num_tokens, layers, token_start, layer_start, slices, tps,
                                  dst_rank, transport=transport)
    if not all(ok for ok, _ in outcomes):
        _free(transport, [h for ok, put in outcomes if ok for h in put])
        _raise_failed(outcomes, "prefill rank", f"KV of request {request_id}")
    per_rank = [iter(put) for _, put in outcomes]
    return [next(per_rank[s.prefill_rank]) for s in slices]


# ---- decode side: the checks of what arrives ---------------------------------------------

def check_tokens(header: KVHeader, request_id: str, token_start: int,
                 num_prompt_tokens: int) -> None:
    """The message is ``request_id``'s, tokens ``[token_start, T)``; else ValueError."""
    if header.request_id != request_id:
        raise ValueError(f"KV header mismatch for request {request_id}: request_id expected "
                         f"{request_id!r}, got {header.request_id!r}")
    got = (header.token_start, header.token_end)
    if got != (token_start, num_prompt_tokens):
        raise ValueError(
            f"KV header mismatch for request {request_id}: tokens expected "
            f"{num_prompt_tokens - token_start} [{token_start}, {num_prompt_tokens}), got "
            f"{got[1] - got[0]} [{got[0]}, {got[1]})")


def check_slices(request_id: str, messages: list[tuple[KVHeader, int]], num_kv_heads: int,
                 decode_tp: int, who: str, decode_rank: int | None = None) -> None:
    """One layer range's ``(header, heads)`` are exactly ``transfer_map``'s slices into
    TP-``decode_tp`` ``who`` (``decode_rank``'s alone if given); else ValueError."""
    header = messages[0][0]
    if any(h.decode_tp != decode_tp for h, _ in messages):
        raise ValueError(f"KV for request {request_id} was split for a TP {header.decode_tp} "
                         f"decode instance; {who} runs at TP {decode_tp}")
    want = {(s.prefill_rank, s.decode_rank, s.heads.start, len(s.heads))
            for s in transfer_map(num_kv_heads, header.prefill_tp, decode_tp)
            if decode_rank is None or s.decode_rank == decode_rank}
    got = {(h.prefill_rank, h.decode_rank, h.head_start, heads) for h, heads in messages}
    if got != want or len(messages) != len(want):
        raise ValueError(f"KV for request {request_id} layers from {header.layer_start}: "
                         f"(prefill rank, decode rank, first head, heads) expected "
                         f"{sorted(want)}, got {sorted(got)}")


def check_layers(request_id: str, ranges: list[tuple[int, int]], num_layers: int) -> None:
    """Sorted ``(start, count)`` ranges tile ``[0, num_layers)`` evenly; else ValueError."""
    starts = [start for start, _ in ranges]
    expected = list(range(0, num_layers, ranges[0][1])) if ranges else []
    if not ranges or sum(n for _, n in ranges) != num_layers or starts != expected:
        raise ValueError(f"KV for request {request_id} covers layers starting at {starts}, "
                         f"expected all {num_layers} layers")


# ---- decode side: each rank gets its own ---------------------------------------------------

def get_own_slices(store, rank: int, factory, request_id: str, spec,
                   handles_by_rank: list[list[KVHandle]], block_ids: list[int], skip: int,
                   token_start: int, num_prompt_tokens: int, decode_tp: int, who: str,
                   timeout_s: float, transport: Transport | None = None
                   ) -> list[TransferRecord]:
    """On decode rank ``rank``: get and check ``handles_by_rank[rank]``, write the KV past its
    first ``skip`` tokens into blocks ``block_ids``, free them; its records (rank 0: [])."""
    transport = _transport_of(factory, transport)
    if rank:
        transport.take_records()  # a failed call's records: never reported
    handles = handles_by_rank[rank]
    try:  # the views die with _get_and_write's frame, before the frees
        _get_and_write(store, rank, transport, request_id, spec, handles, block_ids, skip,
                       token_start, num_prompt_tokens, decode_tp, who, timeout_s)
    finally:
        _free(transport, handles)
    return transport.take_records() if rank else []


def _get_and_write(store, rank: int, transport: Transport, request_id: str, spec,
                   handles: list[KVHandle], block_ids: list[int], skip: int, token_start: int,
                   num_prompt_tokens: int, decode_tp: int, who: str, timeout_s: float) -> None:
    if not handles:
        raise ValueError(f"no KV message of request {request_id} is for decode rank {rank}")
    by_layer: dict[int, list[tuple[KVHeader, torch.Tensor]]] = {}
    for handle in handles:
        header, kv = transport.get(handle, spec, timeout_s)
        check_tokens(header, request_id, token_start, num_prompt_tokens)
        by_layer.setdefault(header.layer_start, []).append((header, kv))
    for got in by_layer.values():
        check_slices(request_id, [(h, kv.shape[2]) for h, kv in got], spec.num_kv_heads,
                     decode_tp, who, rank)
    check_layers(request_id, sorted((start, got[0][1].shape[0])
                                    for start, got in by_layer.items()), spec.num_layers)
    first_head = kv_heads_of(rank, decode_tp, spec.num_kv_heads).start
    for start, got in by_layer.items():
        local = got[0][1]
        if len(got) > 1:  # several prefill ranks' heads: one tensor of this rank's, in order
            heads = sum(part.shape[2] for _, part in got)
            local = local.new_empty(local.shape[:2] + (heads,) + local.shape[3:])
            for h, part in got:
                at = h.head_start - first_head
                local[:, :, at:at + part.shape[2]] = part
        if block_ids:
            store.write(block_ids, local[:, :, :, skip:], start)


def get_on_ranks(kv_store, transport: Transport, factory, request_id: str, spec,
                 handles: tuple[KVHandle, ...], block_ids: list[int], skip: int,
                 token_start: int, num_prompt_tokens: int, decode_tp: int, who: str,
                 timeout_s: float) -> None:
    """Decode rank 0: every rank gets and writes its messages (``get_own_slices``), their
    records join ``transport``'s. TransferFailed (module docstring) when a rank failed."""
    by_rank = [[h for h in handles if h.decode_rank == rank] for rank in range(decode_tp)]
    outcomes = kv_store.each_rank(get_own_slices, factory, request_id, spec, by_rank,
                                  list(block_ids), skip, token_start, num_prompt_tokens,
                                  decode_tp, who, timeout_s, transport=transport)
    transport.add_records([r for ok, records in outcomes[1:] if ok for r in records])
    _raise_failed(outcomes, "decode rank", f"KV of request {request_id}")
