"""Which KV heads each tensor-parallel rank holds, and which prefill rank sends which of them
to which decode rank when a prefill instance at TP ``p`` hands a request's KV to a decode
instance at TP ``d`` (torch-free).

Ownership (vLLM's ``QKVParallelLinear``, ``engine.placement.check_tp``): with ``H`` KV heads
and TP ``t``,

- ``t <= H`` (``t`` divides ``H``): rank ``r`` holds heads ``[r * H / t, (r + 1) * H / t)``;
- ``t > H`` (``H`` divides ``t``): rank ``r`` holds the one head ``r // (t / H)``: each head
  is replicated on ``t / H`` consecutive ranks (and the query heads of rank ``r``, ``[r *
  H_q / t, (r + 1) * H_q / t)``, all read that head).

Transfer (``transfer_map``): decode rank ``j`` needs exactly the heads it holds; each comes
from one prefill rank that holds it. Where prefill replicates a head on ``k = p / H`` ranks,
decode rank ``j`` reads it from replica ``j % k``, so decode ranks that need the same head
spread over its replicas. Consecutive heads from the same prefill rank form one ``HeadSlice``
(one message). Every head a decode rank holds arrives exactly once, so the bytes it
receives are ``kv_bytes * local_heads / H`` (``bytes_per_decode_rank``): the KV-bytes
formula over ``d`` while ``d <= H``, over ``H`` when decode replicates.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_kv_split(tp: int, num_kv_heads: int) -> None:
    """``tp`` must divide ``num_kv_heads`` or be a multiple of it.

    Raises:
        ValueError: naming both.
    """
    _check(tp >= 1 and num_kv_heads >= 1 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0),
           f"TP {tp} must divide or be a multiple of the {num_kv_heads} KV heads")


def kv_heads_of(rank: int, tp: int, num_kv_heads: int) -> range:
    """The global KV heads rank ``rank`` of a TP-``tp`` instance holds, in order (module
    docstring); a rank's local head ``i`` is global head ``kv_heads_of(...)[i]``.

    Raises:
        ValueError: ``tp`` does not suit ``num_kv_heads`` or ``rank`` is not in ``[0, tp)``.
    """
    check_kv_split(tp, num_kv_heads)
    _check(0 <= rank < tp, f"rank {rank} is not one of a TP {tp} instance's ranks 0..{tp - 1}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def query_heads_of(rank: int, tp: int, num_heads: int) -> range:
    """The global query (attention) heads of rank ``rank``: ``[rank * H_q / tp, (rank + 1) *
    H_q / tp)``.

    Raises:
        ValueError: ``tp`` does not divide ``num_heads`` or ``rank`` is out of range.
    """
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
    """Every ``HeadSlice`` of a transfer from a TP-``prefill_tp`` instance to a
    TP-``decode_tp`` instance, ordered by decode rank, then head (module docstring).

    Raises:
        ValueError: a TP that does not suit ``num_kv_heads`` (``check_kv_split``).
    """
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
    """Bytes decode rank of a TP-``decode_tp`` instance receives for ``num_tokens`` tokens
    (over ``num_layers`` layers, default all): ``spec.kv_bytes(num_tokens, num_layers) *
    local_heads / H_kv`` (``engine.kv_cache.KVSpec.kv_bytes``), the same for every rank:
    ``kv_bytes / decode_tp`` while ``decode_tp <= H_kv``, ``kv_bytes / H_kv`` beyond.

    Raises:
        ValueError: ``decode_tp`` does not suit ``spec.num_kv_heads``.
    """
    heads = len(kv_heads_of(0, decode_tp, spec.num_kv_heads))
    return spec.kv_bytes(num_tokens, num_layers) * heads // spec.num_kv_heads
