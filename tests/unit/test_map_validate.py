"""``experiments.map_validate`` on hand-made real runs: a checked cell scored against them,
the same-schedule twins scored as one answer (the mean of their two runs), the placements
``--validate-placements contenders`` runs, the validation ladder and run sizes, and cells left
undecided at the ladder's top."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest

from engine.arrivals import arrival_times
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


def test_the_ladder_doubles_its_top_past_every_predicted_goodput_up_to_the_cap():
    base = [16, 8, 8, 32, 64, 128, 256]  # unsorted, a duplicate
    # 100 req/s predicted: 256 > 1.5 x 100 already
    assert map_validate.bracketing_rates(base, 100.0, 1024.0) == [8, 16, 32, 64, 128, 256]
    # 200: 256 <= 300, so 512 is added
    assert map_validate.bracketing_rates(base, 200.0, 1024.0)[-2:] == [256, 512]
    # 400: 512 <= 600, so 1024 too
    assert map_validate.bracketing_rates(base, 400.0, 1024.0)[-3:] == [256, 512, 1024]
    # 600 with a cap of 768: 512, then the cap itself (doubling would pass it), and no more
    assert map_validate.bracketing_rates(base, 600.0, 768.0)[-3:] == [256, 512, 768]
    assert map_validate.bracketing_rates(base, 5000.0, 768.0)[-1] == 768
    for rates, cap in (([], 10.0), ([0.0, 1.0], 10.0), ([1.0], 0.0)):
        with pytest.raises(ValueError, match="must be > 0"):
            map_validate.bracketing_rates(rates, 1.0, cap)


def test_a_runs_size_is_the_rate_over_the_window_between_the_floor_and_the_maps_run():
    assert map_validate.run_size(8.0, 4.0, 20, 300) == 32  # 8 req/s x 4 s
    assert map_validate.run_size(16.5, 4.0, 20, 300) == 66
    assert map_validate.run_size(256.0, 4.0, 20, 300) == 300  # 1024, the map's 300 at most
    assert map_validate.run_size(2.0, 4.0, 20, 300) == 20  # 8, the floor at least
    assert map_validate.run_size(2.0, 4.0, 20, 10) == 10  # the map's run bounds the floor too
    assert map_validate.run_size(0.1, 30.0, 1, 300) == 3  # not 4 from 3.0000000000000004
    for window, floor in ((0.0, 1), (1.0, 0)):
        with pytest.raises(ValueError):
            map_validate.run_size(1.0, window, floor, 10)


def test_a_shorter_run_has_the_first_arrivals_of_the_maps_run():
    """``run_size`` leans on this: n requests at a rate arrive as the first n of the map's."""
    for process, burstiness in (("poisson", 1.0), ("gamma", 0.5)):
        whole = arrival_times(300, 256.0, 7, process, burstiness)
        assert np.array_equal(arrival_times(20, 256.0, 7, process, burstiness), whole[:20])


# every placement met the SLO at both rates: each goodput is the top rate over 2 devices, 1.0
ALL_MET = _runs({"colocated:2": (OK, OK), "colocated-nochunk:2": (OK, OK),
                 "disagg:1p1d": (OK, OK)})


def test_a_cell_whose_placements_all_met_the_top_rate_is_undecided():
    row = map_validate.check_cells(_picked(""), PREDICTED, ALL_MET, [1.0], [0.1], FAMS).iloc[0]
    assert bool(row["undecided"]) and row["top_rate_req_s"] == 2.0
    assert row["met_at_top"] == "colocated:2; colocated-nochunk:2; disagg:1p1d"
    assert row["inside_rerun_noise"] is None
    # a met-at-top placement that is the sole measured first only grows: decided
    row = map_validate.check_cells(_picked(""), PREDICTED, RUNS, [1.0], [0.1], FAMS).iloc[0]
    assert (bool(row["undecided"]), row["met_at_top"]) == (False, "colocated-nochunk:2")


def test_the_summary_counts_undecided_cells_apart_from_agreements_and_disagreements():
    agree = map_validate.check_cells(_picked("colocated-nochunk:2"), PREDICTED, RUNS, [1.0],
                                     [0.1], FAMS)
    miss = map_validate.check_cells(_picked(""), PREDICTED, RUNS, [1.0], [0.1], FAMS)
    open_ = map_validate.check_cells(_picked(""), PREDICTED, ALL_MET, [1.0], [0.1], FAMS)
    miss["tpot_slo_s"], open_["tpot_slo_s"] = 0.2, 0.3  # three cells
    checked = pd.concat([agree, miss, open_], ignore_index=True)
    # through the CSV (an empty met_at_top reads back as NaN) the lines are the same
    read = pd.read_csv(io.StringIO(checked.to_csv(index=False)))
    for table in (checked, read):
        lines = map_validate.summary_lines(table, 0)
        # decided: agree (regret 0, tau 1) and miss (regret 0.5; tau over (colocated:2,
        # colocated-nochunk:2, disagg:1p1d): one concordant pair, one tie each side,
        # 1 / sqrt(2 x 2) = 0.5); family: the twins' family agrees, colocated:2's does not
        assert lines[0] == (
            "validated 3 cell(s) for real: top-1 agreement 50% of 2 decision(s) (and 1 "
            "undecided at the validation ladder's top, not counted); regret mean 25.0%, worst "
            "50.0% of the measured best goodput; Kendall tau 0.75; family agreement 50%")
        assert lines[1].startswith("  disagreement at io 4, TTFT 1 s, TPOT 0.2 s: mapped "
                                   "colocated:2 (colocated:2), measured colocated-nochunk:2")
        assert lines[2] == (
            "  undecided at the validation ladder's top at io 4, TTFT 1 s, TPOT 0.3 s: "
            "colocated:2, colocated-nochunk:2, disagg:1p1d met the SLO at 2 req/s (goodput a "
            "lower bound); mapped colocated:2, measured first colocated:2 = colocated-nochunk:2 "
            "= disagg:1p1d")
        assert len(lines) == 3
    line = map_validate.every_cell_line(checked, 0)
    assert "top-1 agreement 50% of 2 decision(s) (and 1 undecided" in line
    assert "; 1 disagreement(s), 0 cell(s)" in line
    only_open = map_validate.summary_lines(open_, 0)[0]
    assert only_open == ("validated 1 cell(s) for real: no decided decision (and 1 undecided "
                         "at the validation ladder's top, not counted); family agreement "
                         "undefined (no decided cell)")


def test_run_sizes_refuse_a_trace_or_a_multi_turn_workload():
    """A run of the first n requests needs arrivals drawn per rate: a trace (its own offsets)
    or a multi-turn workload (its conversations) is refused before anything deploys."""
    from experiments.replay import run_placement
    from experiments.workload_spec import MultiTurn, Timed

    for workload in (Timed([]), MultiTurn([])):
        with pytest.raises(ValueError, match="replay it whole"):
            run_placement("colocated:1", [1.0], {0: workload}, None, None, None, None,
                          "cpu:0", None, num_requests=lambda rate: 2)
