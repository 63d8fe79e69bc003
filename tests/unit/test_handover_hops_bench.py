"""benchmarks.handover_hops at a tiny size: the CSV's columns, every hand-over of both
paths received, and the difference row and percentages computed from the paths' rows."""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks import handover_hops


def test_both_paths_deliver_every_hand_over_and_the_difference_adds_up(tmp_path):
    handover_hops.main(["--n", "20", "--warmup", "4", "--gap-ms", "0.5", "--cores", "any,any,any",
                        "--prompt-len", "16", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "handover_hops.csv").set_index("path")
    assert ["path", *table.columns] == handover_hops.COLUMNS
    assert list(table.index) == ["one_hop", "two_hops", "difference"]
    assert (table["sent"] == 20).all() and (table["received"] == 20).all()
    for q in ("p50_us", "p99_us", "mean_us"):
        assert table.loc["difference", q] == pytest.approx(
            table.loc["two_hops", q] - table.loc["one_hop", q])
    for step_ms in (5, 8):
        assert table[f"p99_pct_of_{step_ms}ms"].to_list() == pytest.approx(
            (table["p99_us"] / (step_ms * 1000) * 100).to_list())
