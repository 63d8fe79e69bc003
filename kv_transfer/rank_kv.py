"""A request's KV between tensor-parallel instances, moved rank to rank where the transport
allows it, and the checks every received message passes, whichever process gets it.

Rank to rank (``rank_factory``: a TP > 1 instance over a transport whose handles any process
of the node opens, ``Transport.rank_factory``; shared memory): each prefill rank puts the
``engine.kv_heads.transfer_map`` slices it sends (``sends_of``) from its own KV store
(``put_on_ranks``), and each decode rank gets its own slices and writes them into its own
store (``get_on_ranks``). No KV byte crosses the instance's process group: rank 0 only
gathers handles, outcomes and transfer records (``engine.parallel.InstanceKVStore.each_rank``).
Other transports, and TP 1 instances, take the rank-0 path: prefill rank 0 gathers every head
and puts every slice; decode rank 0 gets every slice, joins the heads and scatters them.

A rank process other than rank 0 builds its transport once, from rank 0's ``rank_factory``.
Failure is per request: a rank whose put or get fails fails the request (``TransferFailed``
naming every failing rank and its cause); every handle put is freed; the other ranks still
finish the same collectives.
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
    """How the other ranks of a TP-``tp`` instance build ``transport``'s equal when they move
    their own KV heads; None: the rank-0 path (TP 1, or a transport that needs it)."""
    return transport.rank_factory() if tp > 1 else None


def _transport_of(factory: Callable[[], Transport], here: Transport | None) -> Transport:
    """Rank 0's own transport (``here``), else this process's from ``factory`` (built once)."""
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


def _raise_failed(outcomes: list[tuple[bool, object]], side: str, request_id: str) -> None:
    failed = [f"{side} rank {rank}: {err}" for rank, (ok, err) in enumerate(outcomes) if not ok]
    if failed:
        raise TransferFailed(f"KV of request {request_id}: " + "; ".join(failed))


# ---- prefill side ------------------------------------------------------------------------

def put_own_slices(store, rank: int, factory, request_id: str, spec, block_ids: list[int],
                   num_tokens: int, layers: slice, token_start: int, layer_start: int,
                   slices: tuple[HeadSlice, ...], tps: tuple[int, int], dst_rank: int | None,
                   transport: Transport | None = None) -> list[KVHandle]:
    """On prefill rank ``rank``: put the slices it sends of one request's KV (its ``store``'s
    blocks ``block_ids``, ``num_tokens`` tokens from ``token_start``, ``layers``), in
    ``transfer_map`` order; ``spec`` the instance's (every head). A failed put frees the
    ones before it, then raises."""
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
    """Prefill rank 0 of a TP instance (``kv_store`` an ``InstanceKVStore``): every rank puts
    its slices (``put_own_slices``); the handles, one per slice in ``slices``' order.

    Raises:
        TransferFailed: a rank's put failed (every rank named with its cause); every handle
            put was freed."""
    outcomes = kv_store.each_rank(put_own_slices, factory, request_id, spec, list(block_ids),
                                  num_tokens, layers, token_start, layer_start, slices, tps,
                                  dst_rank, transport=transport)
    if not all(ok for ok, _ in outcomes):
        _free(transport, [h for ok, put in outcomes if ok for h in put])
        _raise_failed(outcomes, "prefill", request_id)
    per_rank = [iter(put) for _, put in outcomes]
    return [next(per_rank[s.prefill_rank]) for s in slices]


# ---- decode side: the checks of what arrives ---------------------------------------------

def check_tokens(header: KVHeader, request_id: str, token_start: int,
                 num_prompt_tokens: int) -> None:
    """A message is the request's and covers prompt tokens ``[token_start, T)``; ValueError
    naming expected and got."""
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
    """One layer range's messages ``(header, heads carried)`` are exactly ``transfer_map``'s
    slices into a TP-``decode_tp`` instance (``who``), those of ``decode_rank`` only when
    given; ValueError naming expected and got."""
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
    """The layer ranges ``(start, count)``, sorted, tile ``[0, num_layers)`` in equal chunks;
    ValueError naming the starts."""
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
    """On decode rank ``rank``: get its messages ``handles_by_rank[rank]`` (checked as
    ``check_tokens``, ``check_slices``, ``check_layers``), then write each layer range's heads
    past the first ``skip`` tokens into ``store``'s blocks ``block_ids``; frees its handles
    either way. Returns the transfer records it made (rank 0's stay in its transport)."""
    transport = _transport_of(factory, transport)
    if rank:
        transport.take_records()  # a failed call's records: never reported
    handles = handles_by_rank[rank]
    try:  # the gotten views die with _get_and_write's frame, before the frees
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
    """Decode rank 0 of a TP instance (``kv_store`` an ``InstanceKVStore``): every rank gets
    the messages for it (``KVHandle.decode_rank``) and writes them (``get_own_slices``); the
    other ranks' transfer records join ``transport``'s.

    Raises:
        TransferFailed: a rank's get, check or write failed (every rank named with its
            cause)."""
    by_rank = [[h for h in handles if h.decode_rank == rank] for rank in range(decode_tp)]
    outcomes = kv_store.each_rank(get_own_slices, factory, request_id, spec, by_rank,
                                  list(block_ids), skip, token_start, num_prompt_tokens,
                                  decode_tp, who, timeout_s, transport=transport)
    transport.add_records([r for ok, records in outcomes[1:] if ok for r in records])
    _raise_failed(outcomes, "decode", request_id)
