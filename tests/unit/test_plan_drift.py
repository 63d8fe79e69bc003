"""planner.drift: a speed trace from a hand-built steps table (known factors ->
known windows), the run's origin from its records, and bad input."""

from __future__ import annotations

import pandas as pd
import pytest

from engine.metrics import ARRIVED, RequestRecord
from planner import drift


def _steps(rows):
    return pd.DataFrame(rows, columns=["worker", "start_s", "rebuilt", "ratio"])


def test_trace_is_the_median_per_window_with_gaps_filled():
    # origin 100 s, windows of 5 s. colocated-0: window 0 has 1.0, 1.2, 1.1 -> 1.1; window 1
    # has no step -> keeps 1.1; window 2 has 2.0, 1.6, 1.8 (and a step that was not rebuilt,
    # and one without a modelled time: both ignored) -> 1.8.
    steps = _steps([("colocated-0", 100.5, True, 1.0), ("colocated-0", 101.0, True, 1.2),
                    ("colocated-0", 102.0, True, 1.1), ("colocated-0", 110.0, True, 2.0),
                    ("colocated-0", 111.0, False, 9.0), ("colocated-0", 112.0, True, float("nan")),
                    ("colocated-0", 113.0, True, 1.6), ("colocated-0", 114.9, True, 1.8),
                    ("colocated-1", 106.0, True, 0.5)])
    trace = drift.speed_trace(steps, origin_s=100.0, window_s=5.0)
    assert trace.factors["colocated-0"] == (1.1, 1.1, 1.8)
    # colocated-1's only step is in window 1: window 0 takes it (filled back)
    assert trace.factors["colocated-1"] == (0.5, 0.5)
    # pooled: window 0 median of 1.0, 1.2, 1.1; window 1 of 0.5; window 2 as colocated-0
    assert trace.factors[drift.ALL_WORKERS] == (1.1, 0.5, 1.8)
    assert trace("colocated-0", 0.0) == 1.1 and trace("colocated-0", 4.999) == 1.1
    assert trace("colocated-0", 7.0) == 1.1 and trace("colocated-0", 10.0) == 1.8  # edge: next window
    assert trace("colocated-0", 1e6) == 1.8 and trace("colocated-0", -3.0) == 1.1
    assert trace("decode-7", 6.0) == 0.5  # a worker without steps: the pooled trace
    table = trace.table()
    assert list(table.columns) == ["worker", "window_start_s", "factor"]
    assert list(table[table["worker"] == "colocated-0"]["window_start_s"]) == [0.0, 5.0, 10.0]


def test_a_shorter_window_follows_a_change_the_longer_one_averages():
    # 1 s steps, 1.0 for the first 10 s, then 1.4: 2 s windows see the change at 10 s,
    # one 20 s window gives the median of all twenty (1.2).
    steps = _steps([("w", float(t), True, 1.0 if t < 10 else 1.4) for t in range(20)])
    assert drift.speed_trace(steps, 0.0, 2.0).factors["w"] == (1.0,) * 5 + (1.4,) * 5
    assert drift.speed_trace(steps, 0.0, 20.0).factors["w"] == (pytest.approx(1.2),)


def test_no_usable_step_gives_factor_one_and_bad_windows_are_refused():
    empty = drift.speed_trace(_steps([("w", 1.0, False, 1.3)]), 0.0)
    assert empty.factors == {} and empty("w", 3.0) == 1.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="window_s"):
            drift.speed_trace(_steps([]), 0.0, bad)


def test_origin_is_arrival_minus_scheduled_offset():
    records = [RequestRecord(f"colocated:1/s0-{i}", timeline={ARRIVED: 1000.0 + off})
               for i, off in enumerate([0.5, 1.25, 4.0])]
    assert drift.run_origin(records, [0.5, 1.25, 4.0]) == 1000.0
    with pytest.raises(ValueError, match="origin"):
        drift.run_origin([RequestRecord("x-5", timeline={ARRIVED: 1.0})], [0.0])
