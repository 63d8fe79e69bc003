"""Where the simulator's error comes from: real runs' steps against the step model (no torch).
Each step record carries its batch (``StepRecord.batch``), so its features are read off it
(``step_features``): a prompt chunk of ``n`` after ``k`` adds ``n`` tokens and ``n(k + n)`` pairs,
a decode after ``k`` one request of context ``k + 1``. ``step_table`` sets the model beside each
measured step and the loop's gap between steps (time no step model contains); ``ttft_parts``
splits TTFT. A real run and its simulated twin give the same tables, compared part by part."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from engine.metrics import (ARRIVED, DISPATCHED, PREFILL, PREFILL_FINISHED, PREFILL_QUEUED,
                            PREFILL_STARTED, RequestRecord, parse_batch)

STEP_COLUMNS = ["worker", "start_s", "duration_s", "num_prefill_tokens", "num_decode_tokens",
                "prefill_tokens", "prefill_attention", "batch_size", "sum_context",
                "request_ids", "rebuilt", "model_s", "ratio", "kind", "gap_s"]


def step_features(steps: Sequence[dict]) -> list[dict]:
    """Every step (``StepRecord.to_row`` rows; ``batch`` as JSON text or entries), in start order
    per worker, plus ``prefill_tokens, prefill_attention, batch_size, sum_context``,
    ``request_ids`` and ``rebuilt`` (the batch's token counts equal the record's).

    Raises:
        ValueError: a step without its batch (an old steps.csv: rerun it), or not a batch."""
    out = []
    for st in sorted(steps, key=lambda s: (s["worker"], s["start_s"])):
        batch = st.get("batch")
        if batch is None or (isinstance(batch, float) and math.isnan(batch)):
            raise ValueError(f"step of {st['worker']} at {st['start_s']} has no batch (steps "
                             "recorded before batches were: rerun the run)")
        entries = parse_batch(batch) if isinstance(batch, str) else tuple(batch)
        n_pre = q_pre = num_decode = sum_ctx = 0
        for e in entries:
            if e.phase == PREFILL:
                n_pre += e.num_tokens
                q_pre += e.num_tokens * (e.num_context_tokens + e.num_tokens)
            else:
                num_decode += 1
                sum_ctx += e.num_context_tokens + 1
        out.append({**st, "prefill_tokens": n_pre, "prefill_attention": q_pre,
                    "batch_size": num_decode, "sum_context": sum_ctx,
                    "request_ids": tuple(e.request_id for e in entries),
                    "rebuilt": (n_pre == int(st["num_prefill_tokens"])
                                and num_decode == int(st["num_decode_tokens"]))})
    return out


def step_table(steps: Sequence[dict],
               step_s: Callable[[int, int, int, int], float]) -> pd.DataFrame:
    """``step_features`` with ``STEP_COLUMNS``: ``model_s`` (``step_s`` on the batch), ``ratio``
    (measured ÷ modelled), ``kind`` (prefill, decode, mixed), ``gap_s`` (to the worker's next step
    when it holds a request this one held; else NaN)."""
    rows = step_features(steps)
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
    """Per worker and step kind: steps, median and time-weighted (Σ measured ÷ Σ modelled) ratio,
    mean batch size, median loop gap (ms)."""
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
    """TTFT cut at its stamps (s; NaN where missing): ``dispatch_s`` arrived -> dispatched,
    ``submit_s`` -> prefill_queued, ``queue_s`` -> prefill_started, ``prefill_s`` ->
    prefill_finished, ``delivery_s`` worker's first-token time -> router's. They sum to TTFT."""
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
