"""planner.diagnose: a hand-built real run (chunked prompt, a second prompt in the
same step, then two decodes) comes back as the batches that produced it, with the step
model, the loop gaps and the TTFT parts computed by hand."""

from __future__ import annotations

import math

import pytest

from engine.metrics import (ARRIVED, DISPATCHED, PREFILL_FINISHED, PREFILL_QUEUED,
                            PREFILL_STARTED, RequestRecord)
from planner import diagnose

W = "colocated-0"


def _run():
    # budget 8: A (10 tokens) chunk 8 in step 1; step 2 runs A's last 2 and all of B (6);
    # step 3 decodes both (A at 10 + 1, B at 6 + 1 tokens of KV)
    steps = [{"worker": W, "start_s": 0.0, "duration_s": 1.0, "num_requests": 1,
              "num_prefill_tokens": 8, "num_decode_tokens": 0},
             {"worker": W, "start_s": 1.01, "duration_s": 0.99, "num_requests": 2,
              "num_prefill_tokens": 8, "num_decode_tokens": 0},
             {"worker": W, "start_s": 2.03, "duration_s": 0.5, "num_requests": 2,
              "num_prefill_tokens": 0, "num_decode_tokens": 2}]
    a = RequestRecord("r-0", placement="colocated:1", prefill_worker=W, decode_worker=W,
                      num_prompt_tokens=10, token_worker_times_s=[2.0, 2.53],
                      token_times_s=[2.004, 2.535],
                      timeline={ARRIVED: -0.01, DISPATCHED: -0.008, PREFILL_QUEUED: -0.005,
                                PREFILL_STARTED: 0.0, PREFILL_FINISHED: 2.0})
    b = RequestRecord("r-1", placement="colocated:1", prefill_worker=W, decode_worker=W,
                      num_prompt_tokens=6, token_worker_times_s=[2.0, 2.53],
                      token_times_s=[2.006, 2.535],
                      timeline={ARRIVED: 0.5, DISPATCHED: 0.5, PREFILL_QUEUED: 0.502,
                                PREFILL_STARTED: 1.01, PREFILL_FINISHED: 2.0})
    return [a, b], steps


def test_rebuilt_batches_are_the_ones_that_ran():
    records, steps = _run()
    rows = diagnose.rebuild_steps(records, steps)
    got = [(r["prefill_tokens"], r["prefill_attention"], r["batch_size"], r["sum_context"],
            set(r["request_ids"]), r["rebuilt"]) for r in rows]
    assert got == [(8, 8 * 8, 0, 0, {"r-0"}, True),
                   (8, 2 * (8 + 2) + 6 * 6, 0, 0, {"r-0", "r-1"}, True),
                   (0, 0, 2, 11 + 7, {"r-0", "r-1"}, True)]


def test_step_table_puts_the_model_beside_each_step_and_the_loop_gaps():
    records, steps = _run()
    model = lambda n, q, b, c: 0.5 if b else 1.0  # noqa: E731
    t = diagnose.step_table(records, steps, model)
    assert list(t.columns) == diagnose.STEP_COLUMNS
    assert list(t["kind"]) == ["prefill", "prefill", "decode"]
    assert list(t["ratio"]) == pytest.approx([1.0, 0.99, 1.0])
    assert list(t["gap_s"][:2]) == pytest.approx([0.01, 0.03]) and math.isnan(t["gap_s"].iloc[2])
    s = diagnose.step_summary(t).set_index("kind")
    assert s.loc["prefill", "num_steps"] == 2
    assert s.loc["prefill", "ratio_weighted"] == pytest.approx(1.99 / 2.0)
    assert s.loc["prefill", "gap_p50_ms"] == pytest.approx(20.0)


def test_a_step_whose_tokens_do_not_add_up_is_flagged():
    records, steps = _run()
    steps[2]["num_decode_tokens"] = 3  # a decode entry no record accounts for
    assert [r["rebuilt"] for r in diagnose.rebuild_steps(records, steps)] == [True, True, False]


def test_ttft_parts_add_up_to_ttft():
    records, _ = _run()
    p = diagnose.ttft_parts(records).set_index("request_id")
    assert p.loc["r-0", "queue_s"] == pytest.approx(0.005)
    assert p.loc["r-0", "delivery_s"] == pytest.approx(0.004)
    for rid, row in p.iterrows():
        assert sum(row[c] for c in diagnose.TTFT_PARTS) == pytest.approx(row["ttft_s"]), rid


def test_outcome_table_counts_the_requests_whose_slo_outcome_flipped():
    from engine.metrics import SLO
    from experiments.replay import RunResult
    from experiments import validate

    def rec(rid, ttft_s):
        return RequestRecord(rid, timeline={ARRIVED: 0.0}, token_times_s=[ttft_s],
                             output_token_ids=[1])

    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    # real ids carry the rate, simulated ones do not: paired by their position suffix
    real = [RunResult("colocated:1", 0.5, [rec("colocated:1@0.5/s0-0", 0.5),
                                            rec("colocated:1@0.5/s0-1", 2.0),
                                            rec("colocated:1@0.5/s0-2", 0.9)], [], [], 1.0, 0)]
    sim = [RunResult("colocated:1", 0.5, [rec("colocated:1/s0-0", 0.6), rec("colocated:1/s0-1", 0.8),
                                           rec("colocated:1/s0-2", 1.1)], [], [], 1.0, 0)]
    t = validate.outcome_table(real, sim, slo)
    assert t.to_dict("records") == [{"placement": "colocated:1", "rate": 0.5, "num_requests": 3,
                                     "num_flipped": 2}]


def test_first_placement_agrees_within_a_measured_tie_only():
    import pandas as pd

    from experiments import validate

    errors = pd.DataFrame({"attainment_err_points": [0.0], **{
        f"{c.removesuffix('_s')}_rel_err": [0.0] for c in validate.LATENCIES}})
    tie = validate.validation_summary(errors, {"a": 0.2, "b": 0.2}, {"b": 0.4, "a": 0.2})
    assert tie["measured_first"] == "a" and tie["simulated_first"] == "b" and tie["first_agrees"]
    assert "measured a = b (tied), simulated b (agree)" in validate.summary_text(tie)
    apart = validate.validation_summary(errors, {"a": 0.2, "b": 0.1}, {"b": 0.4, "a": 0.2})
    assert not apart["first_agrees"] and "DISAGREE" in validate.summary_text(apart)
