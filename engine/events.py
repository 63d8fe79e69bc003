"""What a worker reports to the router (no torch), crossing processes. ``WorkerEvent`` kinds:
``token`` (``finish_reason`` on the last), ``prefilled`` (KV handles, after the first ``token``,
whose fields it repeats; none if that token ended it), ``kv_got`` (KV fetched and checked),
``error`` (``kv_fetch_failed``: the decode worker's fetch of the KV failed, the handles freed),
``died`` (a worker's last words: its loop stopped, ``error`` says why; nothing follows);
``TokenBatch``: one step's plain tokens. ``time_s``: when the worker produced the event;
``stamps``: timeline events measured in the worker (``time.time()`` s, ``engine.metrics`` names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

TOKEN, PREFILLED, KV_GOT, ERROR, TOKENS = "token", "prefilled", "kv_got", "error", "tokens"
DIED = "died"


@dataclass(frozen=True)
class WorkerEvent:
    kind: str
    request_id: str
    worker: str
    time_s: float
    token_id: int | None = None
    index: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    kv_handles: tuple[Any, ...] = ()  # opaque transport handles (prefilled)
    kv_bytes: int = 0
    kv_transfer_s: float | None = None  # kv_got: the decode side's fetch seconds
    kv_put_s: float | None = None  # prefilled: seconds inside the transport's put, all ranges
    kv_get_s: float | None = None  # kv_got: seconds fetching and checking every range
    stamps: dict[str, float] = field(default_factory=dict)
    # requests asking for logprobs: raw logprob, top (token_id, logprob) pairs first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # the first token: prompt tokens the prefix cache skipped here (None: not that token)
    num_cached_prompt_tokens: int | None = None
    # a request's last event from this worker: times it preempted it
    num_preemptions: int = 0
    # prefilled: KV bytes not sent because the decode worker caches that prefix
    kv_bytes_saved: int = 0
    # error: fetching the KV failed (its producer may have died with it); not a refused admit
    kv_fetch_failed: bool = False


@dataclass(frozen=True)
class TokenBatch:
    """One step's plain tokens on one worker (not a request's first or last here, no stamps, no
    logprobs); a ``WorkerEvent`` per token costs far more to pickle at GPU step rates. ``time_s``:
    when the step ended; ``indices``: output indices, as ``WorkerEvent.index``."""

    worker: str
    time_s: float
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    indices: tuple[int, ...]
    kind: ClassVar[str] = TOKENS

    def expand(self) -> list[WorkerEvent]:
        """The same tokens as one ``token`` ``WorkerEvent`` each."""
        return [WorkerEvent(TOKEN, rid, self.worker, self.time_s, token_id=tid, index=i)
                for rid, tid, i in zip(self.request_ids, self.token_ids, self.indices)]


def expand(events) -> list[WorkerEvent]:
    """``events`` with every ``TokenBatch`` replaced by its ``token`` events."""
    out: list[WorkerEvent] = []
    for event in events:
        out.extend(event.expand() if event.kind == TOKENS else (event,))
    return out
