"""Where the simulator's error comes from: real runs' steps against the step model (no torch).

A real run's step records (``engine.engine.StepRecord``: start, duration, token counts)
carry no per-entry lengths, so the batch of every real step is rebuilt from the request
records of the same run:

1. Decode entries: output token ``i >= 1`` of a request was produced by the step of its
   decode worker that ended at ``token_worker_times_s[i]`` (the engine stamps a step's
   tokens with that step's end, ``Engine.step``); it attended to ``prompt + i`` KV tokens
   (its prompt, its ``i - 1`` earlier outputs fed back, and the new token).
2. Prompt entries: a step's prompt tokens go to the prompts of its worker that had started
   (``prefill_started`` is the start of their first step) and are not yet complete, in order
   of their start: a prompt part-way through takes its next chunk first, then newly admitted
   ones, as ``engine.scheduler.Scheduler`` fills the token budget. A chunk of ``n`` tokens
   after ``k`` computed ones adds ``n`` prompt tokens and ``n(k + n)`` attention pairs.

``step_table`` evaluates the step model on each rebuilt batch beside its measured duration,
and the loop's time between two steps of one worker with work (``gap_s``: scheduling,
turning tokens into events, the worker's commands: time no step model contains).
``ttft_parts`` splits each request's TTFT into dispatch, queueing, prefill and delivery to
the router. Both tables come out of a real run and of its simulated twin alike, so the
two can be compared part by part.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from engine.metrics import (ARRIVED, DISPATCHED, PREFILL_FINISHED, PREFILL_QUEUED,
                            PREFILL_STARTED, RequestRecord)

# Steps and tokens share a ``time.time()`` float; start + duration may differ from it by
# rounding only (far below a millisecond).
MATCH_TOL_S = 1e-5
STEP_COLUMNS = ["worker", "start_s", "duration_s", "num_prefill_tokens", "num_decode_tokens",
                "prefill_tokens", "prefill_attention", "batch_size", "sum_context",
                "request_ids", "rebuilt", "model_s", "ratio", "kind", "gap_s"]


def rebuild_steps(records: Sequence[RequestRecord], steps: Sequence[dict]) -> list[dict]:
    """Every step of one run with its batch rebuilt (module docstring, steps 1-2).

    Args:
        records: the run's request records (``RequestRecord``).
        steps: the run's step records, dicts with ``worker, start_s, duration_s,
            num_prefill_tokens, num_decode_tokens``.

    Returns:
        One dict per step, in start order per worker: the step's own keys plus
        ``prefill_tokens, prefill_attention, batch_size, sum_context`` (``StepFeatures``'
        fields), ``request_ids`` (the entries, a tuple) and ``rebuilt`` (True when the
        rebuilt token counts equal the step record's).
    """
    decode_times: dict[str, list[tuple[float, int, str]]] = {}
    prompts: dict[str, list[list]] = {}
    for r in records:
        for i, t in enumerate(r.token_worker_times_s[1:], start=1):
            if r.decode_worker is not None:
                decode_times.setdefault(r.decode_worker, []).append(
                    (t, r.num_prompt_tokens + i, r.request_id))
        started = r.timeline.get(PREFILL_STARTED)
        if r.prefill_worker is not None and started is not None:
            # [start, prompt length, tokens computed so far, request id]
            prompts.setdefault(r.prefill_worker, []).append(
                [started, r.num_prompt_tokens, 0, r.request_id])
    for v in decode_times.values():
        v.sort()
    for v in prompts.values():
        v.sort(key=lambda p: p[0])
    out = []
    by_worker: dict[str, list[dict]] = {}
    for st in steps:
        by_worker.setdefault(st["worker"], []).append(st)
    for worker, worker_steps in by_worker.items():
        times = decode_times.get(worker, [])
        keys = [t for t, _, _ in times]
        pending = prompts.get(worker, [])
        for st in sorted(worker_steps, key=lambda s: s["start_s"]):
            start = float(st["start_s"])
            end = start + float(st["duration_s"])
            lo = bisect.bisect_left(keys, end - MATCH_TOL_S)
            hi = bisect.bisect_right(keys, end + MATCH_TOL_S)
            decodes = times[lo:hi]
            ids = [rid for _, _, rid in decodes]
            left = int(st["num_prefill_tokens"])
            n_pre = q_pre = 0
            for p in pending:
                if left <= 0 or p[0] > start + MATCH_TOL_S:
                    break
                if p[2] >= p[1]:
                    continue
                n = min(left, p[1] - p[2])
                q_pre += n * (p[2] + n)
                p[2] += n
                n_pre += n
                left -= n
                ids.append(p[3])
            out.append({**st, "prefill_tokens": n_pre, "prefill_attention": q_pre,
                        "batch_size": len(decodes), "sum_context": sum(c for _, c, _ in decodes),
                        "request_ids": tuple(ids),
                        "rebuilt": left == 0 and len(decodes) == int(st["num_decode_tokens"])})
    return out


def step_table(records: Sequence[RequestRecord], steps: Sequence[dict],
               step_s: Callable[[int, int, int, int], float]) -> pd.DataFrame:
    """The rebuilt steps of one run (``rebuild_steps``) with the model beside them.

    Args:
        step_s: the step model, ``DeviceProfile.step_time()``.

    Returns:
        ``STEP_COLUMNS``: ``model_s`` (the model on the rebuilt batch), ``ratio`` (measured ÷
        modelled), ``kind`` (``prefill``, ``decode`` or ``mixed``), ``gap_s`` (from this
        step's end to the worker's next step, when that next step holds a request this step
        held, i.e. the loop went straight on; NaN otherwise and for a worker's last step).
    """
    rows = rebuild_steps(records, steps)
    df = pd.DataFrame(rows, columns=[c for c in STEP_COLUMNS if c not in
                                     ("model_s", "ratio", "kind", "gap_s")])
    if df.empty:
        return pd.DataFrame(columns=STEP_COLUMNS)
    df["model_s"] = [step_s(a, b, c, d) for a, b, c, d in
                     zip(df["prefill_tokens"], df["prefill_attention"], df["batch_size"],
                         df["sum_context"])]
    df["ratio"] = df["duration_s"] / df["model_s"].where(df["model_s"] > 0)
    df["kind"] = np.where(df["prefill_tokens"] == 0, "decode",
                          np.where(df["batch_size"] == 0, "prefill", "mixed"))
    gaps = []
    for _, g in df.groupby("worker", sort=False):
        g = g.sort_values("start_s")
        ends = (g["start_s"] + g["duration_s"]).to_numpy()
        starts, ids = g["start_s"].to_numpy(), list(g["request_ids"])
        for j in range(len(g)):
            straight = j + 1 < len(g) and bool(set(ids[j]) & set(ids[j + 1]))
            gaps.append((g.index[j], starts[j + 1] - ends[j] if straight else math.nan))
    df["gap_s"] = pd.Series(dict(gaps))
    return df[STEP_COLUMNS]


def step_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per worker and step kind: steps, median and time-weighted (Σ measured ÷ Σ modelled)
    ratio, mean batch size, and the median loop gap between back-to-back steps (ms)."""
    t = table[table["rebuilt"] & table["model_s"].gt(0)]
    if t.empty:
        return pd.DataFrame(columns=["worker", "kind", "num_steps", "ratio_median",
                                     "ratio_weighted", "mean_batch_size", "gap_p50_ms"])
    g = t.groupby(["worker", "kind"])
    return pd.DataFrame({
        "num_steps": g.size(), "ratio_median": g["ratio"].median(),
        "ratio_weighted": g["duration_s"].sum() / g["model_s"].sum(),
        "mean_batch_size": g["batch_size"].mean(),
        "gap_p50_ms": 1e3 * g["gap_s"].median()}).reset_index()


TTFT_PARTS = ("dispatch_s", "submit_s", "queue_s", "prefill_s", "delivery_s")


def ttft_parts(records: Sequence[RequestRecord]) -> pd.DataFrame:
    """TTFT of each request cut at its stamps (seconds; NaN where a stamp is missing):
    ``dispatch_s`` arrived -> dispatched (load generator), ``submit_s`` dispatched ->
    prefill_queued (router), ``queue_s`` prefill_queued -> prefill_started (the command's
    trip to the worker and its wait for a step), ``prefill_s`` prefill_started ->
    prefill_finished (its prompt's steps), ``delivery_s`` the worker's first-token time ->
    the router's (a put under disaggregation, then the event's trip). They sum to TTFT."""
    rows = []
    for r in records:
        tl = r.timeline

        def span(a, b):
            return tl[b] - tl[a] if a in tl and b in tl else math.nan

        first = r.token_times_s[0] if r.token_times_s else math.nan
        worker_first = r.token_worker_times_s[0] if r.token_worker_times_s else tl.get(
            PREFILL_FINISHED, math.nan)
        rows.append({"request_id": r.request_id, "num_prompt_tokens": r.num_prompt_tokens,
                     "dispatch_s": span(ARRIVED, DISPATCHED),
                     "submit_s": span(DISPATCHED, PREFILL_QUEUED),
                     "queue_s": span(PREFILL_QUEUED, PREFILL_STARTED),
                     "prefill_s": span(PREFILL_STARTED, PREFILL_FINISHED),
                     "delivery_s": first - worker_first,
                     "ttft_s": first - tl.get(ARRIVED, math.nan)})
    return pd.DataFrame(rows)
