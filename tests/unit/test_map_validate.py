"""``experiments.map_validate`` on hand-made real runs: a checked cell scored against them,
the same-schedule twins scored as one answer (the mean of their two runs), and the
placements ``--validate-placements contenders`` runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments import map_validate

FAMS = {"colocated:2": "colocated chunked", "colocated-nochunk:2": "colocated",
        "disagg:1p1d": "disagg", "disagg:1p2d": "disagg", "conditional:1p1d": "conditional"}
OK, LATE = (0.5, 0.05), (2.0, 0.05)  # (TTFT, TPOT) s of a request against SLO (1 s, 0.1 s)


def _runs(outcomes: dict[str, tuple]) -> pd.DataFrame:
    """One pass of real runs at rates 1 and 2 req/s on 2 devices, 4 requests each, every
    request of a run with the (TTFT, TPOT) given per rate."""
    rows = []
    for label, per_rate in outcomes.items():
        for rate, (ttft, tpot) in zip((1.0, 2.0), per_rate):
            rows.append({"pass": 0, "candidate": label, "placement": label, "num_devices": 2,
                         "rate": rate, "seed": 0, "ttft_s_all": np.full(4, ttft),
                         "tpot_s_all": np.full(4, tpot), "lateness_p99": np.nan})
    return pd.DataFrame(rows)


def _picked(twin: str) -> pd.DataFrame:
    return pd.DataFrame([{"io_ratio": 4.0, "ttft_slo_s": 1.0, "tpot_slo_s": 0.1,
                          "ttft_index": 0, "tpot_index": 0, "verdict": "colocated:2",
                          "winner": "colocated:2", "same_schedule_as": twin}])


# measured goodput per device: colocated:2 met 1 req/s only (0.5), its twin both (1.0),
# disagg:1p1d 1 req/s only (0.5); the map predicted the twins tied at 1.0
RUNS = _runs({"colocated:2": (OK, LATE), "colocated-nochunk:2": (OK, OK),
              "disagg:1p1d": (OK, LATE)})
PREDICTED = {"colocated:2": np.array([[1.0]]), "colocated-nochunk:2": np.array([[1.0]]),
             "disagg:1p1d": np.array([[0.5]])}


def test_a_cell_without_twins_scores_each_placement():
    row = map_validate.check_cells(_picked(""), PREDICTED, RUNS, [1.0], [0.1], FAMS).iloc[0]
    assert (row["mapped"], row["measured_first"], bool(row["top1_agrees"])) == \
        ("colocated:2", "colocated-nochunk:2", False)
    assert row["regret"] == pytest.approx(0.5)  # (1.0 - 0.5) / 1.0
    assert row["measured_goodput"] == "colocated:2=0.5; colocated-nochunk:2=1; disagg:1p1d=0.5"


def test_same_schedule_twins_are_one_answer_with_the_mean_of_their_runs():
    row = map_validate.check_cells(_picked("colocated-nochunk:2"), PREDICTED, RUNS, [1.0],
                                   [0.1], FAMS).iloc[0]
    pair = "colocated:2 / colocated-nochunk:2"
    assert (row["mapped"], row["measured_first"], bool(row["top1_agrees"])) == (pair, pair, True)
    assert row["regret"] == 0.0 and bool(row["family_agrees"])
    assert row["measured_goodput"] == f"{pair}=0.75; disagg:1p1d=0.5"  # (0.5 + 1.0) / 2
    # the decision table reads the merged label back (it holds " / ", not "=")
    table = map_validate.decision_table(pd.DataFrame([row]))
    assert table[["placement", "predicted", "measured"]].values.tolist() == \
        [[pair, 1.0, 0.75], ["disagg:1p1d", 0.5, 0.5]]
    # a twin that did not run leaves the cell as it was
    alone = RUNS[RUNS["candidate"] != "colocated-nochunk:2"]
    row = map_validate.check_cells(_picked("colocated-nochunk:2"), PREDICTED, alone, [1.0],
                                   [0.1], FAMS).iloc[0]
    assert (row["mapped"], bool(row["top1_agrees"])) == ("colocated:2", True)


def test_goodput_text_keeps_what_tells_placements_apart():
    """Two placements 0.2% apart stay apart through the check table's text (at 3 digits
    both read 1.23, and the summary then called them tied)."""
    goodput = {"colocated:2 / colocated-nochunk:2": 1.2341, "disagg:1p1d": 1.2316, "x": 1 / 3}
    text = map_validate.goodput_text(goodput)
    assert text == "colocated:2 / colocated-nochunk:2=1.2341; disagg:1p1d=1.2316; x=0.333333"
    assert map_validate.parse_goodput(text) == pytest.approx(goodput, rel=1e-6)


def test_one_schedule_merges_per_pass():
    pred, per_pass, name = map_validate.one_schedule(
        {"A": 2.0, "B": 2.0, "C": 1.0},
        [{"A": 1.0, "B": 3.0, "C": 0.0}, {"A": 2.0, "B": 2.0, "C": 5.0}], "A", "B")
    assert name == "A / B" and pred == {"A / B": 2.0, "C": 1.0}
    assert per_pass == [{"A / B": 2.0, "C": 0.0}, {"A / B": 2.0, "C": 5.0}]
    unchanged = ({"A": 1.0}, [{"A": 1.0}], "A")
    assert map_validate.one_schedule({"A": 1.0}, [{"A": 1.0}], "A", "") == unchanged


def test_contenders_are_each_familys_best_per_checked_cell_and_the_twin():
    predicted = {"colocated:2": np.array([[3.0, 1.0]]),
                 "colocated-nochunk:2": np.array([[3.0, 1.0]]),
                 "disagg:1p1d": np.array([[1.0, 2.0]]), "disagg:1p2d": np.array([[2.0, 1.0]]),
                 "conditional:1p1d": np.array([[0.0, 0.0]])}
    cell0 = pd.DataFrame([{"ttft_index": 0, "tpot_index": 0, "same_schedule_as": ""}])
    assert map_validate.contenders(cell0, predicted, FAMS) == [
        "colocated:2", "colocated-nochunk:2", "disagg:1p2d", "conditional:1p1d"]
    both = pd.DataFrame([{"ttft_index": 0, "tpot_index": j, "same_schedule_as": ""}
                         for j in (0, 1)])
    assert map_validate.contenders(both, predicted, FAMS) == list(predicted)
    # a twin of another family is kept even where it is not its family's best
    fams = {**FAMS, "colocated-nochunk:2": "colocated chunked"}
    twin = pd.DataFrame([{"ttft_index": 0, "tpot_index": 0,
                          "same_schedule_as": "colocated-nochunk:2"}])
    assert "colocated-nochunk:2" in map_validate.contenders(twin, predicted, fams)


def test_every_cell_line_counts_disagreements_and_sweep_top_cells():
    agree = map_validate.check_cells(_picked("colocated-nochunk:2"), PREDICTED, RUNS, [1.0],
                                     [0.1], FAMS)
    miss = map_validate.check_cells(_picked(""), PREDICTED, RUNS, [1.0], [0.1], FAMS)
    miss["tpot_slo_s"] = 0.2  # another cell
    line = map_validate.every_cell_line(pd.concat([agree, miss], ignore_index=True), 1)
    assert line.startswith("every cell of the map, scored from the same real runs: top-1 "
                           "agreement 50% of 2 decision(s); regret mean 25.0%, worst 50.0%")
    assert line.endswith("; 1 disagreement(s), 1 cell(s) at the sweep's top "
                         "(map_validation_every_cell.csv)")
