"""Hindsight scoring of conditional disaggregation against values computed by hand."""

import pytest

from engine import metrics as m
from engine.metrics import SLO, RequestRecord
from experiments.hindsight import hindsight, hindsight_text, step_costs

STEPS = [  # worker, seconds, prompt tokens, decode tokens
    {"worker": "prefill-0", "duration_s": 0.5, "num_prefill_tokens": 100, "num_decode_tokens": 0},
    {"worker": "decode-0", "duration_s": 0.3, "num_prefill_tokens": 50, "num_decode_tokens": 2},
    {"worker": "decode-0", "duration_s": 0.02, "num_prefill_tokens": 0, "num_decode_tokens": 2},
    {"worker": "decode-0", "duration_s": 0.04, "num_prefill_tokens": 0, "num_decode_tokens": 3},
    {"worker": "decode-0", "duration_s": 0.03, "num_prefill_tokens": 0, "num_decode_tokens": 1},
]


def rec(rid, path, prompt, tokens, kv_transfer_s=None, error=None):
    return RequestRecord(rid, placement="conditional:1p1d", num_prompt_tokens=prompt,
                         prefill_path=path, output_token_ids=list(range(len(tokens))),
                         kv_transfer_s=kv_transfer_s, error=error,
                         timeline={m.ARRIVED: 0.0}, token_times_s=list(tokens))


RECORDS = [rec("a", "local", 50, (0.4, 0.5, 0.6)),  # TTFT 0.4, TPOT 0.1
           rec("b", "remote", 100, (0.6, 0.65, 0.70, 0.75), kv_transfer_s=0.01),  # 0.6, 0.05
           rec("c", None, 10, (0.1, 0.2)),  # colocated: no path, left out
           rec("d", "local", 10, (), error="boom")]  # failed: left out
SLO_ = SLO(ttft_s=0.5, tpot_s=0.08)


def test_step_costs_by_hand():
    costs = step_costs(STEPS, RECORDS)
    assert costs["prompt_token_s"] == pytest.approx(0.8 / 150)
    assert costs["decode_only_step_s"] == pytest.approx(0.03)  # median of 0.02, 0.04, 0.03
    assert costs["decode_mean_step_s"] == pytest.approx(0.39 / 4)
    assert costs["transfer_s_per_token"] == pytest.approx(0.01 / 100)


def test_hindsight_by_hand():
    table = hindsight(RECORDS, STEPS, SLO_).set_index("request_id")
    assert list(table.index) == ["a", "b"]
    a, b = table.loc["a"], table.loc["b"]
    # a prefilled locally and missed TPOT; remote: 50 tokens x 0.8/150 s, 0.03 + 0.005/2 s
    assert not a.met_slo and a.other_path == "remote"
    assert a.other_ttft_est_s == pytest.approx(50 * 0.8 / 150)
    assert a.other_tpot_est_s == pytest.approx(0.03 + 1e-4 * 50 / 2)
    assert a.other_met_slo and a.regret
    # b prefilled remotely and missed TTFT; locally its prefill alone (0.533 s) misses too
    assert not b.met_slo and b.other_path == "local"
    assert b.other_ttft_est_s == pytest.approx(100 * 0.8 / 150)
    assert b.other_tpot_est_s == pytest.approx(0.39 / 4)
    assert not b.other_met_slo and not b.regret
    assert hindsight_text(table.reset_index()).startswith(
        "hindsight: 1 local and 1 remote prefills; 1 missed the SLO where the other path")
