"""What a worker reports to the router (no torch): ``WorkerEvent``s and per-step ``TokenBatch``es,
crossing processes.

Kinds:
    ``token``      an output token (colocated or decode worker); ``finish_reason`` on the last.
    ``prefilled``  a prefill worker's first token, plus the KV handles for the decode worker
                   (none when the first token already ended the request).
    ``kv_got``     a decode worker fetched and checked a request's KV.
    ``error``      the request failed on this worker; ``error`` says why.
    ``tokens``     a ``TokenBatch`` (not a ``WorkerEvent``): the plain tokens of one step
                   (not a request's first or last, no stamps, no logprobs), one event for
                   the whole step.

``time_s`` is when the worker produced the event (for a token: when its step ended); the router
keeps it beside its own receipt time. ``stamps`` carries timeline events measured inside the worker
(``time.time()`` seconds, names from ``engine.metrics``: prefill_started, prefill_finished, kv_put,
kv_got, decode_admitted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

TOKEN, PREFILLED, KV_GOT, ERROR, TOKENS = "token", "prefilled", "kv_got", "error", "tokens"


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
    # token / prefilled, requests asking for logprobs: the token's raw logprob and the top
    # (token_id, logprob) pairs, most likely first (engine.request.TokenOutput)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # the request's first token (token index 0 / prefilled): prompt tokens whose prefill
    # the prefix cache skipped on this worker (None: not that token)
    num_cached_prompt_tokens: int | None = None
    # the last event of a request from this worker (its finishing token, or prefilled):
    # times this worker preempted it (its KV freed, recomputed later)
    num_preemptions: int = 0
    # prefilled: bytes of the prompt's KV not sent because its decode worker caches that
    # prefix (``kv_token_start`` tokens)
    kv_bytes_saved: int = 0


@dataclass(frozen=True)
class TokenBatch:
    """One step's plain tokens on one worker: a request's token of that step that is neither its
    first nor its last here, carries no stamps and no logprobs. The rest of a step's tokens still
    leave as one ``WorkerEvent`` each.

    Why: at GPU step times a worker emits tens of tokens per step, and building, pickling
    and unpickling one ``WorkerEvent`` per token costs far more than a few tuples per step.

    Attributes:
        worker: the worker that produced them.
        time_s: ``time.time()`` when the step ended (every token of a step leaves then).
        request_ids, token_ids, indices: one entry per token, in batch order (``indices``:
            each token's output index, as ``WorkerEvent.index``)."""

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
    """``events`` with every ``TokenBatch`` replaced by its ``token`` events (for readers
    that want one event per token: tests, tools)."""
    out: list[WorkerEvent] = []
    for event in events:
        out.extend(event.expand() if event.kind == TOKENS else (event,))
    return out
