"""Tables and verdicts from the records of a placement comparison (no torch): per run
(``seed_table``, from ``engine.metrics.summarize``: no metric defined twice), per
``(placement, rate)`` point over seeds (``summary_table``), goodput per device
(``goodput_table``), the stages of a request (``latency_breakdown``), KV transfers against the
link peak (``transfer_efficiency``), who wins (``verdict``), and per request (``requests_frame``).

The bootstrap is hierarchical and percentile: a replicate draws seeds with replacement and,
inside each, requests with replacement, recomputes each seed's metric (duration fixed) and
averages; the interval is the 2.5th-97.5th percentile of ``num_boot`` replicates (fixed
generator seed). Resampling requests keeps the interval honest with only 2 seeds.

All times are seconds; a value whose events are missing is NaN, never 0."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from engine import metrics as m
from engine.placement import Placement
from engine.metrics import SLO, RequestRecord

# Per-seed columns (seed_table), all from engine.metrics.summarize.
SEED_COLUMNS = [
    "placement", "rate", "seed", "num_requests", "num_failed", "ttft_p50_s", "ttft_p99_s",
    "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s",
    "throughput_req_s", "output_tok_s", "slo_attainment", "goodput_req_s",
    "tpot_router_p99_s", "itl_router_p99_s", "dispatch_lag_p99_s", "kv_put_p50_s",
    "kv_get_p50_s", "kv_transfer_p50_s", "kv_gb_s", "prefill_p50_s", "first_decode_gap_p50_s",
    "prefill_queue_p50_s", "ttft_mean_s", "tpot_mean_s", "duration_s", "kv_bytes_total",
    "prefix_hit_rate", "prefill_tokens_skipped", "kv_bytes_saved_total", "num_preemptions_total",
]
# Metrics reported as mean over seeds with a 95% bootstrap interval (<m>, <m>_ci_lo, <m>_ci_hi).
CI_METRICS = [
    "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s",
    "itl_p99_s", "throughput_req_s", "output_tok_s", "goodput_req_s",
]
# Seed means after the interval columns.
EXTRA_COLUMNS = [
    "e2e_p50_s", "e2e_p99_s", "tpot_router_p99_s", "itl_router_p99_s", "dispatch_lag_p99_s",
    "kv_put_p50_s", "kv_get_p50_s", "kv_transfer_p50_s", "kv_gb_s", "prefill_p50_s",
    "first_decode_gap_p50_s", "prefill_queue_p50_s", "duration_s", "kv_bytes_total",
    "prefix_hit_rate", "prefill_tokens_skipped", "kv_bytes_saved_total", "num_preemptions_total",
]
HIGHER_IS_BETTER = {"slo_attainment", "throughput_req_s", "output_tok_s", "goodput_req_s"}
SUMMARY_COLUMNS = (["placement", "rate", "num_seeds", "num_requests", "num_failed"]
                   + [c + sfx for c in CI_METRICS for sfx in ("", "_ci_lo", "_ci_hi")]
                   + EXTRA_COLUMNS)
BREAKDOWN_STAGES = ["prefill_queue_s", "prefill_s", "transfer_s", "decode_queue_s", "decode_s"]
ATTAINMENT_TARGET = m.ATTAINMENT_TARGET
CI_LEVEL = 0.95
NUM_BOOT = 1000


@dataclass(frozen=True)
class Run:
    """The records of one ``(placement, rate, seed)`` run; ``duration_s`` default: last
    finish - first arrival."""

    placement: str
    rate: float
    records: Sequence[RequestRecord]
    seed: int = 0
    duration_s: float | None = None


def as_run(run) -> Run:
    """A ``Run``; a run result with the same fields (``experiments.replay.RunResult``, whose
    step and transfer records are not needed here); or a tuple ``(placement, rate,
    records[, duration_s[, seed]])``."""
    if isinstance(run, Run):
        return run
    if hasattr(run, "records"):  # duck-typed: this module imports no replay machinery
        return Run(run.placement, float(run.rate), run.records, run.seed, run.duration_s)
    placement, rate, records, *rest = run
    duration_s = rest[0] if rest else None
    seed = rest[1] if len(rest) > 1 else 0
    return Run(placement, float(rate), records, seed, duration_s)


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def placement_kind(placement: str) -> str:
    """``"colocated:2"`` and ``"colocated-nochunk:2"`` -> ``"colocated"``, ``"disagg:1p1d"``
    -> ``"disagg"``; a ``pdlab bench`` label ``NAME@PLACEMENT`` by its placement."""
    return Placement.parse(placement.rsplit("@", 1)[-1]).kind


def is_colocated(placement: str) -> bool:
    return placement_kind(placement) == "colocated"


def summary_row(placement: str, rate: float, records: Sequence[RequestRecord], slo: SLO | None,
                duration_s: float | None = None, seed: int = 0) -> dict:
    """One ``seed_table`` row (``SEED_COLUMNS``) from ``engine.metrics.summarize``
    (latencies over completed requests; attainment over all; failures count as misses)."""
    s = m.summarize(records, slo, duration_s=duration_s)
    row: dict = {"placement": placement, "rate": float(rate), "seed": int(seed)}
    for col in SEED_COLUMNS[3:]:
        row[col] = s[col]
    for col in ("num_requests", "num_failed", "kv_bytes_total", "prefill_tokens_skipped",
                "kv_bytes_saved_total", "num_preemptions_total"):
        row[col] = int(row[col])
    return row


def seed_table(runs: Sequence[Run], slo: SLO | None) -> pd.DataFrame:
    """One row per run (``SEED_COLUMNS``), in the given order."""
    rows = [summary_row(r.placement, r.rate, r.records, slo, r.duration_s, r.seed)
            for r in map(as_run, runs)]
    return pd.DataFrame(rows, columns=SEED_COLUMNS)


@dataclass(frozen=True)
class _Arrays:
    """Per-request values of one run, for resampling. ``itl_s`` ``[n, max_gaps]`` NaN-padded."""

    done: np.ndarray
    meets: np.ndarray
    num_out: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    itl_s: np.ndarray
    duration_s: float


def _arrays(run: Run, slo: SLO | None) -> _Arrays:
    recs = list(run.records)
    done = np.array([not m.failed(r) for r in recs], dtype=bool)
    gaps = [m.itl_s(r) if ok else [] for r, ok in zip(recs, done)]
    width = max((len(g) for g in gaps), default=0)
    itl = np.full((len(recs), max(width, 1)), np.nan)
    for i, g in enumerate(gaps):
        itl[i, :len(g)] = g
    duration = run.duration_s if run.duration_s is not None else m._default_duration_s(recs)
    return _Arrays(
        done=done,
        meets=np.array([slo is not None and m.meets_slo(r, slo) for r in recs], dtype=bool),
        num_out=np.array([len(r.token_times_s) for r in recs], dtype=float),
        ttft_s=np.array([_nan(m.ttft_s(r)) if ok else math.nan for r, ok in zip(recs, done)]),
        tpot_s=np.array([_nan(m.tpot_s(r)) if ok else math.nan for r, ok in zip(recs, done)]),
        itl_s=itl, duration_s=float(duration) if duration and duration > 0 else math.nan)


def _row_percentile(values: np.ndarray, q: float) -> np.ndarray:
    """``np.nanpercentile(values, q, axis=1)`` (linear), vectorised: ``[B, n]`` -> ``[B]``."""
    v = np.sort(values, axis=1)  # NaNs sort last
    count = np.sum(~np.isnan(v), axis=1)
    pos = q / 100 * np.maximum(count - 1, 0)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, np.maximum(count - 1, 0))
    rows = np.arange(v.shape[0])
    with np.errstate(invalid="ignore"):
        out = v[rows, lo] + (pos - lo) * (v[rows, hi] - v[rows, lo])
    return np.where(count > 0, out, np.nan)


def _replicates(a: _Arrays, idx: np.ndarray, slo: SLO | None) -> dict[str, np.ndarray]:
    """Each CI metric for every row of ``idx`` ``[B, n]`` (resampled request indices): ``[B]``.
    The same definitions as ``engine.metrics.summarize`` (linear percentiles)."""
    pct = _row_percentile
    b = idx.shape[0]
    ttft, tpot = a.ttft_s[idx], a.tpot_s[idx]
    itl = a.itl_s[idx].reshape(b, -1)
    done = a.done[idx]
    out = {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
           "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
           "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
           "throughput_req_s": done.sum(axis=1) / a.duration_s,
           "output_tok_s": (a.num_out[idx] * done).sum(axis=1) / a.duration_s}
    if slo is None:
        out["slo_attainment"] = out["goodput_req_s"] = np.full(b, np.nan)
    else:
        out["slo_attainment"] = a.meets[idx].mean(axis=1)
        out["goodput_req_s"] = a.meets[idx].sum(axis=1) / a.duration_s
    return out


def _within_seed(runs: Sequence[Run], slo: SLO | None, num_boot: int,
                 rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Per run: each CI metric on ``num_boot`` request resamples, ``{metric: [B]}``."""
    out = []
    for run in runs:
        a = _arrays(run, slo)
        n = len(a.done)
        if n == 0:
            out.append({k: np.full(num_boot, np.nan) for k in CI_METRICS})
            continue
        out.append(_replicates(a, rng.integers(0, n, size=(num_boot, n)), slo))
    return out


def _interval(replicates: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile interval of ``replicates`` (NaN replicates skipped; NaN if none)."""
    r = replicates[~np.isnan(replicates)]
    if r.size == 0:
        return math.nan, math.nan
    lo, hi = np.percentile(r, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi)


def _seed_mean(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=float)
    return float(v.mean()) if v.size else math.nan


def summary_table(runs: Sequence[Run], slo: SLO | None, num_boot: int = NUM_BOOT,
                  rng_seed: int = 0) -> pd.DataFrame:
    """One row per ``(placement, rate)`` (first-seen placement order, rates ascending):
    ``SUMMARY_COLUMNS``. ``num_requests`` / ``num_failed`` are totals over seeds; each of
    ``CI_METRICS`` is the mean over seeds of the per-seed value (``seed_table``) with
    ``_ci_lo`` / ``_ci_hi`` from the hierarchical bootstrap in the module docstring;
    ``EXTRA_COLUMNS`` are seed means. Runs are ``Run``s, run results or tuples (``as_run``)."""
    runs = [as_run(r) for r in runs]
    rng = np.random.default_rng(rng_seed)
    per_seed = seed_table(runs, slo)
    boots = _within_seed(runs, slo, num_boot, rng)
    groups: dict[tuple[str, float], list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault((r.placement, r.rate), []).append(i)
    order = {p: i for i, p in enumerate(dict.fromkeys(r.placement for r in runs))}
    rows = []
    for (placement, rate), members in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        seeds = per_seed.iloc[members]
        row: dict = {"placement": placement, "rate": rate, "num_seeds": len(members),
                     "num_requests": int(seeds["num_requests"].sum()),
                     "num_failed": int(seeds["num_failed"].sum())}
        pick = rng.integers(0, len(members), size=(num_boot, len(members)))  # seeds drawn
        for col in CI_METRICS:
            row[col] = _seed_mean(seeds[col])
            per = np.stack([boots[i][col] for i in members], axis=1)  # [B, num_seeds]
            replicate = np.take_along_axis(per, pick, axis=1).mean(axis=1)
            row[col + "_ci_lo"], row[col + "_ci_hi"] = _interval(replicate)
        for col in EXTRA_COLUMNS:
            row[col] = _seed_mean(seeds[col])
        rows.append(row)
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def requests_frame(records: Sequence[RequestRecord], slo: SLO | None = None) -> pd.DataFrame:
    """One row per request: ids, token counts, and its metrics from ``engine.metrics``
    (NaN where undefined). ``arrived_s`` is the raw ``time.time()`` of arrival.
    ``tpot_s`` and ``itl_max_s`` use worker token times, ``tpot_router_s`` the router's.
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
            "tpot_router_s": _nan(m.tpot_router_s(r)),
            "e2e_s": _nan(m.e2e_s(r)),
            "dispatch_lag_s": _nan(m.dispatch_lag_s(r)),
            "itl_max_s": max(itl) if itl else math.nan,
            "first_decode_gap_s": _nan(m.first_decode_gap_s(r)),
            "prefill_queue_s": _nan(m.prefill_queue_s(r)),
            "prefill_s": _nan(m.prefill_s(r)),
            "kv_put_s": _nan(m.kv_put_s(r)),
            "kv_get_s": _nan(m.kv_get_s(r)),
            "kv_transfer_s": _nan(m.kv_transfer_s(r)),
            "kv_bytes": r.kv_bytes,
        }
        if slo is not None:
            row["meets_slo"] = m.meets_slo(r, slo)
        rows.append(row)
    cols = ["request_id", "placement", "failed", "num_prompt_tokens", "num_output_tokens",
            "arrived_s", "ttft_s", "tpot_s", "tpot_router_s", "e2e_s", "dispatch_lag_s",
            "itl_max_s", "first_decode_gap_s", "prefill_queue_s", "prefill_s", "kv_put_s",
            "kv_get_s", "kv_transfer_s", "kv_bytes"]
    if slo is not None:
        cols.append("meets_slo")
    return pd.DataFrame(rows, columns=cols)


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
        if math.isnan(transfer) and m.kv_transfer_s(r) is not None:
            transfer = float(m.kv_transfer_s(r))
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
    - first token, or under disaggregation - ``decode_admitted`` when stamped, so stages never
    count twice). Colocated placements have transfer and decode queue 0. A stage whose events
    are missing is NaN for that request; the mean skips NaNs. Stages need not sum to E2E.

    ``records``: a flat list (grouped by ``record.placement``, first-seen order) or a mapping
    placement -> records. Columns: placement, num_requests (completed), the stages."""
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


TRANSFER_EFFICIENCY_COLUMNS = ["placement", "transport", "num_transfers", "kv_bytes_total",
                               "achieved_gbps_p50", "peak_gbps", "efficiency_p50",
                               "exposed_share"]


def transfer_efficiency(transfers: pd.DataFrame) -> pd.DataFrame:
    """Per placement, its KV transfers against their link (``transfers.csv``'s rows, one
    ``TransferRecord`` per chunk; the simulator's rows carry only bytes and seconds, so their
    peak, efficiency and exposure are NaN). Columns ``TRANSFER_EFFICIENCY_COLUMNS``:
    ``achieved_gbps_p50`` (median of bytes / (put + get s) / 1e9), ``peak_gbps`` (measured at
    start; NaN if not), ``efficiency_p50`` (median achieved / peak), ``exposed_share`` (exposed
    s over put + get s, summed over chunks; 1.0 for whole-request transfers). A placement
    without transfers has no row."""
    if transfers.empty or "num_bytes" not in transfers.columns:
        return pd.DataFrame(columns=TRANSFER_EFFICIENCY_COLUMNS)
    rows = []
    for placement, t in transfers.groupby("placement", sort=False):
        def column(name: str) -> pd.Series:  # simulated transfers carry no peak or exposure
            return t[name].astype(float) if name in t else pd.Series(math.nan, index=t.index)

        seconds = t["put_s"].astype(float) + t["get_s"].astype(float)
        achieved = column("achieved_gbps").fillna(t["num_bytes"] / seconds / 1e9)
        exposed = column("exposed_s")
        known = exposed.notna()
        rows.append({
            "placement": placement, "transport": ",".join(dict.fromkeys(t["transport"])),
            "num_transfers": len(t), "kv_bytes_total": int(t["num_bytes"].sum()),
            "achieved_gbps_p50": float(achieved.median()),
            "peak_gbps": float(column("peak_gbps").median()),
            "efficiency_p50": float(column("efficiency").median()),
            "exposed_share": (float(exposed[known].sum() / seconds[known].sum())
                              if known.any() and seconds[known].sum() > 0 else math.nan)})
    return pd.DataFrame(rows, columns=TRANSFER_EFFICIENCY_COLUMNS)


def transfer_efficiency_text(table: pd.DataFrame) -> str:
    """One verdict line for ``transfer_efficiency``'s table ("" without rows)."""
    if table.empty:
        return ""
    parts = []
    for _, r in table.iterrows():
        peak = ("no link peak measured" if math.isnan(r["peak_gbps"]) else
                f"{100 * r['efficiency_p50']:.0f}% of a {r['peak_gbps']:.3g} GB/s link peak")
        exposed = ("" if math.isnan(r["exposed_share"]) else
                   f", {100 * r['exposed_share']:.0f}% of its time exposed")
        parts.append(f"{r['placement']} ({r['transport']}) {r['achieved_gbps_p50']:.3g} GB/s "
                     f"p50, {peak}{exposed}")
    return "KV transfer efficiency (median over chunks): " + "; ".join(parts) + "."


def attainment_curve(summary_df: pd.DataFrame) -> pd.DataFrame:
    """SLO attainment vs rate from ``summary_table``: placement, rate, slo_attainment (mean
    over seeds) and its interval; sorted by placement (first-seen order) then rate."""
    cols = ["placement", "rate", "slo_attainment", "slo_attainment_ci_lo", "slo_attainment_ci_hi"]
    df = summary_df[[c for c in cols if c in summary_df]].copy()
    order = {p: i for i, p in enumerate(dict.fromkeys(df["placement"]))}
    df = df.assign(_o=df["placement"].map(order)).sort_values(["_o", "rate"], kind="stable")
    return df.drop(columns="_o").reset_index(drop=True)


def goodput_per_device(curve: pd.DataFrame, num_devices: int | Mapping[str, int],
                       target: float = ATTAINMENT_TARGET) -> dict[str, float]:
    """placement -> DistServe goodput (req/s per device) read from one attainment curve
    (columns placement, rate, slo_attainment): the highest swept rate with attainment >=
    ``target`` at which every lower swept rate also met it (``engine.metrics.goodput_rate``),
    over ``num_devices`` (one count, or per placement); 0.0 when the lowest rate misses."""
    out = {}
    for placement, g in curve.groupby("placement", sort=False):
        n = num_devices[placement] if isinstance(num_devices, Mapping) else num_devices
        out[placement] = m.goodput_rate(list(g["rate"]), list(g["slo_attainment"]), n, target)
    return out


def _sweeps(runs: Sequence[Run], placement: str) -> tuple[list[float], list[int], dict]:
    """A placement's swept rates, the seeds that ran at all of them, ``{(rate, seed): index}``."""
    mine = [i for i, r in enumerate(runs) if r.placement == placement]
    rates = sorted({runs[i].rate for i in mine})
    at = {(runs[i].rate, runs[i].seed): i for i in mine}
    sweeps = [s for s in sorted({runs[i].seed for i in mine})
              if all((rate, s) in at for rate in rates)]
    return rates, sweeps, at


def _devices(num_devices: int | Mapping[str, int], placement: str) -> int:
    return num_devices[placement] if isinstance(num_devices, Mapping) else num_devices


def goodput_points(runs: Sequence[Run], slo: SLO, num_devices: int | Mapping[str, int],
                   target: float = ATTAINMENT_TARGET) -> dict[str, float]:
    """placement -> ``goodput_table``'s point estimate without its bootstrap: the mean over
    seeds of each sweep's DistServe goodput per device (req/s; NaN where no seed ran every
    rate). What a report quotes as "measured goodput" beside goodput.csv."""
    runs = [as_run(r) for r in runs]
    out = {}
    for placement in dict.fromkeys(r.placement for r in runs):
        rates, sweeps, at = _sweeps(runs, placement)
        out[placement] = _seed_mean([m.goodput_rate(
            rates, [m.slo_attainment(runs[at[(rate, s)]].records, slo) for rate in rates],
            _devices(num_devices, placement), target) for s in sweeps])
    return out


def goodput_table(runs: Sequence[Run], slo: SLO, num_devices: int | Mapping[str, int],
                  target: float = ATTAINMENT_TARGET, num_boot: int = NUM_BOOT,
                  rng_seed: int = 1) -> pd.DataFrame:
    """DistServe goodput per device for each placement (``engine.metrics.goodput_rate``), with a 95%
    bootstrap interval. A seed is one sweep; ``goodput_per_device_req_s`` is the mean over seeds of
    each sweep's goodput (``goodput_points``), the interval the module's hierarchical bootstrap.
    Columns: placement, num_devices, num_seeds, goodput_per_device_req_s, _ci_lo, _ci_hi."""
    runs = [as_run(r) for r in runs]
    rng = np.random.default_rng(rng_seed)
    boots = _within_seed(runs, slo, num_boot, rng)
    points = goodput_points(runs, slo, num_devices, target)
    rows = []
    for placement, point in points.items():
        n_dev = _devices(num_devices, placement)
        rates, sweeps, at = _sweeps(runs, placement)
        lo = hi = math.nan
        if sweeps:
            pick = rng.integers(0, len(sweeps), size=(num_boot, len(sweeps)))
            reps = np.array([np.mean([m.goodput_rate(
                rates, [boots[at[(rate, sweeps[k])]]["slo_attainment"][b] for rate in rates],
                n_dev, target) for k in pick[b]]) for b in range(num_boot)])
            lo, hi = _interval(reps)
        rows.append({"placement": placement, "num_devices": n_dev, "num_seeds": len(sweeps),
                     "goodput_per_device_req_s": point,
                     "goodput_per_device_req_s_ci_lo": lo, "goodput_per_device_req_s_ci_hi": hi})
    return pd.DataFrame(rows, columns=["placement", "num_devices", "num_seeds",
                                       "goodput_per_device_req_s",
                                       "goodput_per_device_req_s_ci_lo",
                                       "goodput_per_device_req_s_ci_hi"])


def _fmt(col: str, v: float) -> str:
    if v is None or math.isnan(v):
        return "n/a"
    if col == "slo_attainment":
        return f"{100 * v:.1f}%"
    for suffix, unit in (("_req_s", " req/s"), ("_tok_s", " tok/s"), ("_s", " s")):
        if col.endswith(suffix):
            return f"{v:.4g}{unit}"
    return f"{v:.4g}"


def _with_ci(row: pd.Series, col: str) -> str:
    return (f"{_fmt(col, row[col])} [{_fmt(col, row[col + '_ci_lo'])}, "
            f"{_fmt(col, row[col + '_ci_hi'])}]")


def overlap_fraction(a: pd.Series, b: pd.Series, col: str) -> float:
    """How much the intervals of ``col`` in rows ``a`` and ``b`` overlap: the overlap's
    length over the length of their union (1 = identical, 0 = touching, < 0 = separated by
    that fraction of the union). Two identical points count as 1; NaN if an interval is."""
    lo_a, hi_a, lo_b, hi_b = (float(x) for x in (a[col + "_ci_lo"], a[col + "_ci_hi"],
                                                  b[col + "_ci_lo"], b[col + "_ci_hi"]))
    if any(math.isnan(x) for x in (lo_a, hi_a, lo_b, hi_b)):
        return math.nan
    union = max(hi_a, hi_b) - min(lo_a, lo_b)
    overlap = min(hi_a, hi_b) - max(lo_a, lo_b)
    if union <= 0:
        return 1.0
    return overlap / union


def separates(a: pd.Series, b: pd.Series, col: str) -> bool:
    """The intervals of ``col`` do not touch (``a``'s lies entirely above or below ``b``'s)."""
    frac = overlap_fraction(a, b, col)
    return not math.isnan(frac) and frac < 0


def _better(a: pd.Series, b: pd.Series, col: str) -> pd.Series:
    higher = float(a[col]) > float(b[col])
    return a if higher == (col in HIGHER_IS_BETTER) else b


def _rate_verdict(at: pd.DataFrame, rate: float) -> list[str]:
    """The lines for one rate: a winner only where the attainment intervals separate."""
    ranked = sorted((r for _, r in at.iterrows()),
                    key=lambda r: -(r["slo_attainment"] if not math.isnan(r["slo_attainment"]) else -1))
    best, others = ranked[0], ranked[1:]
    if not others:
        return [f"At {rate:g} req/s: {best['placement']} (the only placement): SLO attainment "
                f"{_with_ci(best, 'slo_attainment')}."]
    att = "; ".join(f"{r['placement']} {_with_ci(r, 'slo_attainment')}" for r in ranked)
    if all(separates(best, o, "slo_attainment") for o in others):
        return [f"At {rate:g} req/s: winner {best['placement']}: SLO attainment {att} "
                f"(95% intervals separate)."]
    lines = [f"At {rate:g} req/s: no clear winner at this rate: SLO attainment {att} "
             "(95% intervals overlap)."]
    apart = []
    for other in others:
        for c in CI_METRICS[1:]:
            if separates(best, other, c):
                win = _better(best, other, c)
                lose = other if win is best else best
                apart.append(f"{c} ({win['placement']} better than {lose['placement']})")
    if apart:
        lines.append("  Intervals that do separate (not the SLO metric, so no winner): "
                     + "; ".join(apart) + ".")
        return lines
    second = others[0]
    scores = {c: overlap_fraction(best, second, c) for c in CI_METRICS}
    scores = {c: v for c, v in scores.items() if not math.isnan(v)}
    if scores:
        c = min(scores, key=scores.get)
        share = 100 * scores[c]
        how = ("the intervals touch: they share an end" if share == 0 else
               "intervals overlap over under 1% of their joint span" if share < 0.5 else
               f"intervals overlap over {share:.0f}% of their joint span")
        lines.append(f"  Closest to separating: {c}, {best['placement']} {_with_ci(best, c)} vs "
                     f"{second['placement']} {_with_ci(second, c)} ({how}).")
    return lines


def verdict(summary_df: pd.DataFrame, slo: SLO, goodput: pd.DataFrame | None = None,
            systems: Mapping[str, str] | None = None) -> str:
    """Which placement wins, and why, from ``summary_table`` (intervals included).

    Per rate every placement ran: a placement wins only if its SLO-attainment interval lies
    entirely above every other's; otherwise "no clear winner at this rate", naming the metric of
    ``CI_METRICS`` closest to separating (smallest ``overlap_fraction``), or those that do. Then,
    at the highest common rate: TPOT p99 colocated / disagg, the KV transfer's cost (put + get
    p50) against prefill p50 (left out when the runs have no transfer figures, as a bench's),
    TTFT p99 of both; the worst dispatch-lag p99; and, given ``goodput`` (``goodput_table``),
    goodput per device with intervals.

    ``systems``: placement -> the engine or server that produced its records
    (``results.serving_systems``); placements it lacks fall back to the NAME of a
    ``NAME@PLACEMENT`` label ("" for a plain placement). The colocated/disagg pair is taken from
    one system where there is one; a pair from two systems is compared without any claim about
    prefill-decode interference (two engines differ in more than placement)."""
    if summary_df.empty:
        return "No runs to compare."
    df = summary_df.copy()
    placements = list(dict.fromkeys(df["placement"]))
    common = sorted(set.intersection(*(set(df.loc[df["placement"] == p, "rate"]) for p in placements)))
    slo_txt = f"SLO TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s; 95% bootstrap intervals"
    lines = [f"Verdict ({slo_txt}):"]
    if not common:
        lines.append("The placements share no rate: nothing to compare side by side.")
        top = df.loc[df.groupby("placement", sort=False)["rate"].idxmax()]
    else:
        for rate in common:
            lines += _rate_verdict(df[df["rate"] == rate].drop_duplicates("placement", keep="last"), rate)
        top = df[df["rate"] == common[-1]].drop_duplicates("placement", keep="last")
    for _, row in top.iterrows():
        if row["num_requests"] and row["num_failed"] == row["num_requests"]:
            lines.append(f"Every request of {row['placement']} failed at {row['rate']:g} req/s; "
                         "no latency to compare.")
    rows = list(r for _, r in top.iterrows())
    colo = [r for r in rows if is_colocated(r["placement"])]
    disagg = [r for r in rows if placement_kind(r["placement"]) == "disagg"]
    if colo and disagg:
        def system(row) -> str:
            placement = row["placement"]
            if systems is not None and placement in systems:
                return systems[placement]
            return placement.rsplit("@", 1)[0] if "@" in placement else ""
        pairs = [(c, d) for d in disagg for c in colo if system(c) == system(d)]
        c, d = pairs[0] if pairs else (colo[0], disagg[0])
        ratio = c["tpot_p99_s"] / d["tpot_p99_s"] if d["tpot_p99_s"] > 0 else math.nan
        ratio_txt = "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"
        separated = overlap_fraction(c, d, "tpot_p99_s") < 0  # NaN (one seed): not separated
        if not pairs:
            effect = (f"different systems, {system(c) or 'unnamed'} vs {system(d) or 'unnamed'}: "
                      "not a measure of prefill-decode interference")
        elif ratio > 1 and separated:
            effect = "disaggregation removed prefill-decode interference"
        elif ratio > 1:
            effect = ("lower with disaggregation, but the 95% intervals overlap: not shown "
                      "to remove interference at this rate")
        elif ratio <= 1:
            effect = ("disaggregation did not lower the decode tail here: its decode workers "
                      "carry every decode")
        else:
            effect = ""
        lines.append(f"At {top['rate'].max():g} req/s, TPOT p99: {c['placement']} "
                     f"{_with_ci(c, 'tpot_p99_s')} vs {d['placement']} {_with_ci(d, 'tpot_p99_s')}, "
                     f"colocated/disagg = {ratio_txt}" + (f" ({effect})." if effect else "."))
        kv, pf = float(d["kv_transfer_p50_s"]), float(d["prefill_p50_s"])
        if not math.isnan(kv):  # a client (bench) sees no transfer: no line
            share = kv / pf if pf > 0 else math.nan
            share_txt = "n/a" if math.isnan(share) else f"{100 * share:.1f}% of prefill"
            lines.append(f"Transfer paid by {d['placement']}: KV transfer (put + get) p50 "
                         f"{_fmt_s(kv)} (put {_fmt_s(d['kv_put_p50_s'])}, get "
                         f"{_fmt_s(d['kv_get_p50_s'])}) vs prefill p50 {_fmt_s(pf)} ({share_txt}).")
        lines.append(f"TTFT p99: {c['placement']} {_with_ci(c, 'ttft_p99_s')} vs {d['placement']} "
                     f"{_with_ci(d, 'ttft_p99_s')}.")
    lag = df["dispatch_lag_p99_s"].astype(float)
    if lag.notna().any():
        worst = df.loc[lag.idxmax()]
        lines.append(f"Load generator: dispatch lag p99 at most {_fmt_s(worst['dispatch_lag_p99_s'])} "
                     f"({worst['placement']} @ {worst['rate']:g} req/s); TTFT counts from the "
                     "scheduled arrival.")
    if goodput is not None and len(common) > 1:
        lines.append("Goodput per device (DistServe: highest swept rate with >= "
                     f"{100 * ATTAINMENT_TARGET:.0f}% attainment at it and every lower rate): "
                     + ", ".join(f"{g['placement']} {g['goodput_per_device_req_s']:.4g} "
                                 f"[{g['goodput_per_device_req_s_ci_lo']:.4g}, "
                                 f"{g['goodput_per_device_req_s_ci_hi']:.4g}] req/s"
                                 for _, g in goodput.iterrows()) + ".")
    return "\n".join(lines)


def _fmt_s(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.4g} s"
