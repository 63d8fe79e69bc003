"""Metrics against values computed by hand on synthetic timelines."""

import json
import math

import pytest

from engine import metrics as m
from engine.metrics import SLO, RequestRecord


def rec(rid="a", arrived=10.0, tokens=(10.5, 10.7, 11.0, 11.6), error=None, **timeline):
    tl = {m.ARRIVED: arrived} if arrived is not None else {}
    tl.update(timeline)
    return RequestRecord(
        request_id=rid, placement="disagg:1P1D", prefill_worker="p0", decode_worker="d0",
        num_prompt_tokens=7, output_token_ids=list(range(len(tokens))), error=error,
        kv_bytes=1000, timeline=tl, token_times_s=list(tokens),
    )


def test_event_names():
    assert (m.ARRIVED, m.DISPATCHED, m.PREFILL_QUEUED, m.PREFILL_STARTED, m.PREFILL_FINISHED,
            m.KV_PUT, m.KV_GOT, m.DECODE_ADMITTED, m.FINISHED, m.ERROR) == (
        "arrived", "dispatched", "prefill_queued", "prefill_started", "prefill_finished", "kv_put",
        "kv_got", "decode_admitted", "finished", "error")


def test_per_request_metrics_by_hand():
    r = rec(prefill_queued=10.1, prefill_started=10.2, prefill_finished=10.45)
    r.kv_transfer_s = 0.05
    assert m.ttft_s(r) == pytest.approx(0.5)
    assert m.itl_s(r) == pytest.approx([0.2, 0.3, 0.6])
    assert m.e2e_s(r) == pytest.approx(1.6)
    assert m.tpot_s(r) == pytest.approx((1.6 - 0.5) / 3)
    assert m.first_decode_gap_s(r) == pytest.approx(0.2)
    assert m.prefill_queue_s(r) == pytest.approx(0.1)
    assert m.prefill_s(r) == pytest.approx(0.25)
    assert m.kv_transfer_s(r) == 0.05
    assert not m.failed(r)


def test_prefill_queue_falls_back_to_arrived():
    r = rec(prefill_started=10.3)
    assert m.prefill_queue_s(r) == pytest.approx(0.3)


def test_missing_events_are_none_not_zero():
    r = rec(arrived=None, tokens=(1.0,))
    assert m.ttft_s(r) is None and m.e2e_s(r) is None and m.tpot_s(r) is None
    assert m.prefill_queue_s(r) is None and m.prefill_s(r) is None
    assert m.first_decode_gap_s(r) is None and m.kv_transfer_s(r) is None
    assert m.itl_s(r) == []


def test_one_token_request_has_no_tpot_but_is_not_failed():
    r = rec(tokens=(10.4,))
    assert m.tpot_s(r) is None and m.ttft_s(r) == pytest.approx(0.4)
    assert not m.failed(r)


def test_no_token_is_failure_without_ttft():
    r = rec(tokens=())
    assert m.failed(r)
    assert m.ttft_s(r) is None and m.e2e_s(r) is None
    assert m.failed(rec(error="worker died"))


def test_record_json_round_trip():
    r = rec(prefill_started=10.2)
    r.kv_transfer_s, r.finish_reason = 0.01, "length"
    back = RequestRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
    with pytest.raises(ValueError, match="bogus"):
        RequestRecord.from_dict({**r.to_dict(), "bogus": 1})


def test_stamp():
    r = RequestRecord("x")
    r.stamp(m.KV_PUT, 3.0)
    r.stamp(m.FINISHED)
    assert r.timeline[m.KV_PUT] == 3.0 and r.timeline[m.FINISHED] > 1e9


def test_slo_and_attainment_counts_failures_as_misses():
    slo = SLO(ttft_s=0.6, tpot_s=0.4)
    good = rec("good")  # ttft 0.5, tpot 0.3667
    slow_first = rec("slow_first", tokens=(10.7, 10.8))  # ttft 0.7
    slow_decode = rec("slow_decode", tokens=(10.5, 11.0))  # tpot 0.5
    one_token = rec("one", tokens=(10.2,))  # tpot None -> passes
    errored = rec("err", error="boom")  # fast, but failed
    empty = rec("empty", tokens=())
    assert m.meets_slo(good, slo) and m.meets_slo(one_token, slo)
    assert not m.meets_slo(slow_first, slo)
    assert not m.meets_slo(slow_decode, slo)
    assert not m.meets_slo(errored, slo) and not m.meets_slo(empty, slo)
    recs = [good, slow_first, slow_decode, one_token, errored, empty]
    assert m.slo_attainment(recs, slo) == pytest.approx(2 / 6)
    assert math.isnan(m.slo_attainment([], slo))


def test_summarize_by_hand():
    a = rec("a", finished=11.6)  # ttft .5, itl .2 .3 .6, e2e 1.6
    b = rec("b", arrived=11.0, tokens=(11.1, 11.5), finished=11.5)  # ttft .1, itl .4, e2e .5
    c = rec("c", arrived=12.0, tokens=(13.0,), finished=14.0)  # ttft 1.0, e2e 1.0
    failed = rec("f", arrived=12.0, tokens=(), error="boom", finished=12.5)
    a.kv_transfer_s = 0.02
    s = m.summarize([a, b, c, failed], slo=SLO(ttft_s=0.6, tpot_s=0.5))
    assert s["num_requests"] == 4 and s["num_failed"] == 1
    # TTFT over completed only: [0.5, 0.1, 1.0] -> sorted .1 .5 1.0
    assert s["ttft_mean_s"] == pytest.approx(1.6 / 3)
    assert s["ttft_p50_s"] == pytest.approx(0.5)
    assert s["ttft_p90_s"] == pytest.approx(0.5 + 0.8 * 0.5)  # rank 1.8 of 0..2
    assert s["ttft_p99_s"] == pytest.approx(0.5 + 0.98 * 0.5)
    # ITL pooled: [.2, .3, .6, .4] -> sorted .2 .3 .4 .6; p50 at rank 1.5, p90 at rank 2.7
    assert s["itl_mean_s"] == pytest.approx(1.5 / 4)
    assert s["itl_p50_s"] == pytest.approx(0.35)
    assert s["itl_p90_s"] == pytest.approx(0.4 + 0.7 * 0.2)
    # TPOT: a (1.1/3), b 0.4; c has one token
    assert s["tpot_mean_s"] == pytest.approx((1.1 / 3 + 0.4) / 2)
    assert s["e2e_p50_s"] == pytest.approx(1.0)
    assert s["kv_transfer_mean_s"] == pytest.approx(0.02)
    assert math.isnan(s["prefill_mean_s"]) and math.isnan(s["prefill_queue_p99_s"])
    assert s["first_decode_gap_mean_s"] == pytest.approx(0.3)  # .2 and .4
    # duration: last finish 14.0 - first arrival 10.0 = 4 s
    assert s["throughput_req_s"] == pytest.approx(3 / 4)
    assert s["output_tok_s"] == pytest.approx(7 / 4)
    # SLO: a (.5, .367) ok; b (.1, .4) ok; c ttft 1.0 miss; failed miss
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["goodput_req_s"] == pytest.approx(2 / 4)
    assert s["kv_bytes_total"] == 4000


def test_summarize_explicit_duration_and_no_slo():
    s = m.summarize([rec()], duration_s=2.0)
    assert s["throughput_req_s"] == pytest.approx(0.5)
    assert s["output_tok_s"] == pytest.approx(2.0)
    assert math.isnan(s["slo_attainment"]) and math.isnan(s["goodput_req_s"])


def test_summarize_empty():
    s = m.summarize([])
    assert s["num_requests"] == 0 and math.isnan(s["ttft_p50_s"])
    assert math.isnan(s["throughput_req_s"])


def test_goodput_rate_from_sweep():
    rates = [4.0, 1.0, 3.0, 2.0]
    att = [0.5, 0.99, 0.85, 0.9]  # highest rate with >= 0.9 is 2.0
    assert m.goodput_rate(rates, att, num_devices=2) == pytest.approx(1.0)
    assert m.goodput_rate(rates, att, num_devices=1, target=0.8) == pytest.approx(3.0)
    assert m.goodput_rate(rates, [0.1] * 4, num_devices=2) == 0.0
    with pytest.raises(ValueError, match="length"):
        m.goodput_rate([1.0], [], 1)
    with pytest.raises(ValueError, match="num_devices"):
        m.goodput_rate([1.0], [1.0], 0)


def test_late_dispatch_counts_from_the_scheduled_arrival():
    # scheduled at 10.0, the router got round to it at 10.3, first token out at 10.5
    r = rec(arrived=10.0, tokens=(10.5, 10.6), dispatched=10.3)
    assert m.ttft_s(r) == pytest.approx(0.5)  # not 0.2: no coordinated omission
    assert m.e2e_s(r) == pytest.approx(0.6)
    assert m.dispatch_lag_s(r) == pytest.approx(0.3)
    on_time = rec("b", arrived=11.0, tokens=(11.1,), dispatched=11.0)
    no_stamp = rec("c", arrived=12.0, tokens=(12.1,))
    assert m.dispatch_lag_s(no_stamp) is None
    failed = rec("f", arrived=12.0, tokens=(), error="boom", dispatched=12.1)
    s = m.summarize([r, on_time, no_stamp, failed])
    # lag over every request that has it, failed ones too: [0.3, 0.0, 0.1]
    assert s["dispatch_lag_mean_s"] == pytest.approx(0.4 / 3)
    assert s["dispatch_lag_p50_s"] == pytest.approx(0.1)
    assert s["dispatch_lag_p99_s"] == pytest.approx(0.1 + 0.98 * 0.2)


def test_itl_and_tpot_use_worker_times_not_router_polling():
    # the router polled twice: tokens 1 and 2 reached it together, 3 one poll later
    r = rec(arrived=10.0, tokens=(10.5, 10.7, 10.7, 10.9))
    r.token_worker_times_s = [10.45, 10.55, 10.65, 10.75]
    assert m.itl_s(r) == pytest.approx([0.1, 0.1, 0.1])
    assert m.itl_router_s(r) == pytest.approx([0.2, 0.0, 0.2])
    assert m.tpot_s(r) == pytest.approx(0.3 / 3)
    assert m.tpot_router_s(r) == pytest.approx(0.4 / 3)  # vLLM's (E2E - TTFT) / (n - 1)
    assert m.ttft_s(r) == pytest.approx(0.5)  # TTFT stays on the router clock
    assert m.first_decode_gap_s(r) == pytest.approx(0.2)
    s = m.summarize([r], duration_s=1.0)
    assert s["itl_p99_s"] == pytest.approx(0.1)
    assert s["itl_router_p99_s"] == pytest.approx(0.2)
    assert s["tpot_p50_s"] == pytest.approx(0.1) and s["tpot_router_p50_s"] == pytest.approx(0.4 / 3)
    # a record without (or with incomplete) worker times falls back to the router's
    r.token_worker_times_s = [10.45]
    assert m.itl_s(r) == pytest.approx([0.2, 0.0, 0.2])
    back = RequestRecord.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.token_worker_times_s == [10.45]


def test_kv_transfer_is_put_plus_get():
    r = rec()  # kv_bytes 1000
    r.kv_put_s, r.kv_get_s = 0.01, 0.03
    assert m.kv_put_s(r) == 0.01 and m.kv_get_s(r) == 0.03
    assert m.kv_transfer_s(r) == pytest.approx(0.04)
    assert m.kv_gb_per_s(r) == pytest.approx(1000 / 0.04 / 1e9)
    b = rec("b", arrived=11.0, tokens=(11.1, 11.2))
    b.kv_bytes, b.kv_put_s, b.kv_get_s = 3000, 0.02, 0.04
    colocated = rec("c", tokens=(10.5,))
    colocated.kv_bytes = 0
    s = m.summarize([r, b, colocated])
    assert s["kv_put_p50_s"] == pytest.approx(0.015)
    assert s["kv_get_p50_s"] == pytest.approx(0.035)
    assert s["kv_transfer_p50_s"] == pytest.approx(0.05)  # of 0.04 and 0.06
    assert s["kv_gb_s"] == pytest.approx(4000 / 0.10 / 1e9)
    assert m.kv_gb_per_s(colocated) is None
    assert math.isnan(m.summarize([colocated])["kv_gb_s"])


def test_goodput_needs_every_lower_rate_to_meet_the_target():
    # non-monotone curve: 3 req/s attains 95% but 2 req/s only 80% -> goodput is 1 req/s
    rates, att = [3.0, 1.0, 2.0], [0.95, 0.95, 0.8]
    assert m.goodput_rate(rates, att, num_devices=1) == pytest.approx(1.0)
    assert m.goodput_rate(rates, att, num_devices=2) == pytest.approx(0.5)
    assert m.goodput_rate(rates, att, num_devices=1, target=0.8) == pytest.approx(3.0)
    assert m.goodput_rate([1.0, 2.0], [math.nan, 1.0], 1) == 0.0  # NaN misses


def test_metrics_module_imports_no_torch():
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(m.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in names and "transformers" not in names


def test_prefix_hits_and_prefill_skipped_are_summed_over_every_request():
    """Prompts of 40, 56 and 72 tokens with 0, 32 and 48 cached (a 3-turn conversation in
    16-token blocks): 80 of 168 prompt tokens skipped; a failed request's cached tokens
    count too (its prefill was skipped all the same)."""
    turns = [rec(f"t{k}") for k in range(3)]
    for r, n, hit in zip(turns, (40, 56, 72), (0, 32, 48)):
        r.num_prompt_tokens, r.num_cached_prompt_tokens = n, hit
    turns[2].kv_bytes_saved, turns[1].num_preemptions = 4096, 2
    s = m.summarize(turns)
    assert s["prefill_tokens_skipped"] == 80
    assert s["prefix_hit_rate"] == pytest.approx(80 / 168)
    assert s["kv_bytes_saved_total"] == 4096 and s["num_preemptions_total"] == 2
    failed = rec("f", tokens=())
    failed.error, failed.num_prompt_tokens, failed.num_cached_prompt_tokens = "boom", 32, 16
    s = m.summarize(turns + [failed])
    assert s["prefill_tokens_skipped"] == 96 and s["prefix_hit_rate"] == pytest.approx(96 / 200)
    assert math.isnan(m.summarize([])["prefix_hit_rate"])
