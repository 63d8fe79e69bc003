"""Tables and verdicts from the records of a placement comparison (no torch).

``pdlab compare`` runs several placements on the same devices and workload at one or more
arrival rates. For each ``(placement, rate)`` run it holds the routers' ``RequestRecord``s;
this module turns them into:

- ``summary_table``: one row per run, columns ``SUMMARY_COLUMNS`` first (from
  ``engine.metrics.summarize``; no metric is defined here a second time).
- ``latency_breakdown``: per placement, the mean seconds a request spends in each stage.
- ``attainment_curve`` / ``goodput_per_device``: DistServe's SLO attainment vs rate and the
  goodput per device read from it (``engine.metrics.goodput_rate``).
- ``verdict``: which placement wins, and why, in numbers.
- ``requests_frame``: one row per request with its metrics, for plots.

All times are seconds; a value whose events are missing is NaN, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Sequence

import numpy as np
import pandas as pd

from engine import metrics as m
from engine.config import parse_placement
from engine.metrics import SLO, RequestRecord

SUMMARY_COLUMNS = [
    "placement", "rate", "num_requests", "num_failed", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
    "tpot_p99_s", "itl_p99_s", "e2e_p50_s", "throughput_req_s", "output_tok_s", "slo_attainment",
    "kv_transfer_p50_s", "prefill_p50_s",
]
# Columns after SUMMARY_COLUMNS (also from summarize).
EXTRA_COLUMNS = [
    "goodput_req_s", "ttft_mean_s", "tpot_mean_s", "itl_p50_s", "e2e_p99_s",
    "first_decode_gap_p50_s", "prefill_queue_p50_s", "kv_transfer_mean_s", "duration_s",
    "kv_bytes_total",
]
BREAKDOWN_STAGES = ["prefill_queue_s", "prefill_s", "transfer_s", "decode_queue_s", "decode_s"]
ATTAINMENT_TARGET = 0.9  # DistServe's goodput threshold (DESIGN §6)

Run = tuple[str, float, Sequence[RequestRecord]]


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def placement_kind(placement: str) -> str:
    """``"colocated:2"`` and ``"colocated-nochunk:2"`` -> ``"colocated"``, ``"disagg:1p1d"``
    -> ``"disagg"``."""
    return parse_placement(placement)[0]


def is_colocated(placement: str) -> bool:
    return placement_kind(placement) == "colocated"


# ---- per run ------------------------------------------------------------------------------


def summary_row(placement: str, rate: float, records: Sequence[RequestRecord], slo: SLO | None,
                duration_s: float | None = None) -> dict:
    """One row: ``SUMMARY_COLUMNS`` then ``EXTRA_COLUMNS``, from ``engine.metrics.summarize``
    (latencies over completed requests; attainment over all; failures count as misses)."""
    s = m.summarize(records, slo, duration_s=duration_s)
    row: dict = {"placement": placement, "rate": float(rate)}
    for col in SUMMARY_COLUMNS[2:] + EXTRA_COLUMNS:
        row[col] = s[col]
    row["num_requests"] = int(row["num_requests"])
    row["num_failed"] = int(row["num_failed"])
    row["kv_bytes_total"] = int(row["kv_bytes_total"])
    return row


def summary_table(runs: Sequence[Run], slo: SLO | None) -> pd.DataFrame:
    """One row per ``(placement, rate, records)`` run, in the given order. A run may carry a
    4th element, its ``duration_s`` (default: last finish - first arrival)."""
    rows = [summary_row(run[0], run[1], run[2], slo, *run[3:4]) for run in runs]
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS + EXTRA_COLUMNS)


# ---- per request --------------------------------------------------------------------------


def requests_frame(records: Sequence[RequestRecord], slo: SLO | None = None) -> pd.DataFrame:
    """One row per request: ids, token counts, and its metrics from ``engine.metrics``
    (NaN where undefined). ``arrived_s`` is the raw ``time.time()`` of arrival.
    ``meets_slo`` is present only when ``slo`` is given."""
    rows = []
    for r in records:
        itl = m.itl_s(r)
        row = {
            "request_id": r.request_id,
            "placement": r.placement,
            "failed": m.failed(r),
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": len(r.token_times_s),
            "arrived_s": _nan(r.timeline.get(m.ARRIVED)),
            "ttft_s": _nan(m.ttft_s(r)),
            "tpot_s": _nan(m.tpot_s(r)),
            "e2e_s": _nan(m.e2e_s(r)),
            "itl_max_s": max(itl) if itl else math.nan,
            "first_decode_gap_s": _nan(m.first_decode_gap_s(r)),
            "prefill_queue_s": _nan(m.prefill_queue_s(r)),
            "prefill_s": _nan(m.prefill_s(r)),
            "kv_transfer_s": _nan(m.kv_transfer_s(r)),
            "kv_bytes": r.kv_bytes,
        }
        if slo is not None:
            row["meets_slo"] = m.meets_slo(r, slo)
        rows.append(row)
    cols = ["request_id", "placement", "failed", "num_prompt_tokens", "num_output_tokens",
            "arrived_s", "ttft_s", "tpot_s", "e2e_s", "itl_max_s", "first_decode_gap_s",
            "prefill_queue_s", "prefill_s", "kv_transfer_s", "kv_bytes"]
    if slo is not None:
        cols.append("meets_slo")
    return pd.DataFrame(rows, columns=cols)


# ---- latency breakdown --------------------------------------------------------------------
# Stage spans of one request from its timeline. These are not new metrics: prefill queue and
# prefill are engine.metrics'; the rest are timeline spans used only for this breakdown.


def _span(r: RequestRecord, start: str, end: str) -> float:
    if start in r.timeline and end in r.timeline:
        return r.timeline[end] - r.timeline[start]
    return math.nan


def _stages(r: RequestRecord, colocated: bool) -> dict[str, float]:
    if colocated:
        transfer = decode_queue = 0.0  # documented zeros: no transfer, no decode hand-off
    else:
        transfer = _span(r, m.KV_PUT, m.KV_GOT)
        if math.isnan(transfer) and r.kv_transfer_s is not None:
            transfer = float(r.kv_transfer_s)
        decode_queue = _span(r, m.KV_GOT, m.DECODE_ADMITTED)
    t = r.token_times_s
    decode = math.nan
    if t:
        # disagg: the first token comes from the prefill worker; the hand-off (transfer,
        # decode queue) is its own stage, so decoding starts at decode_admitted.
        start = t[0] if colocated else max(t[0], r.timeline.get(m.DECODE_ADMITTED, t[0]))
        decode = t[-1] - start
    return {
        "prefill_queue_s": _nan(m.prefill_queue_s(r)),
        "prefill_s": _nan(m.prefill_s(r)),
        "transfer_s": transfer,
        "decode_queue_s": decode_queue,
        "decode_s": decode,
    }


def latency_breakdown(records: Sequence[RequestRecord] | Mapping[str, Sequence[RequestRecord]]
                      ) -> pd.DataFrame:
    """Mean seconds per stage and placement, over completed (not failed) requests.

    Stages: prefill queue (``prefill_started - prefill_queued``, or ``- arrived``), prefill
    (``prefill_finished - prefill_started``), transfer (``kv_got - kv_put``, else
    ``record.kv_transfer_s``), decode queue (``decode_admitted - kv_got``), decode (last token
    - first token; under disaggregation last token - ``decode_admitted`` when stamped, since
    the first token comes from the prefill worker and the hand-off before decode_admitted is
    already in transfer and decode queue: the stages stack without double counting). For
    colocated placements transfer and decode queue are 0 by definition.
    A stage whose events are missing on a request is NaN for it; the mean skips NaNs and is
    NaN when no request has the stage. The stages need not sum to E2E (gaps between events,
    e.g. ``prefill_finished`` -> ``kv_put``, are not shown).

    ``records`` is a flat list (grouped by ``record.placement``, first-seen order) or a
    mapping placement -> records. Columns: placement, num_requests (completed), the stages.
    """
    if isinstance(records, Mapping):
        groups = {p: list(rs) for p, rs in records.items()}
    else:
        groups = {}
        for r in records:
            groups.setdefault(r.placement, []).append(r)
    rows = []
    for placement, rs in groups.items():
        done = [r for r in rs if not m.failed(r)]
        colocated = is_colocated(placement)
        stages = [_stages(r, colocated) for r in done]
        row = {"placement": placement, "num_requests": len(done)}
        for stage in BREAKDOWN_STAGES:
            v = np.array([s[stage] for s in stages], dtype=float)
            v = v[~np.isnan(v)]
            row[stage] = float(v.mean()) if v.size else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=["placement", "num_requests"] + BREAKDOWN_STAGES)


# ---- rate sweep ---------------------------------------------------------------------------


def attainment_curve(runs: Sequence[Run], slo: SLO) -> pd.DataFrame:
    """DistServe's SLO attainment per run: columns placement, rate, slo_attainment; sorted by
    placement (first-seen order) then rate."""
    rows = [{"placement": p, "rate": float(rate), "slo_attainment": m.slo_attainment(recs, slo)}
            for p, rate, recs in runs]
    df = pd.DataFrame(rows, columns=["placement", "rate", "slo_attainment"])
    order = {p: i for i, p in enumerate(dict.fromkeys(df["placement"]))}
    df = df.assign(_o=df["placement"].map(order)).sort_values(["_o", "rate"], kind="stable")
    return df.drop(columns="_o").reset_index(drop=True)


def goodput_per_device(curve: pd.DataFrame, num_devices: int | Mapping[str, int],
                       target: float = ATTAINMENT_TARGET) -> dict[str, float]:
    """placement -> DistServe goodput (req/s per device): the highest swept rate with
    attainment >= ``target`` over ``num_devices`` (``engine.metrics.goodput_rate``); 0.0 when
    no rate reaches it. ``num_devices`` is one count for all placements or per placement."""
    out = {}
    for placement, g in curve.groupby("placement", sort=False):
        n = num_devices[placement] if isinstance(num_devices, Mapping) else num_devices
        att = [a if not math.isnan(a) else -1.0 for a in g["slo_attainment"]]
        out[placement] = m.goodput_rate(list(g["rate"]), att, n, target)
    return out


# ---- verdict ------------------------------------------------------------------------------


def _fmt_s(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.4g} s"


def _fmt_pct(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{100 * v:.1f}%"


def _rank_key(row: pd.Series) -> tuple[float, float]:
    """Sort key, smaller is better: highest attainment, then lowest TPOT p99 (NaN last)."""
    att = row["slo_attainment"]
    tpot = row["tpot_p99_s"]
    return (-(att if not math.isnan(att) else -1.0), tpot if not math.isnan(tpot) else math.inf)


def _ranked(rows: pd.DataFrame) -> list[pd.Series]:
    return sorted((r for _, r in rows.iterrows()), key=_rank_key)


def verdict(summary_df: pd.DataFrame, slo: SLO, num_devices: int | None = None) -> str:
    """Which placement wins and why, computed from ``summary_df`` (``summary_table``).

    The rows compared are at the highest rate that every placement ran (else each
    placement's highest rate). The winner has the highest SLO attainment there; ties (within
    1e-9) go to the lower TPOT p99. Then: TPOT p99 colocated / disagg (interference
    removed), KV transfer p50 vs prefill p50 (the transfer paid), TTFT p99 of both; with
    several rates and ``num_devices``, goodput per device.
    """
    if summary_df.empty:
        return "No runs to compare."
    df = summary_df.copy()
    df["slo_attainment"] = df["slo_attainment"].astype(float)
    df["tpot_p99_s"] = df["tpot_p99_s"].astype(float)
    placements = list(dict.fromkeys(df["placement"]))
    common = set.intersection(*(set(df.loc[df["placement"] == p, "rate"]) for p in placements))
    if common:
        rate = max(common)
        at = df[df["rate"] == rate]
        where = f"at {rate:g} req/s"
    else:
        at = df.loc[df.groupby("placement", sort=False)["rate"].idxmax()]
        where = "at each placement's highest rate"
    at = at.drop_duplicates("placement", keep="last")
    ranked = _ranked(at)
    best = ranked[0]
    slo_txt = f"SLO TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s"
    lines = []
    if len(ranked) == 1:
        lines.append(f"Winner: {best['placement']} (the only placement) {where}: SLO attainment "
                     f"{_fmt_pct(best['slo_attainment'])} ({slo_txt}).")
    else:
        second = ranked[1]
        tie = abs(_rank_key(best)[0] - _rank_key(second)[0]) <= 1e-9
        others = ", ".join(f"{r['placement']} {_fmt_pct(r['slo_attainment'])}" for r in ranked[1:])
        why = (f"tied on SLO attainment ({_fmt_pct(best['slo_attainment'])}), lower TPOT p99 "
               f"{_fmt_s(best['tpot_p99_s'])} vs {_fmt_s(second['tpot_p99_s'])}" if tie else
               f"highest SLO attainment {_fmt_pct(best['slo_attainment'])} vs {others}")
        lines.append(f"Winner: {best['placement']} {where}: {why} ({slo_txt}).")
    if best["num_requests"] and best["num_failed"] == best["num_requests"]:
        lines.append(f"Every request of {best['placement']} failed there; no latency to compare.")

    colo = [r for r in ranked if is_colocated(r["placement"])]
    disagg = [r for r in ranked if placement_kind(r["placement"]) == "disagg"]
    if colo and disagg:
        c, d = colo[0], disagg[0]
        ratio = c["tpot_p99_s"] / d["tpot_p99_s"] if d["tpot_p99_s"] > 0 else math.nan
        ratio_txt = "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"
        effect = ("disaggregation removed prefill-decode interference" if ratio > 1 else
                  "disaggregation did not lower the decode tail here: its decode workers "
                  "carry every decode" if ratio <= 1 else "")
        lines.append(f"TPOT p99: {c['placement']} {_fmt_s(c['tpot_p99_s'])} vs "
                     f"{d['placement']} {_fmt_s(d['tpot_p99_s'])}, colocated/disagg = {ratio_txt}"
                     + (f" ({effect})." if effect else "."))
        kv, pf = d["kv_transfer_p50_s"], d["prefill_p50_s"]
        share = kv / pf if pf > 0 else math.nan
        share_txt = "n/a" if math.isnan(share) else f"{100 * share:.1f}% of prefill"
        lines.append(f"Transfer paid by {d['placement']}: KV transfer p50 {_fmt_s(kv)} vs prefill "
                     f"p50 {_fmt_s(pf)} ({share_txt}).")
        lines.append(f"TTFT p99: {c['placement']} {_fmt_s(c['ttft_p99_s'])} vs {d['placement']} "
                     f"{_fmt_s(d['ttft_p99_s'])}.")
    if num_devices is not None and df["rate"].nunique() > 1:
        gp = goodput_per_device(df[["placement", "rate", "slo_attainment"]], num_devices)
        lines.append("Goodput (highest swept rate with >= 90% attainment, per device, "
                     f"{num_devices} devices): "
                     + ", ".join(f"{p} {v:.4g} req/s" for p, v in gp.items()) + ".")
    return "\n".join(lines)
