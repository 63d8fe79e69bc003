"""experiments.analysis against values computed by hand on synthetic records.

Two placements on the same three-request workload (times relative to T0):
- colocated:2: request c1's decode stalls 0.6 s (a prefill ran in its batch): TPOT 0.225 s.
- disagg:1p1d: every request decodes at 0.1 s/token; KV ships in 0.05 s (kv_put -> kv_got).
SLO: TTFT <= 0.5 s, TPOT <= 0.15 s, so colocated attains 2/3 and disagg 3/3.
"""

import math

import pytest

from engine.metrics import SLO, RequestRecord
from experiments import analysis as a

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
    assert a.SUMMARY_COLUMNS[0] == "placement" and a.SUMMARY_COLUMNS[-1] == "prefill_p50_s"
    assert len(df) == 4
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
    curve = a.attainment_curve(runs(), SLO_)
    assert list(curve.columns) == ["placement", "rate", "slo_attainment"]
    assert curve["slo_attainment"].tolist() == pytest.approx([1.0, 2 / 3, 1.0, 1.0])
    gp = a.goodput_per_device(curve, num_devices=2)
    assert gp == {COLO: pytest.approx(0.5), DIS: pytest.approx(1.0)}
    # no rate reaches 90% -> 0
    low = curve.assign(slo_attainment=0.5)
    assert a.goodput_per_device(low, 2) == {COLO: 0.0, DIS: 0.0}


def test_verdict_names_the_designed_winner_with_numbers():
    df = a.summary_table(runs(), SLO_)
    text = a.verdict(df, SLO_, num_devices=2)
    first = text.splitlines()[0]
    assert first.startswith(f"Winner: {DIS} at 2 req/s")
    assert "100.0%" in first and "66.7%" in first
    assert "2.23x" in text  # TPOT p99 colocated/disagg = 0.2225 / 0.1
    assert "KV transfer p50 0.05 s vs prefill p50 0.2 s (25.0% of prefill)" in text
    assert f"{COLO} 0.5 req/s" in text and f"{DIS} 1 req/s" in text


def test_verdict_tie_broken_by_tpot_p99():
    df = a.summary_table([(COLO, 1.0, colocated_records(stall=False)),
                          (DIS, 1.0, disagg_records())], SLO(ttft_s=10.0, tpot_s=10.0))
    # both attain 100%; colocated (no stall) TPOT p99 is 0.1 like disagg -> make disagg slower
    df.loc[df["placement"] == DIS, "tpot_p99_s"] = 0.12
    text = a.verdict(df, SLO(ttft_s=10.0, tpot_s=10.0))
    assert text.splitlines()[0].startswith(f"Winner: {COLO}")
    assert "tied on SLO attainment" in text


def test_all_failed_does_not_crash_and_gives_nan():
    r = a.summary_row(COLO, 1.0, failed_records(), SLO_)
    assert r["num_failed"] == 3 and r["slo_attainment"] == 0.0
    assert math.isnan(r["ttft_p50_s"]) and math.isnan(r["tpot_p99_s"])
    df = a.summary_table([(COLO, 1.0, failed_records()), (DIS, 1.0, disagg_records())], SLO_)
    assert a.verdict(df, SLO_).startswith(f"Winner: {DIS}")
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
