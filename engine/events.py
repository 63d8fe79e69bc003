"""What a worker reports to the router (no torch): one event type, crossing processes.

Kinds:
    ``token``      an output token (colocated or decode worker); ``finish_reason`` on the last.
    ``prefilled``  a prefill worker's first token, plus the KV handles for the decode worker
                   (none when the first token already ended the request).
    ``kv_got``     a decode worker fetched and checked a request's KV.
    ``error``      the request failed on this worker; ``error`` says why.

``time_s`` is when the worker produced the event (for a token: when its step ended); the
router keeps it beside its own receipt time. ``stamps`` carries timeline events measured inside the worker (``time.time()`` seconds,
names from ``engine.metrics``: prefill_started, prefill_finished, kv_put, kv_got,
decode_admitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOKEN, PREFILLED, KV_GOT, ERROR = "token", "prefilled", "kv_got", "error"


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
