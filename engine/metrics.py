"""Request records and the serving metrics derived from them (no torch): measure at the
boundaries, derive later (DistServe's ``lifetime.py``).

The router creates one ``RequestRecord`` per request; ``arrived`` is its scheduled arrival, so a
load generator that falls behind cannot hide queueing (``dispatch_lag_s``). Each metric is a
function of a record, defined once here; ``summarize`` pools them over a run, ``goodput_rate``
reads a sweep.

Clocks: TTFT and E2E use the router's; ITL and TPOT the worker's when every token has one. TTFT
contains the KV put; the get shows in the first inter-token gap. All times are seconds; a metric
whose events are missing is None, never 0. A request with no output token (or an error) is a
failure: no TTFT, and it misses every SLO. Sources: vLLM's benchmark_serving (TTFT, TPOT, ITL,
E2EL, goodput); DistServe (Zhong et al., OSDI'24): SLO attainment, goodput per GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

# Event names: the keys of RequestRecord.timeline.
ARRIVED = "arrived"  # the request's scheduled arrival (run start + offset)
DISPATCHED = "dispatched"  # the router actually dispatched it (>= arrived)
PREFILL_QUEUED = "prefill_queued"  # the prefill worker (or colocated engine) queued it
PREFILL_STARTED = "prefill_started"  # its prompt started computing
PREFILL_FINISHED = "prefill_finished"  # its first token was sampled
KV_PUT = "kv_put"  # the prompt's KV is owned by the transport
KV_GOT = "kv_got"  # the decode worker holds the KV
DECODE_ADMITTED = "decode_admitted"  # the decode worker admitted it for decoding
FINISHED = "finished"  # the router saw its last token (or its error)
ERROR = "error"  # it failed
EVENTS = (
    ARRIVED, DISPATCHED, PREFILL_QUEUED, PREFILL_STARTED, PREFILL_FINISHED,
    KV_PUT, KV_GOT, DECODE_ADMITTED, FINISHED, ERROR,
)


@dataclass
class RequestRecord:
    """Everything measured about one request; JSON-serializable through ``to_dict``.

    ``placement``: e.g. ``"disagg:1P1D"``; ``prefill_path``: ``"local"`` (prefilled where it
    decodes) or ``"remote"`` (KV shipped). ``kv_bytes``: prompt KV bytes shipped (0 colocated);
    ``kv_bytes_saved``: not shipped because the decode worker cached that prefix. ``kv_put_s`` /
    ``kv_get_s``: seconds inside the transport's ``put`` (all layer ranges) / fetching and
    checking the KV; ``kv_transfer_s`` their sum (None: no transfer). ``num_cached_prompt_tokens``:
    vLLM's ``num_cached_tokens``; ``num_preemptions``: summed over its workers. ``timeline``:
    event -> ``time.time()`` s; ``token_times_s`` / ``token_worker_times_s``: ``time.time()`` when
    each output token left the router / was produced by the worker's step (empty if unreported)."""

    request_id: str
    placement: str = ""
    prefill_worker: str | None = None
    decode_worker: str | None = None
    num_prompt_tokens: int = 0
    prefill_path: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    kv_bytes: int = 0
    kv_put_s: float | None = None
    kv_get_s: float | None = None
    kv_transfer_s: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    kv_bytes_saved: int = 0
    timeline: dict[str, float] = field(default_factory=dict)
    token_times_s: list[float] = field(default_factory=list)
    token_worker_times_s: list[float] = field(default_factory=list)

    def stamp(self, event: str, time_s: float | None = None) -> None:
        """Record ``event`` at ``time_s`` (default: now, ``time.time()``)."""
        self.timeline[event] = time.time() if time_s is None else float(time_s)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        """Inverse of ``to_dict``. Raises ValueError on keys that are not fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown RequestRecord fields {sorted(unknown)}; allowed: {sorted(names)}")
        d = dict(d)
        d["output_token_ids"] = [int(t) for t in d.get("output_token_ids", [])]
        d["timeline"] = {str(k): float(v) for k, v in d.get("timeline", {}).items()}
        d["token_times_s"] = [float(t) for t in d.get("token_times_s", [])]
        d["token_worker_times_s"] = [float(t) for t in d.get("token_worker_times_s", [])]
        return cls(**d)


def _between(r: RequestRecord, start: str, end: str) -> float | None:
    if start in r.timeline and end in r.timeline:
        return r.timeline[end] - r.timeline[start]
    return None


def failed(r: RequestRecord) -> bool:
    """True when the request errored or produced no output token."""
    return r.error is not None or len(r.token_times_s) == 0


def ttft_s(r: RequestRecord) -> float | None:
    """Time to first token (vLLM's TTFT): first token leaving the router minus ``arrived``."""
    if not r.token_times_s or ARRIVED not in r.timeline:
        return None
    return r.token_times_s[0] - r.timeline[ARRIVED]


def _worker_times(r: RequestRecord) -> list[float]:
    """Worker-clock token times when every token has one, else the router's receipt times."""
    w = r.token_worker_times_s
    return w if w and len(w) == len(r.token_times_s) else r.token_times_s


def _gaps(t: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(t, t[1:])]


def itl_s(r: RequestRecord) -> list[float]:
    """Inter-token latencies (vLLM's ITL) on the worker clock (router receipt times without it),
    TTFT excluded. Empty with fewer than two tokens."""
    return _gaps(_worker_times(r))


def itl_router_s(r: RequestRecord) -> list[float]:
    """Inter-token latencies on the router clock (includes the router's polling quantisation)."""
    return _gaps(r.token_times_s)


def e2e_s(r: RequestRecord) -> float | None:
    """End-to-end latency: last output token minus ``arrived`` (vLLM's E2EL)."""
    if not r.token_times_s or ARRIVED not in r.timeline:
        return None
    return r.token_times_s[-1] - r.timeline[ARRIVED]


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first, ``(t_last - t_first) / (n_out - 1)`` on the worker
    clock (router times without it); vLLM's TPOT is the same span on the router clock
    (``tpot_router_s``). None with fewer than two output tokens."""
    t = _worker_times(r)
    if len(t) < 2:
        return None
    return (t[-1] - t[0]) / (len(t) - 1)


def tpot_router_s(r: RequestRecord) -> float | None:
    """vLLM's TPOT on the router clock: ``(E2E - TTFT) / (n_out - 1)``."""
    n_out = len(r.token_times_s)
    e2e, ttft = e2e_s(r), ttft_s(r)
    if n_out < 2 or e2e is None or ttft is None:
        return None
    return (e2e - ttft) / (n_out - 1)


def dispatch_lag_s(r: RequestRecord) -> float | None:
    """``dispatched - arrived`` (scheduled): how far the load generator fell behind."""
    return _between(r, ARRIVED, DISPATCHED)


def prefill_queue_s(r: RequestRecord) -> float | None:
    """``prefill_started - prefill_queued`` (or ``- arrived`` without ``prefill_queued``)."""
    start = PREFILL_QUEUED if PREFILL_QUEUED in r.timeline else ARRIVED
    return _between(r, start, PREFILL_STARTED)


def prefill_s(r: RequestRecord) -> float | None:
    """Prefill compute time: ``prefill_finished - prefill_started``."""
    return _between(r, PREFILL_STARTED, PREFILL_FINISHED)


def first_decode_gap_s(r: RequestRecord) -> float | None:
    """``token_times_s[1] - token_times_s[0]``: contains the KV transfer under disaggregation."""
    t = r.token_times_s
    return t[1] - t[0] if len(t) >= 2 else None


def kv_put_s(r: RequestRecord) -> float | None:
    """Seconds inside the transport's ``put`` (prefill worker); None if no transfer."""
    return r.kv_put_s


def kv_get_s(r: RequestRecord) -> float | None:
    """Seconds the decode worker spent getting the KV; None if no transfer."""
    return r.kv_get_s


def kv_transfer_s(r: RequestRecord) -> float | None:
    """``kv_put_s + kv_get_s`` (``record.kv_transfer_s`` when only one is known)."""
    if r.kv_put_s is not None and r.kv_get_s is not None:
        return r.kv_put_s + r.kv_get_s
    return r.kv_transfer_s


def kv_gb_per_s(r: RequestRecord) -> float | None:
    """Achieved transfer bandwidth, ``kv_bytes / kv_transfer_s / 1e9`` (GB/s, decimal)."""
    seconds = kv_transfer_s(r)
    if not r.kv_bytes or seconds is None or seconds <= 0:
        return None
    return r.kv_bytes / seconds / 1e9


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds: TTFT and TPOT (DistServe's two SLOs)."""

    ttft_s: float
    tpot_s: float


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """Not failed, TTFT <= slo.ttft_s and TPOT <= slo.tpot_s (DistServe: both; a one-token
    request has no TPOT and passes that part)."""
    if failed(r):
        return False
    ttft, tpot = ttft_s(r), tpot_s(r)
    if ttft is None or ttft > slo.ttft_s:
        return False
    return tpot is None or tpot <= slo.tpot_s


def slo_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of ALL requests meeting the SLO, failures as misses (DistServe); NaN if empty."""
    if not records:
        return math.nan
    return sum(meets_slo(r, slo) for r in records) / len(records)


_METRICS: dict[str, Callable[[RequestRecord], float | None]] = {
    "ttft": ttft_s,
    "tpot": tpot_s,
    "tpot_router": tpot_router_s,
    "e2e": e2e_s,
    "prefill_queue": prefill_queue_s,
    "prefill": prefill_s,
    "kv_put": kv_put_s,
    "kv_get": kv_get_s,
    "kv_transfer": kv_transfer_s,
    "first_decode_gap": first_decode_gap_s,
}


def _stats(name: str, values: Iterable[float]) -> dict[str, float]:
    """``<name>_mean_s`` and p50/p90/p99 (numpy.percentile, linear); NaN when empty."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {f"{name}_{k}_s": math.nan for k in ("mean", "p50", "p90", "p99")}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {f"{name}_mean_s": float(v.mean()), f"{name}_p50_s": float(p50),
            f"{name}_p90_s": float(p90), f"{name}_p99_s": float(p99)}


def _default_duration_s(records: Sequence[RequestRecord]) -> float:
    """Last finish (``finished``, else last token) minus first ``arrived``; NaN if unknown."""
    arrivals = [r.timeline[ARRIVED] for r in records if ARRIVED in r.timeline]
    ends = [r.timeline.get(FINISHED, r.token_times_s[-1] if r.token_times_s else None)
            for r in records]
    ends = [e for e in ends if e is not None]
    if not arrivals or not ends:
        return math.nan
    return max(ends) - min(arrivals)


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None,
              duration_s: float | None = None) -> dict[str, float]:
    """Pool per-request metrics over a run.

    Latencies use completed requests (as vLLM's benchmark); ITL pools every gap (``itl_router_*``:
    router clock); ``dispatch_lag_*`` covers every request. Rates divide by ``duration_s``
    (default: last finish - first arrival): throughput_req_s, output_tok_s; slo_attainment
    (DistServe's, all requests) and goodput_req_s (vLLM's), NaN without ``slo``; kv_bytes_total,
    kv_gb_s (over summed put + get s), kv_bytes_saved_total; prefill_tokens_skipped,
    prefix_hit_rate (NaN with no prompt tokens), num_preemptions_total."""
    done = [r for r in records if not failed(r)]
    out: dict[str, float] = {"num_requests": len(records), "num_failed": len(records) - len(done)}
    for name, fn in _METRICS.items():
        out.update(_stats(name, (v for v in map(fn, done) if v is not None)))
    out.update(_stats("itl", (g for r in done for g in itl_s(r))))
    out.update(_stats("itl_router", (g for r in done for g in itl_router_s(r))))
    out.update(_stats("dispatch_lag", (v for v in map(dispatch_lag_s, records) if v is not None)))
    if duration_s is None:
        duration_s = _default_duration_s(records)
    dur = duration_s if duration_s > 0 else math.nan
    out["duration_s"] = float(duration_s)
    out["throughput_req_s"] = len(done) / dur
    out["output_tok_s"] = sum(len(r.token_times_s) for r in done) / dur
    if slo is None:
        out["slo_attainment"] = out["goodput_req_s"] = math.nan
    else:
        out["slo_attainment"] = slo_attainment(records, slo)
        out["goodput_req_s"] = sum(meets_slo(r, slo) for r in records) / dur
    out["kv_bytes_total"] = sum(r.kv_bytes for r in records)
    moved = [(r.kv_bytes, kv_transfer_s(r)) for r in records if kv_transfer_s(r) is not None]
    seconds = sum(s for _, s in moved)
    out["kv_gb_s"] = sum(b for b, _ in moved) / seconds / 1e9 if seconds > 0 else math.nan
    out["prefill_tokens_skipped"] = prefill_tokens_skipped(records)
    out["prefix_hit_rate"] = prefix_hit_rate(records)
    out["kv_bytes_saved_total"] = sum(r.kv_bytes_saved for r in records)
    out["num_preemptions_total"] = sum(r.num_preemptions for r in records)
    return out


def prefill_tokens_skipped(records: Sequence[RequestRecord]) -> int:
    """Sum of ``num_cached_prompt_tokens`` over ``records``, failed requests included."""
    return sum(r.num_cached_prompt_tokens for r in records)


def prefix_hit_rate(records: Sequence[RequestRecord]) -> float:
    """``prefill_tokens_skipped`` / prompt tokens: vLLM's prefix-cache hit rate
    (``vllm:prefix_cache_hits`` / ``queries``). NaN with no prompt tokens."""
    prompt_tokens = sum(r.num_prompt_tokens for r in records)
    return prefill_tokens_skipped(records) / prompt_tokens if prompt_tokens else math.nan


ATTAINMENT_TARGET = 0.9  # DistServe's goodput threshold


def goodput_rate(rates: Sequence[float], attainments: Sequence[float], num_devices: int,
                 target: float = ATTAINMENT_TARGET) -> float:
    """DistServe's goodput (requests/s per device) from a rate sweep: the highest swept rate whose
    attainment, and that of every lower swept rate, is >= ``target`` (DistServe, OSDI'24, §2),
    over ``num_devices``; 0.0 when the lowest rate misses (NaN misses). Only swept points count.

    Raises:
        ValueError: lengths differ, or ``num_devices < 1``."""
    if len(rates) != len(attainments):
        raise ValueError(f"rates and attainments differ in length: {len(rates)} vs {len(attainments)}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    best = 0.0
    for rate, a in sorted(zip(rates, attainments), key=lambda x: x[0]):
        if not a >= target:  # NaN misses too
            break
        best = rate
    return best / num_devices


PREFILL, DECODE = "prefill", "decode"  # BatchEntry.phase


class BatchEntry(NamedTuple):
    """One request's part of a step (``StepRecord.batch``); a NamedTuple, cheap on the hot path,
    written by ``json.dumps`` as an array. ``num_tokens``: computed by the step (a prompt chunk, or
    1 for a decode); ``phase``: ``"prefill"`` or ``"decode"`` at the step's start;
    ``num_context_tokens``: computed before the step (a chunk of n after k attends to <= k + n
    keys per query, a decode to k + 1)."""

    request_id: str
    num_tokens: int
    phase: str
    num_context_tokens: int


@dataclass(frozen=True)
class StepRecord:
    """One engine step that ran a forward: its phase mix, size, duration and batch.

    ``start_s``: ``time.time()`` at the step's start; ``duration_s``: schedule-to-update wall
    time (s), on an emulated device the modelled hold; its tokens are stamped ``start_s +
    duration_s``. ``batch``: in the scheduler's order
    (decodes first, then prompt chunks). ``lateness``: an emulated device's held ÷ modelled time
    (1.0 = on time); None on a real device (and then not in the row)."""

    start_s: float
    duration_s: float
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    batch: tuple[BatchEntry, ...] = ()
    lateness: float | None = None

    def to_row(self) -> dict:
        """The record as one flat row (steps.csv): ``batch`` as JSON text of ``[request_id,
        num_tokens, phase, num_context_tokens]`` arrays (``parse_batch`` reads it back)."""
        return {"start_s": self.start_s, "duration_s": self.duration_s,
                "num_requests": self.num_requests,
                "num_prefill_tokens": self.num_prefill_tokens,
                "num_decode_tokens": self.num_decode_tokens,
                "batch": json.dumps(self.batch, separators=(",", ":")),
                **({} if self.lateness is None else {"lateness": self.lateness})}


def parse_batch(text: str) -> tuple[BatchEntry, ...]:
    """The entries of a ``StepRecord.to_row()["batch"]`` cell.

    Raises:
        ValueError: ``text`` is not such a JSON list (``json.JSONDecodeError`` is one)."""
    try:
        return tuple(BatchEntry(str(r), int(n), str(p), int(c)) for r, n, p, c in json.loads(text))
    except (TypeError, ValueError) as err:
        raise ValueError(f"not a step batch ([[request_id, num_tokens, phase, "
                         f"num_context_tokens], ...]): {text[:80]!r}: {err}") from None
