"""experiments.analysis against values computed by hand on synthetic records.

Two placements on the same three-request workload (times relative to T0):
- colocated:2: request c1's decode stalls 0.6 s (a prefill ran in its batch): TPOT 0.225 s.
- disagg:1p1d: every request decodes at 0.1 s/token; KV ships in 0.05 s (kv_put -> kv_got).
SLO: TTFT <= 0.5 s, TPOT <= 0.15 s, so colocated attains 2/3 and disagg 3/3.
"""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from engine.metrics import SLO, RequestRecord
from experiments import analysis as a
from experiments import workload_map

T0 = 1000.0
SLO_ = SLO(ttft_s=0.5, tpot_s=0.15)
COLO, DIS = "colocated:2", "disagg:1p1d"


def rec(rid, placement, arrived, tokens, error=None, kv_transfer_s=None, kv_bytes=0, **events):
    tl = {"arrived": T0 + arrived, "prefill_queued": T0 + arrived}
    tl.update({k: T0 + v for k, v in events.items()})
    if tokens:
        tl["finished"] = T0 + tokens[-1]
    return RequestRecord(request_id=rid, placement=placement, num_prompt_tokens=8,
                         output_token_ids=list(range(len(tokens))), error=error,
                         kv_bytes=kv_bytes, kv_transfer_s=kv_transfer_s, timeline=tl,
                         token_times_s=[T0 + t for t in tokens])


def colocated_records(stall=True):
    c1_tokens = [0.4, 0.5, 1.1, 1.2, 1.3] if stall else [0.4, 0.5, 0.6, 0.7, 0.8]
    return [
        rec("c0", COLO, 0.0, [0.2, 0.3, 0.4, 0.5, 0.6], prefill_started=0.0, prefill_finished=0.2),
        rec("c1", COLO, 0.1, c1_tokens, prefill_started=0.2, prefill_finished=0.4),
        rec("c2", COLO, 0.5, [0.7, 0.8, 0.9, 1.0, 1.1], prefill_started=0.6, prefill_finished=0.7),
    ]


def disagg_records():
    kv = dict(kv_transfer_s=0.05, kv_bytes=1000)
    return [
        rec("d0", DIS, 0.0, [0.2, 0.3, 0.4, 0.5, 0.6], prefill_started=0.0, prefill_finished=0.2,
            kv_put=0.2, kv_got=0.25, decode_admitted=0.26, **kv),
        rec("d1", DIS, 0.1, [0.4, 0.5, 0.6, 0.7, 0.8], prefill_started=0.2, prefill_finished=0.4,
            kv_put=0.4, kv_got=0.45, decode_admitted=0.47, **kv),
        rec("d2", DIS, 0.5, [0.6, 0.7, 0.8, 0.9, 1.0], prefill_started=0.5, prefill_finished=0.6,
            kv_put=0.6, kv_got=0.65, decode_admitted=0.65, **kv),
    ]


def runs():
    """rate 1: both meet the SLO fully; rate 2: colocated has the stall."""
    return [(COLO, 1.0, colocated_records(stall=False)), (COLO, 2.0, colocated_records()),
            (DIS, 1.0, disagg_records()), (DIS, 2.0, disagg_records())]


def failed_records():
    return [rec(f"f{i}", COLO, 0.1 * i, [], error="boom") for i in range(3)]


def row_of(df, placement, rate):
    sel = df[(df["placement"] == placement) & (df["rate"] == rate)]
    assert len(sel) == 1
    return sel.iloc[0]


def test_summary_columns_first_in_order():
    df = a.summary_table(runs(), SLO_)
    assert list(df.columns[:len(a.SUMMARY_COLUMNS)]) == a.SUMMARY_COLUMNS
    assert a.SUMMARY_COLUMNS[:3] == ["placement", "rate", "num_seeds"]
    for col in a.CI_METRICS:  # every interval metric has its two bounds beside it
        i = a.SUMMARY_COLUMNS.index(col)
        assert a.SUMMARY_COLUMNS[i + 1:i + 3] == [col + "_ci_lo", col + "_ci_hi"]
    assert len(df) == 4 and (df["num_seeds"] == 1).all()
    assert list(df["placement"]) == [COLO, COLO, DIS, DIS]
    # an explicit run duration (4th element) sets the rates
    d = a.summary_table([(COLO, 2.0, colocated_records(), 3.0)], SLO_).iloc[0]
    assert d["duration_s"] == 3.0 and d["throughput_req_s"] == pytest.approx(1.0)


def test_summary_values_by_hand_colocated():
    r = a.summary_row(COLO, 2.0, colocated_records(), SLO_)
    assert r["num_requests"] == 3 and r["num_failed"] == 0
    # TTFT 0.2, 0.3, 0.2 -> median 0.2; p99 (linear) = 0.2 + 0.98 * (0.3 - 0.2)
    assert r["ttft_p50_s"] == pytest.approx(0.2)
    assert r["ttft_p99_s"] == pytest.approx(0.298)
    # TPOT 0.1, (1.3 - 0.4) / 4 = 0.225, 0.1 -> p50 0.1, p99 = 0.1 + 0.98 * 0.125
    assert r["tpot_p50_s"] == pytest.approx(0.1)
    assert r["tpot_p99_s"] == pytest.approx(0.2225)
    # ITL: eleven gaps of 0.1 and one of 0.6: p99 at rank 0.99 * 11 = 10.89
    assert r["itl_p99_s"] == pytest.approx(0.1 + 0.89 * 0.5)
    # E2E 0.6, 1.2, 0.6
    assert r["e2e_p50_s"] == pytest.approx(0.6)
    # run lasts from the first arrival (0.0) to the last finish (1.3)
    assert r["throughput_req_s"] == pytest.approx(3 / 1.3)
    assert r["output_tok_s"] == pytest.approx(15 / 1.3)
    assert r["slo_attainment"] == pytest.approx(2 / 3)
    assert r["goodput_req_s"] == pytest.approx(2 / 1.3)
    assert math.isnan(r["kv_transfer_p50_s"])  # colocated: no transfer, not 0
    assert r["prefill_p50_s"] == pytest.approx(0.2)  # prefill 0.2, 0.2, 0.1


def test_summary_values_by_hand_disagg():
    r = a.summary_row(DIS, 2.0, disagg_records(), SLO_)
    assert r["ttft_p50_s"] == pytest.approx(0.2)  # 0.2, 0.3, 0.1
    assert r["tpot_p99_s"] == pytest.approx(0.1)
    assert r["slo_attainment"] == 1.0
    assert r["kv_transfer_p50_s"] == pytest.approx(0.05)
    assert r["prefill_p50_s"] == pytest.approx(0.2)  # 0.2, 0.2, 0.1
    assert r["kv_bytes_total"] == 3000
    assert r["first_decode_gap_p50_s"] == pytest.approx(0.1)


def test_latency_breakdown_by_hand():
    df = a.latency_breakdown(colocated_records() + disagg_records())
    assert list(df.columns) == ["placement", "num_requests"] + a.BREAKDOWN_STAGES
    c = df[df["placement"] == COLO].iloc[0]
    d = df[df["placement"] == DIS].iloc[0]
    assert c["prefill_queue_s"] == pytest.approx((0.0 + 0.1 + 0.1) / 3)
    assert c["prefill_s"] == pytest.approx((0.2 + 0.2 + 0.1) / 3)
    assert c["transfer_s"] == 0.0 and c["decode_queue_s"] == 0.0  # documented colocated zeros
    assert c["decode_s"] == pytest.approx((0.4 + 0.9 + 0.4) / 3)
    assert d["prefill_queue_s"] == pytest.approx((0.0 + 0.1 + 0.0) / 3)
    assert d["transfer_s"] == pytest.approx(0.05)
    assert d["decode_queue_s"] == pytest.approx((0.01 + 0.02 + 0.0) / 3)
    # disagg decode starts at decode_admitted: 0.6-0.26, 0.8-0.47, 1.0-0.65
    assert d["decode_s"] == pytest.approx((0.34 + 0.33 + 0.35) / 3)
    # a mapping gives the same answer
    df2 = a.latency_breakdown({COLO: colocated_records(), DIS: disagg_records()})
    assert df2["decode_s"].tolist() == pytest.approx(df["decode_s"].tolist())


def test_latency_breakdown_missing_events_are_nan_not_zero():
    r = rec("x", DIS, 0.0, [0.3, 0.4], prefill_finished=0.2)  # no start, no kv events
    df = a.latency_breakdown([r])
    row = df.iloc[0]
    assert math.isnan(row["prefill_queue_s"]) and math.isnan(row["prefill_s"])
    assert math.isnan(row["transfer_s"]) and math.isnan(row["decode_queue_s"])
    assert row["decode_s"] == pytest.approx(0.1)
    # the transport's kv_transfer_s fills in when kv_put/kv_got are missing
    r.kv_transfer_s = 0.07
    assert a.latency_breakdown([r]).iloc[0]["transfer_s"] == pytest.approx(0.07)
    # NaN stages are skipped in the mean, not counted as 0
    r2 = rec("y", DIS, 0.0, [0.3, 0.4], prefill_started=0.0, prefill_finished=0.2)
    assert a.latency_breakdown([r, r2]).iloc[0]["prefill_s"] == pytest.approx(0.2)


def test_attainment_curve_and_goodput_per_device():
    curve = a.attainment_curve(a.summary_table(runs(), SLO_))
    assert list(curve.columns) == ["placement", "rate", "slo_attainment", "slo_attainment_ci_lo",
                                   "slo_attainment_ci_hi"]
    assert curve["slo_attainment"].tolist() == pytest.approx([1.0, 2 / 3, 1.0, 1.0])
    gp = a.goodput_per_device(curve, num_devices=2)
    assert gp == {COLO: pytest.approx(0.5), DIS: pytest.approx(1.0)}
    # no rate reaches 90% -> 0
    low = curve.assign(slo_attainment=0.5)
    assert a.goodput_per_device(low, 2) == {COLO: 0.0, DIS: 0.0}


def seeded_runs():
    """Two seeds per point. colocated at rate 2: seed 0 stalls (2/3 attain), seed 1 does not
    (3/3); disagg meets the SLO everywhere."""
    return [a.Run(COLO, 1.0, colocated_records(stall=False), 0),
            a.Run(COLO, 1.0, colocated_records(stall=False), 1),
            a.Run(COLO, 2.0, colocated_records(), 0),
            a.Run(COLO, 2.0, colocated_records(stall=False), 1),
            a.Run(DIS, 1.0, disagg_records(), 0), a.Run(DIS, 1.0, disagg_records(), 1),
            a.Run(DIS, 2.0, disagg_records(), 0), a.Run(DIS, 2.0, disagg_records(), 1)]


def test_summary_means_over_seeds_with_bootstrap_intervals():
    df = a.summary_table(seeded_runs(), SLO_)
    assert len(df) == 4 and (df["num_seeds"] == 2).all() and (df["num_requests"] == 6).all()
    c2 = row_of(df, COLO, 2.0)
    # mean over seeds of the per-seed values: attainment (2/3 + 1) / 2, TPOT p99 (0.2225 + 0.1) / 2
    assert c2["slo_attainment"] == pytest.approx(5 / 6)
    assert c2["tpot_p99_s"] == pytest.approx((0.2225 + 0.1) / 2)
    # resampling can only give attainments in [0, 1] and must straddle the two seeds' spread
    assert 0.0 <= c2["slo_attainment_ci_lo"] < 5 / 6 < c2["slo_attainment_ci_hi"] <= 1.0
    # a replicate of only the stalled request has TPOT p99 0.225, the largest TPOT there is
    assert c2["tpot_p99_s_ci_lo"] < c2["tpot_p99_s"] < c2["tpot_p99_s_ci_hi"] <= 0.225 + 1e-12
    # identical requests in every seed: every replicate is the same value -> a zero-width interval
    d2 = row_of(df, DIS, 2.0)
    assert d2["slo_attainment_ci_lo"] == d2["slo_attainment_ci_hi"] == 1.0
    assert d2["tpot_p99_s_ci_lo"] == pytest.approx(0.1) and d2["tpot_p99_s_ci_hi"] == pytest.approx(0.1)
    # deterministic: the same records give the same intervals
    again = a.summary_table(seeded_runs(), SLO_)
    assert again["slo_attainment_ci_lo"].tolist() == df["slo_attainment_ci_lo"].tolist()
    per_seed = a.seed_table(seeded_runs(), SLO_)
    assert list(per_seed.columns) == a.SEED_COLUMNS and len(per_seed) == 8
    assert per_seed["slo_attainment"].tolist()[:4] == pytest.approx([1, 1, 2 / 3, 1])


def test_goodput_table_distserve_definition_on_a_non_monotone_curve():
    # one seed; colocated attains 100% at 1 and 3 req/s but 2/3 at 2 req/s
    runs_ = [a.Run(COLO, 1.0, colocated_records(stall=False)), a.Run(COLO, 2.0, colocated_records()),
             a.Run(COLO, 3.0, colocated_records(stall=False)),
             a.Run(DIS, 1.0, disagg_records()), a.Run(DIS, 2.0, disagg_records()),
             a.Run(DIS, 3.0, disagg_records())]
    gp = a.goodput_table(runs_, SLO_, {COLO: 2, DIS: 2}, num_boot=200)
    c, d = gp.iloc[0], gp.iloc[1]
    assert c["goodput_per_device_req_s"] == pytest.approx(0.5)  # 1 req/s / 2 devices, not 3/2
    assert d["goodput_per_device_req_s"] == pytest.approx(1.5)
    assert d["goodput_per_device_req_s_ci_lo"] == d["goodput_per_device_req_s_ci_hi"] == 1.5
    # a resample of the 2 req/s run without the stalled request (p = (2/3)^3) attains 100%:
    # replicates are 0.5 or 1.5, so the interval spans both
    assert c["goodput_per_device_req_s_ci_lo"] == 0.5 and c["goodput_per_device_req_s_ci_hi"] == 1.5


def test_goodput_points_is_the_seed_mean_every_report_line_quotes():
    """Seed 0 meets the SLO at 1 and 2 req/s (1.0 req/s per device), seed 1 only at 1 (the
    stall at 2: 0.5): goodput.csv's point is their mean, 0.75, and the map's "this run
    measured" line quotes the same figure. The mean attainment curve (2 req/s: (1 + 2/3) / 2
    < 90%) would say 0.5: that was the map line's rule, which disagreed with the verdict."""
    runs_ = [a.Run(COLO, 1.0, colocated_records(stall=False), 0),
             a.Run(COLO, 2.0, colocated_records(stall=False), 0),
             a.Run(COLO, 1.0, colocated_records(stall=False), 1),
             a.Run(COLO, 2.0, colocated_records(), 1)]
    assert a.goodput_points(runs_, SLO_, 2) == {COLO: pytest.approx(0.75)}
    table = a.goodput_table(runs_, SLO_, 2, num_boot=50)
    assert table["goodput_per_device_req_s"].tolist() == [pytest.approx(0.75)]
    curve = a.attainment_curve(a.summary_table(runs_, SLO_, num_boot=50))
    assert a.goodput_per_device(curve, 2) == {COLO: 0.5}
    results = [SimpleNamespace(placement=r.placement, rate=r.rate, records=r.records,
                               seed=r.seed, duration_s=r.duration_s) for r in runs_]
    assert workload_map.measured_goodput(results, SLO_) == {COLO: pytest.approx(0.75)}


def test_row_percentile_equals_numpy():
    rng = np.random.default_rng(3)
    v = rng.random((50, 7))
    v[rng.random((50, 7)) < 0.3] = np.nan
    v[0] = np.nan
    for q in (0, 50, 90, 99, 100):
        with np.errstate(all="ignore"), pytest.warns(RuntimeWarning):
            expected = np.nanpercentile(v, q, axis=1)
        assert np.allclose(a._row_percentile(v, q), expected, equal_nan=True)


def summary_rows(att_a, att_b, tpot_a, tpot_b, rate=1.0):
    """A two-row summary with given (mean, lo, hi) for attainment and TPOT p99; every other
    interval metric identical in both rows."""
    rows = []
    for placement, att, tpot in ((COLO, att_a, tpot_a), (DIS, att_b, tpot_b)):
        row = {c: 0.0 for c in a.SUMMARY_COLUMNS}
        row.update(placement=placement, rate=rate, num_seeds=2, num_requests=10, num_failed=0)
        for col in a.CI_METRICS:
            row[col], row[col + "_ci_lo"], row[col + "_ci_hi"] = 0.5, 0.4, 0.6
        for col, (mean, lo, hi) in (("slo_attainment", att), ("tpot_p99_s", tpot)):
            row[col], row[col + "_ci_lo"], row[col + "_ci_hi"] = mean, lo, hi
        rows.append(row)
    return pd.DataFrame(rows, columns=a.SUMMARY_COLUMNS)


def test_verdict_names_a_winner_only_where_intervals_separate():
    df = summary_rows((0.6, 0.5, 0.7), (0.95, 0.9, 1.0), (0.2, 0.15, 0.25), (0.1, 0.08, 0.12))
    first = a.verdict(df, SLO_).splitlines()[1]
    assert first.startswith(f"At 1 req/s: winner {DIS}: SLO attainment {DIS} 95.0% [90.0%, 100.0%]")
    # overlapping attainment intervals: no winner, the closest metric is named
    # attainment [0.5, 0.8] vs [0.7, 1.0]: overlap 0.1 of span 0.5 = 20%;
    # TPOT p99 [0.15, 0.25] vs [0.08, 0.16]: overlap 0.01 of 0.17 = 5.9% -> closest
    df = summary_rows((0.65, 0.5, 0.8), (0.85, 0.7, 1.0), (0.2, 0.15, 0.25), (0.12, 0.08, 0.16))
    text = a.verdict(df, SLO_)
    assert "At 1 req/s: no clear winner at this rate" in text
    assert f"Closest to separating: tpot_p99_s, {DIS} 0.12 s [0.08 s, 0.16 s] vs {COLO}" in text
    assert "(intervals overlap over 6% of their joint span)" in text
    assert "winner " + DIS not in text
    # intervals that only share an end point: said so, not "overlap over 0%"
    df = summary_rows((0.65, 0.5, 0.8), (0.85, 0.7, 1.0), (0.2, 0.15, 0.25), (0.12, 0.08, 0.15))
    assert "vs " + COLO + " 0.2 s [0.15 s, 0.25 s] (the intervals touch: they share an end)." \
        in a.verdict(df, SLO_)
    df = summary_rows((0.65, 0.5, 0.8), (0.85, 0.7, 1.0), (0.2, 0.15, 0.25), (0.12, 0.08, 0.1505))
    assert "(intervals overlap over under 1% of their joint span)" in a.verdict(df, SLO_)
    # a latency interval that separates is reported, but does not make a winner
    df = summary_rows((0.9, 0.8, 1.0), (0.9, 0.8, 1.0), (0.2, 0.15, 0.25), (0.1, 0.08, 0.12))
    text = a.verdict(df, SLO_)
    assert "no clear winner at this rate" in text
    assert "Intervals that do separate (not the SLO metric, so no winner): tpot_p99_s" in text
    assert a.overlap_fraction(df.iloc[0], df.iloc[1], "tpot_p99_s") == pytest.approx(-0.03 / 0.17)
    assert a.overlap_fraction(df.iloc[0], df.iloc[1], "slo_attainment") == 1.0


def test_interference_is_called_removed_only_where_the_tpot_intervals_separate():
    separate = summary_rows((0.9, 0.8, 1.0), (0.9, 0.8, 1.0), (0.2, 0.15, 0.25), (0.1, 0.08, 0.12))
    assert "2.00x (disaggregation removed prefill-decode interference)" in a.verdict(separate, SLO_)
    overlap = summary_rows((0.9, 0.8, 1.0), (0.9, 0.8, 1.0), (0.36, 0.24, 0.38), (0.34, 0.16, 0.51))
    text = a.verdict(overlap, SLO_)
    assert "removed" not in text
    assert "1.06x (lower with disaggregation, but the 95% intervals overlap" in text


def test_no_interference_claim_between_two_systems_and_no_empty_transfer_line():
    """A bench merge: vLLM colocated against pdlab disaggregated, TPOT intervals apart; a client
    sees no KV transfer (NaN)."""
    df = summary_rows((0.9, 0.8, 1.0), (0.9, 0.8, 1.0), (0.2, 0.15, 0.25), (0.1, 0.08, 0.12))
    df[["kv_transfer_p50_s", "kv_put_p50_s", "kv_get_p50_s", "prefill_p50_s"]] = math.nan
    df["placement"] = ["vllm@colocated:1", "pdlab@disagg:1p1d"]
    # the config rows say which server made each: different ones, whatever the labels say
    for labels in ({"vllm@colocated:1": "vllm server over HTTP",
                    "pdlab@disagg:1p1d": "pdlab server over HTTP"}, None):
        text = a.verdict(df, SLO_, systems=labels)
        assert "interference" in text and "removed" not in text
        assert "KV transfer" not in text and "Transfer paid" not in text
    assert ("colocated/disagg = 2.00x (different systems, vllm server over HTTP vs pdlab "
            "server over HTTP: not a measure of prefill-decode interference).") in a.verdict(
        df, SLO_, systems={"vllm@colocated:1": "vllm server over HTTP",
                           "pdlab@disagg:1p1d": "pdlab server over HTTP"})
    # one server behind both labels: the claim stands
    same = dict.fromkeys(["vllm@colocated:1", "pdlab@disagg:1p1d"], "pdlab server over HTTP")
    assert "2.00x (disaggregation removed prefill-decode interference)" in a.verdict(
        df, SLO_, systems=same)


def test_serving_systems_read_from_the_config_rows():
    from experiments.results import serving_systems
    run = {"placements": ["colocated:2", "disagg:1p1d"], "engine": {}}
    vllm = {"placements": ["vllm@colocated:1"], "bench": {}, "server": "vllm"}
    older = {"placements": ["x@disagg:1p1d"], "bench": {}}  # no server recorded: the label
    assert serving_systems({"configs": [run, vllm, older], "placements": []}) == {
        "colocated:2": "pdlab in process", "disagg:1p1d": "pdlab in process",
        "vllm@colocated:1": "vllm server over HTTP", "x@disagg:1p1d": "x server over HTTP"}
    assert serving_systems({"model": "tiny"}) == {}


def test_verdict_lines_with_numbers():
    df = a.summary_table(runs(), SLO_)
    gp = a.goodput_table(runs(), SLO_, 2, num_boot=100)
    text = a.verdict(df, SLO_, goodput=gp)
    assert "At 1 req/s: no clear winner at this rate" in text  # both 100% [100%, 100%]
    assert f"TPOT p99: {COLO} 0.2225 s" in text and "2.23x" in text  # 0.2225 / 0.1
    # the transfer line uses the full cost (record.kv_transfer_s here: no put/get split)
    assert "KV transfer (put + get) p50 0.05 s" in text and "(25.0% of prefill)" in text
    assert f"{COLO} 0.5 [" in text and f"{DIS} 1 [" in text  # goodput per device


def test_all_failed_does_not_crash_and_gives_nan():
    r = a.summary_row(COLO, 1.0, failed_records(), SLO_)
    assert r["num_failed"] == 3 and r["slo_attainment"] == 0.0
    assert math.isnan(r["ttft_p50_s"]) and math.isnan(r["tpot_p99_s"])
    df = a.summary_table([(COLO, 1.0, failed_records()), (DIS, 1.0, disagg_records())], SLO_)
    assert f"At 1 req/s: winner {DIS}" in a.verdict(df, SLO_)  # [0, 0] vs [1, 1]
    only_failed = a.summary_table([(COLO, 1.0, failed_records())], SLO_)
    assert "failed" in a.verdict(only_failed, SLO_)
    bd = a.latency_breakdown(failed_records())
    assert bd.iloc[0]["num_requests"] == 0 and math.isnan(bd.iloc[0]["prefill_s"])
    rf = a.requests_frame(failed_records(), SLO_)
    assert rf["failed"].all() and rf["ttft_s"].isna().all() and not rf["meets_slo"].any()


def test_requests_frame_per_request_metrics():
    df = a.requests_frame(colocated_records(), SLO_)
    assert len(df) == 3 and list(df["request_id"]) == ["c0", "c1", "c2"]
    c1 = df.iloc[1]
    assert c1["ttft_s"] == pytest.approx(0.3)
    assert c1["tpot_s"] == pytest.approx(0.225)
    assert c1["e2e_s"] == pytest.approx(1.2)
    assert c1["itl_max_s"] == pytest.approx(0.6)
    assert c1["num_output_tokens"] == 5
    assert df["meets_slo"].tolist() == [True, False, True]
    assert math.isnan(c1["kv_transfer_s"])


def test_transfer_efficiency_against_hand_computed_values():
    """Three chunks of disagg:1p1d (two of one layer-wise request, one whole) and one
    chunk of disagg:1p2d without a measured peak; colocated has no transfers, no row."""
    rows = [  # placement, transport, bytes, put_s, get_s, achieved, peak, efficiency, exposed
        (DIS, "shm", 1_000_000, 0.001, 0.001, 0.5, 10.0, 0.05, 0.0005),
        (DIS, "shm", 3_000_000, 0.002, 0.001, 1.0, 10.0, 0.10, 0.003),
        (DIS, "shm", 2_000_000, 0.001, 0.000, 2.0, 10.0, 0.20, float("nan")),
        ("disagg:1p2d", "ray", 4_000_000, 0.002, 0.002, 1.0, float("nan"), float("nan"),
         float("nan")),
    ]
    cols = ["placement", "transport", "num_bytes", "put_s", "get_s", "achieved_gbps",
            "peak_gbps", "efficiency", "exposed_s"]
    table = a.transfer_efficiency(pd.DataFrame(rows, columns=cols))
    assert list(table.columns) == a.TRANSFER_EFFICIENCY_COLUMNS
    dis, other = table.iloc[0], table.iloc[1]
    assert (dis["placement"], dis["transport"], dis["num_transfers"]) == (DIS, "shm", 3)
    assert dis["kv_bytes_total"] == 6_000_000
    assert dis["achieved_gbps_p50"] == 1.0 and dis["peak_gbps"] == 10.0
    assert dis["efficiency_p50"] == pytest.approx(0.10)
    # exposed over put + get of the chunks that have it: (0.0005 + 0.003) / (0.002 + 0.003)
    assert dis["exposed_share"] == pytest.approx(0.7)
    assert math.isnan(other["peak_gbps"]) and math.isnan(other["exposed_share"])
    text = a.transfer_efficiency_text(table)
    assert f"{DIS} (shm) 1 GB/s p50, 10% of a 10 GB/s link peak, 70% of its time exposed" in text
    assert "disagg:1p2d (ray) 1 GB/s p50, no link peak measured" in text
    simulated = a.transfer_efficiency(pd.DataFrame(  # the planner's rows: bytes and seconds
        [(DIS, "ray", 2_000_000, 0.001, 0.003)], columns=cols[:5]))
    assert simulated["achieved_gbps_p50"].tolist() == [pytest.approx(0.5)]
    assert simulated[["peak_gbps", "efficiency_p50", "exposed_share"]].isna().all(axis=None)
    assert a.transfer_efficiency(pd.DataFrame(columns=["placement", "rate", "seed"])).empty
    assert a.transfer_efficiency_text(a.transfer_efficiency(pd.DataFrame())) == ""
