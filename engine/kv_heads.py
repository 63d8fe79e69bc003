"""Which KV heads each tensor-parallel rank holds, and which prefill rank sends which of them
to which decode rank when a TP-``p`` prefill instance hands KV to a TP-``d`` decode instance
(torch-free).

Ownership (vLLM's ``QKVParallelLinear``), ``H`` KV heads at TP ``t``: for ``t <= H`` (``t``
divides ``H``) rank ``r`` holds heads ``[r * H / t, (r + 1) * H / t)``; for ``t > H`` (``H``
divides ``t``) the one head ``r // (t / H)``, replicated on ``t / H`` consecutive ranks.

Transfer (``transfer_map``): decode rank ``j`` gets each head it holds exactly once, from one
prefill rank holding it, replica ``j % (p / H)`` where prefill replicates; consecutive heads
from one prefill rank form one ``HeadSlice`` (one message). A decode rank receives
``kv_bytes * local_heads / H`` (``bytes_per_decode_rank``): ``kv_bytes / d`` while ``d <= H``,
``kv_bytes / H`` beyond.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_kv_split(tp: int, num_kv_heads: int) -> None:
    """``tp`` must divide ``num_kv_heads`` or be a multiple of it; ValueError naming both."""
    _check(tp >= 1 and num_kv_heads >= 1 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0),
           f"TP {tp} must divide or be a multiple of the {num_kv_heads} KV heads")


def kv_heads_of(rank: int, tp: int, num_kv_heads: int) -> range:
    """The global KV heads rank ``rank`` of a TP-``tp`` instance holds, in order (its local
    head ``i`` is ``kv_heads_of(...)[i]``); ValueError when ``tp`` does not suit
    ``num_kv_heads`` or ``rank`` is not in ``[0, tp)``."""
    check_kv_split(tp, num_kv_heads)
    _check(0 <= rank < tp, f"rank {rank} is not one of a TP {tp} instance's ranks 0..{tp - 1}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def query_heads_of(rank: int, tp: int, num_heads: int) -> range:
    """Rank ``rank``'s global query heads ``[rank * H_q / tp, (rank + 1) * H_q / tp)``;
    ValueError when ``tp`` does not divide ``num_heads`` or ``rank`` is out of range."""
    _check(tp >= 1 and num_heads % tp == 0, f"TP {tp} must divide the {num_heads} attention heads")
    _check(0 <= rank < tp, f"rank {rank} is not one of a TP {tp} instance's ranks 0..{tp - 1}")
    per = num_heads // tp
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class HeadSlice:
    """One message of a TP-to-TP KV transfer: global KV heads ``heads`` (consecutive) go from
    prefill rank ``prefill_rank``, where they are its local heads ``src``, to decode rank
    ``decode_rank``, where they are its local heads ``dst`` (slices over the ``H_kv`` axis of
    ``[L, 2, H_kv, T, D]``)."""

    prefill_rank: int
    decode_rank: int
    heads: range
    src: slice
    dst: slice


def transfer_map(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadSlice, ...]:
    """Every ``HeadSlice`` from a TP-``prefill_tp`` to a TP-``decode_tp`` instance, by decode
    rank, then head; ValueError for a TP that does not suit ``num_kv_heads``."""
    check_kv_split(prefill_tp, num_kv_heads)
    check_kv_split(decode_tp, num_kv_heads)
    replicas = max(1, prefill_tp // num_kv_heads)
    out: list[HeadSlice] = []
    for j in range(decode_tp):
        wanted = kv_heads_of(j, decode_tp, num_kv_heads)
        # the prefill rank that sends each head: its owner, or replica j % replicas of it
        sources = [_owner(h, prefill_tp, num_kv_heads) + j % replicas for h in wanted]
        start = 0
        for k in range(1, len(wanted) + 1):
            if k == len(wanted) or sources[k] != sources[start]:
                rank = sources[start]
                held = kv_heads_of(rank, prefill_tp, num_kv_heads)
                heads = wanted[start:k]
                out.append(HeadSlice(rank, j, heads,
                                     slice(heads[0] - held[0], heads[-1] - held[0] + 1),
                                     slice(start, k)))
                start = k
    return tuple(out)


def _owner(head: int, tp: int, num_kv_heads: int) -> int:
    """The first rank of a TP-``tp`` instance that holds global KV head ``head``."""
    if tp <= num_kv_heads:
        return head // (num_kv_heads // tp)
    return head * (tp // num_kv_heads)


def sends_of(prefill_rank: int, slices: tuple[HeadSlice, ...]) -> tuple[HeadSlice, ...]:
    """The slices prefill rank ``prefill_rank`` sends (the sender's view of ``transfer_map``);
    a replica that no decode rank reads from sends nothing."""
    return tuple(s for s in slices if s.prefill_rank == prefill_rank)


def bytes_per_decode_rank(spec, num_tokens: int, decode_tp: int,
                          num_layers: int | None = None) -> int:
    """Bytes each decode rank of a TP-``decode_tp`` instance receives for ``num_tokens``
    tokens over ``num_layers`` (default all): ``spec.kv_bytes(num_tokens, num_layers) *
    local_heads / H_kv``; ValueError when ``decode_tp`` does not suit the KV heads."""
    heads = len(kv_heads_of(0, decode_tp, spec.num_kv_heads))
    return spec.kv_bytes(num_tokens, num_layers) * heads // spec.num_kv_heads
