"""``experiments.validate.stage_latency``: pdlab's added latency per stage, from hand-made
records (a real run and its simulated twin), seconds hand-computed."""

from __future__ import annotations

import math

import pytest

from engine import metrics as m
from engine.metrics import RequestRecord
from experiments.replay import RunResult
from experiments.validate import largest_stage_text, stage_latency


def record(rid: str, stamps: dict[str, float], tokens: list[float]) -> RequestRecord:
    r = RequestRecord(rid, "disagg:1p1d", num_prompt_tokens=10)
    r.timeline.update(stamps)
    r.token_times_s = tokens
    return r


def run(records) -> RunResult:
    return RunResult("disagg:1p1d", 2.0, records, [], [], 1.0)


def test_stage_medians_and_added_seconds_hand_computed():
    real = record("a", {m.ARRIVED: 0.0, m.PREFILL_STARTED: 0.003, m.PREFILL_FINISHED: 0.010,
                        m.KV_PUT: 0.011, m.KV_GOT: 0.030, m.DECODE_ADMITTED: 0.037},
                  [0.013, 0.045, 0.053, 0.061])
    twin = record("a", {m.ARRIVED: 0.0, m.PREFILL_STARTED: 0.0, m.PREFILL_FINISHED: 0.006,
                        m.KV_PUT: 0.006, m.KV_GOT: 0.015, m.DECODE_ADMITTED: 0.022},
                  [0.006, 0.029, 0.036, 0.043])
    table = stage_latency([run([real])], [run([twin])]).set_index("stage")
    expected = {"arrival to prefill start": (0.003, 0.0), "prefill": (0.007, 0.006),
                "KV put": (0.001, 0.0), "hand-over to KV fetched": (0.019, 0.009),
                "KV fetched to first decode": (0.007, 0.007),
                "first token to router": (0.003, 0.0), "first decode gap": (0.032, 0.023),
                "later decode gaps": (0.008, 0.007)}
    assert list(table.index) == list(expected)
    for stage, (got, want) in expected.items():
        assert table.loc[stage, "measured_s"] == pytest.approx(got)
        assert table.loc[stage, "modelled_s"] == pytest.approx(want)
        assert table.loc[stage, "added_s"] == pytest.approx(got - want)
    text = largest_stage_text(stage_latency([run([real])], [run([twin])]))
    assert text == ("disagg:1p1d: pdlab's largest added stage is hand-over to KV fetched "
                    "(+10.00 ms, median over rates); each later decode step +1.00 ms")
    dilated = largest_stage_text(stage_latency([run([real])], [run([twin])]), time_scale=10)
    assert dilated == text + ("\n(time dilated x 10: each figure is this host's added time "
                              "/ 10; the undilated cost is 10 x)")


def test_a_colocated_run_has_no_kv_stages():
    real = record("c", {m.ARRIVED: 0.0, m.PREFILL_STARTED: 0.002, m.PREFILL_FINISHED: 0.009},
                  [0.010, 0.018])
    table = stage_latency([run([real])], [run([real])]).set_index("stage")
    assert math.isnan(table.loc["KV put", "measured_s"])
    assert table.loc["prefill", "added_s"] == 0.0
    assert math.isnan(table.loc["first decode gap", "measured_s"])  # 2 tokens: no later gap
