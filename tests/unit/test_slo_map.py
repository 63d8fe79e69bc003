"""planner.slo_map and planner.decision on hand-built planner results and hand-made tables:
the re-scored attainment, the goodput grid, the cells (winner, runner-up, margin, "no clear
winner" exactly where the speed bands overlap), the region text, the validated cells' pick,
and top-1 / regret / Kendall tau."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from engine import metrics as m
from planner import decision, slo_map


# ---- ranges and lengths ------------------------------------------------------------------
def test_parse_range_is_geometric_with_both_ends():
    assert slo_map.parse_range("0.1:10:3") == (0.1, 1.0, 10.0)
    assert slo_map.parse_range("2:2:1") == (2.0,)
    assert slo_map.parse_range("0.01:0.04:3") == (0.01, 0.02, 0.04)


@pytest.mark.parametrize("text, words", [
    ("4:0.1:8", "MIN must be <= MAX"), ("0.1:4:0", "STEPS must be >= 1"),
    ("-0.1:4:8", "MIN must be a number of seconds > 0"), ("0:4:8", "> 0"),
    ("0.1:4", "MIN:MAX:STEPS"), ("0.1:4:2.5", "MIN:MAX:STEPS"), ("0.1:4:1", "one step"),
    ("a:b:c", "MIN:MAX:STEPS")])
def test_parse_range_refuses_bad_ranges(text, words):
    with pytest.raises(ValueError, match=words):
        slo_map.parse_range(text, "--ttft-slo")


def test_parse_ratios_and_lengths():
    assert slo_map.parse_ratios("0.25,1,4") == (0.25, 1.0, 4.0)
    for bad in ("", "0", "1,1", "-1", "x"):
        with pytest.raises(ValueError):
            slo_map.parse_ratios(bad)
    # 256 tokens at 1:4 -> prompt round(51.2) = 51, output 205; each 0.5x-1.5x its mean
    assert slo_map.ratio_lengths(0.25, 256) == ("26-76", "102-308")
    assert slo_map.ratio_lengths(1.0, 32) == ("8-24", "8-24")


def test_families_and_candidates():
    labels = [c.label for c in slo_map.map_candidates(3)]
    assert labels == ["colocated:3", "colocated-nochunk:3", "disagg:1p1d", "disagg:1p2d",
                      "disagg:2p1d", "conditional:1p1d", "conditional:1p2d", "conditional:2p1d"]
    assert [slo_map.family_of(p) for p in ("colocated-nochunk:2", "colocated:2", "disagg:1p1d",
                                           "conditional:1p1d")] == list(slo_map.FAMILIES)


# ---- re-scoring one run at every cell ------------------------------------------------------
def test_attainment_counts_both_targets():
    ttft = np.array([0.5, 1.5, math.inf, 0.2])  # the third failed
    tpot = np.array([0.05, 0.01, 0.0, 0.2])
    got = slo_map.attainment(ttft, tpot, [1.0, 2.0], [0.1, 0.3])
    # TTFT <= 1: requests 0, 3; TTFT <= 2: 0, 1, 3. TPOT <= 0.1: 0, 1, 2; <= 0.3: all
    assert got.tolist() == [[0.25, 0.5], [0.5, 0.75]]


def _runs(curves: dict[str, tuple[int, list[float], list[tuple[list, list]]]]) -> pd.DataFrame:
    """A hand-built sweep: label -> (devices, rates, per rate (ttfts, tpots))."""
    rows = []
    for label, (n, rates, runs) in curves.items():
        for rate, (t, p) in zip(rates, runs):
            rows.append({"candidate": label, "num_devices": n, "rate": rate, "seed": 0,
                         "ttft_s_all": np.array(t, float), "tpot_s_all": np.array(p, float)})
    return pd.DataFrame(rows)


def test_goodput_grid_is_distserve_goodput_per_cell():
    runs = _runs({
        # colocated: fast first tokens, slow decode once loaded
        "colocated:2": (2, [1.0, 2.0, 4.0], [([0.1] * 10, [0.05] * 10),
                                             ([0.1] * 10, [0.15] * 10),
                                             ([0.3] * 10, [0.3] * 10)]),
        # disagg: slower first tokens, steady decode
        "disagg:1p1d": (2, [1.0, 2.0, 4.0], [([0.5] * 10, [0.05] * 10),
                                             ([0.5] * 10, [0.05] * 10),
                                             ([0.5] * 9 + [5.0], [0.05] * 10)]),
    })
    g = slo_map.goodput_grid(runs, [0.2, 1.0], [0.1, 0.5])
    # colocated at TTFT<=0.2: rate 1 passes TPOT<=0.1 only (rate 2 has TPOT .15); TPOT<=0.5:
    # rates 1, 2 pass (rate 4 TTFT 0.3 > 0.2). TTFT<=1: TPOT .1 -> 1; TPOT .5 -> all 3.
    assert g["colocated:2"].tolist() == [[0.5, 1.0], [0.5, 2.0]]
    # disagg misses TTFT<=0.2 everywhere; TTFT<=1: rate 4 has 90% -> passes (>= 90%)
    assert g["disagg:1p1d"].tolist() == [[0.0, 0.0], [2.0, 2.0]]
    # the same as engine.metrics.goodput_rate on one cell's curve
    assert g["disagg:1p1d"][1, 0] == m.goodput_rate([1, 2, 4], [1.0, 1.0, 0.9], 2)


# ---- cells from a hand-built planner result -------------------------------------------------
FAMS = {"colocated:2": "colocated chunked", "colocated-nochunk:2": "colocated",
        "disagg:1p1d": "disagg", "disagg:1p2d": "disagg"}


def _grid(values):
    return np.array(values, dtype=float).reshape(1, len(values))  # 1 TTFT x n TPOT


def test_cells_winner_runner_up_margin():
    goodput = {"colocated:2": _grid([1.0, 0.5, 0.0]), "colocated-nochunk:2": _grid([0.8, 0.4, 0.0]),
               "disagg:1p1d": _grid([0.5, 1.0, 0.0]), "disagg:1p2d": _grid([0.2, 1.5, 0.0])}
    t = slo_map.cells(goodput, FAMS, [1.0], [0.1, 0.2, 0.3], 1.0)
    assert list(t.columns) == slo_map.CELL_COLUMNS
    a, b, c = t.to_dict("records")
    assert (a["verdict"], a["winner_family"], a["runner_up"]) == ("colocated:2", "colocated chunked",
                                                                  "colocated-nochunk:2")
    assert a["margin"] == pytest.approx(0.2) and a["clear"]
    # disagg's best is 1p2d (1.5); the runner-up family is colocated chunked (0.5)
    assert (b["winner"], b["runner_up"], b["goodput_per_device_req_s"]) == ("disagg:1p2d", "colocated:2", 1.5)
    assert b["margin"] == pytest.approx(2 / 3)
    assert c["verdict"] == slo_map.NONE and not c["clear"] and math.isnan(c["margin"])
    assert slo_map.contenders(t) == ["colocated:2", "disagg:1p2d", "colocated-nochunk:2"]


def test_no_clear_winner_exactly_where_the_bands_overlap():
    goodput = {"colocated:2": _grid([1.0, 1.0, 1.0, 1.0]), "disagg:1p1d": _grid([0.9, 0.9, 0.9, 1.0])}
    fams = {"colocated:2": "colocated chunked", "disagg:1p1d": "disagg"}
    # winner slow vs runner-up fast: 0.95 > 0.94 separates; 0.9 vs 0.9 touches (overlap);
    # 0.8 < 0.99 overlaps; the last is a nominal tie (no band there either way)
    slow = {"colocated:2": _grid([0.95, 0.9, 0.8, 0.9])}
    fast = {"disagg:1p1d": _grid([0.94, 0.9, 0.99, 1.1])}
    t = slo_map.cells(goodput, fams, [1.0], [0.1, 0.2, 0.3, 0.4], 1.0, slow, fast)
    assert t["clear"].tolist() == [True, False, False, False]
    assert t["verdict"].tolist() == ["colocated:2"] + [slo_map.NO_CLEAR] * 3
    # without a band, only the exact tie is no clear winner
    plain = slo_map.cells(goodput, fams, [1.0], [0.1, 0.2, 0.3, 0.4], 1.0)
    assert plain["clear"].tolist() == [True, True, True, False]


def test_same_schedule_twins_tied_are_one_answer():
    from planner import search
    from engine.config import EngineConfig
    cands = slo_map.map_candidates(2)
    engine = EngineConfig(max_num_batched_tokens=512)
    twins = slo_map.same_schedule(cands, engine, 512)
    assert twins == {"colocated:2": "colocated-nochunk:2", "colocated-nochunk:2": "colocated:2"}
    assert slo_map.same_schedule(cands, engine, 513) == {}  # a prompt past the budget splits
    assert slo_map.same_schedule([search.Candidate("colocated:2")], engine, 10) == {}
    goodput = {"colocated:2": _grid([1.0, 1.0, 1.0]), "colocated-nochunk:2": _grid([1.0, 0.9, 0.0]),
               "disagg:1p1d": _grid([0.5, 0.5, 0.0])}
    t = slo_map.cells(goodput, FAMS, [1.0], [0.1, 0.2, 0.3], 1.0, twins=twins)
    a, b, c = t.to_dict("records")
    # cell 0: the exact tie is one schedule: the runner-up is disagg, and the cell is clear
    assert (a["winner"], a["same_schedule_as"], a["runner_up"], a["clear"]) == \
        ("colocated:2", "colocated-nochunk:2", "disagg:1p1d", True)
    assert a["margin"] == pytest.approx(0.5)
    # cell 1: not tied, the twin is an ordinary runner-up
    assert (b["same_schedule_as"], b["runner_up"], b["margin"]) == ("", "colocated-nochunk:2",
                                                                     pytest.approx(0.1))
    # cell 2: the twin met nothing (0 < 1): no tie, it is the runner-up (first of the 0s)
    assert (c["same_schedule_as"], c["runner_up"], c["margin"]) == ("", "colocated-nochunk:2", 1.0)
    # without twins the tie at cell 0 stays "no clear winner"
    plain = slo_map.cells(goodput, FAMS, [1.0], [0.1, 0.2, 0.3], 1.0)
    assert plain.loc[0, "verdict"] == slo_map.NO_CLEAR
    lines = slo_map.regions(t, [1.0], [0.1, 0.2, 0.3])
    assert lines[0] == ("colocated chunked (colocated:2) wins (tied with colocated-nochunk:2 in 1 "
                        "cells: every prompt fits the chunk budget, one schedule) everywhere on the map")


def test_winner_at_the_sweep_top_is_flagged():
    # top rate 4 req/s: 2 req/s per device on 2 devices
    goodput = {"colocated:2": _grid([2.0, 1.0]), "disagg:1p1d": _grid([1.0, 1.5])}
    fams = {"colocated:2": "colocated chunked", "disagg:1p1d": "disagg"}
    top = {"colocated:2": 2.0, "disagg:1p1d": 2.0}
    t = slo_map.cells(goodput, fams, [1.0], [0.1, 0.2], 1.0, top=top)
    assert t["at_sweep_top"].tolist() == [True, False]
    assert slo_map.regions(t, [1.0], [0.1, 0.2])[:2] == [
        "colocated chunked (colocated:2) wins (all of these cells at the top swept rate, where "
        "goodput is only a lower bound: sweep higher --rates before trusting the win) when "
        "TPOT = 0.1 s", "disagg (disagg:1p1d) wins when TPOT = 0.2 s"]
    assert slo_map.regions(t, [1.0], [0.1, 0.2])[2] == (
        "the winner met the SLO at the top swept rate (goodput a lower bound: sweep higher "
        "--rates) when TPOT = 0.1 s")
    assert not slo_map.cells(goodput, fams, [1.0], [0.1, 0.2], 1.0)["at_sweep_top"].any()


# ---- region text ------------------------------------------------------------------------------
def _square_map(verdicts: list[list[str]]) -> pd.DataFrame:
    """cells of a hand-made map: verdicts[i][j] at TTFT index i, TPOT index j."""
    fam = {"C": "colocated chunked", "D": "disagg"}
    rows = []
    for i, line in enumerate(verdicts):
        for j, v in enumerate(line):
            clear = v in fam
            rows.append({"io_ratio": 1.0, "ttft_index": i, "tpot_index": j, "clear": clear,
                         "verdict": {"C": "colocated:4", "D": "disagg:1p3d", "?": slo_map.NO_CLEAR,
                                     "-": slo_map.NONE}[v],
                         "winner_family": fam.get(v, slo_map.NONE if v == "-" else "disagg"),
                         "winner": {"C": "colocated:4", "D": "disagg:1p3d", "?": "disagg:1p3d",
                                    "-": ""}[v], "runner_up": "", "margin": 0.5,
                         "at_sweep_top": False, "same_schedule_as": ""})
    return pd.DataFrame(rows)


def test_region_text():
    ttft, tpot = [0.1, 1.0, 4.0], [0.01, 0.05, 0.2]
    # rows: TTFT 0.1, 1, 4; columns: TPOT 0.01, 0.05, 0.2
    t = _square_map([["-", "C", "C"],
                     ["D", "?", "C"],
                     ["D", "D", "C"]])
    assert slo_map.regions(t, ttft, tpot) == [
        "colocated chunked (colocated:4) wins in 4 of the 6 cells where TPOT >= 0.05 s",
        "disagg (disagg:1p3d) wins in 3 of the 4 cells where TPOT <= 0.05 s and TTFT >= 1 s",
        "no clear winner (the speed bands overlap) when TPOT = 0.05 s and TTFT = 1 s",
        "nothing meets the SLO at the lowest swept rate when TPOT = 0.01 s and TTFT = 0.1 s"]
    whole = _square_map([["D", "D"], ["D", "D"]])
    assert slo_map.regions(whole, [1, 2], [1, 2]) == ["disagg (disagg:1p3d) wins everywhere on the map"]
    corner = _square_map([["C", "C"], ["D", "C"]])
    assert slo_map.regions(corner, [1, 2], [0.1, 0.2])[1] == \
        "disagg (disagg:1p3d) wins when TPOT = 0.1 s and TTFT = 2 s"


def test_pick_cells_corners_then_boundary_round_robin():
    t = _square_map([["C", "C", "C"], ["C", "C", "D"], ["C", "C", "D"]])
    two = pd.concat([t, t.assign(io_ratio=4.0)], ignore_index=True)
    got = slo_map.pick_cells(two, 4)
    # per ratio: corner (0,0), the first boundary cell (0,2) (its neighbour (1,2) is D),
    # corner (2,2), boundary (1,1), ...; the ratios alternate
    assert list(zip(got["io_ratio"], got["ttft_index"], got["tpot_index"])) == [
        (1.0, 0, 0), (4.0, 0, 0), (1.0, 0, 2), (4.0, 0, 2)]
    six = slo_map.pick_cells(t, 6)
    assert list(zip(six["ttft_index"], six["tpot_index"])) == [(0, 0), (0, 2), (2, 2), (1, 1),
                                                                (2, 1), (2, 0)]
    assert len(slo_map.pick_cells(t, 100)) == 9
    with pytest.raises(ValueError):
        slo_map.pick_cells(t, 0)


# ---- decision figures on a hand-made table ------------------------------------------------------
def test_kendall_tau_b():
    assert decision.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert decision.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    # pairs: (1,2) concordant, (1,3) concordant, (2,3) tied in y: (2 - 0) / sqrt(3 * 2)
    assert decision.kendall_tau([1, 2, 3], [1, 2, 2]) == pytest.approx(2 / math.sqrt(6))
    assert math.isnan(decision.kendall_tau([1], [1]))
    assert math.isnan(decision.kendall_tau([1, 2], [5, 5]))


def test_top1_and_regret_on_a_hand_made_table():
    table = pd.DataFrame([
        # cell a: planner picks D (1.2), measured best is C (1.0); D measured 0.8 -> regret 20%;
        # tau: (C, D) discordant, (C, N) and (D, N) concordant -> (2 - 1) / 3
        ("a", "C", 1.0, 1.0), ("a", "D", 1.2, 0.8), ("a", "N", 0.1, 0.5),
        # cell b: planner's first is the measured first
        ("b", "C", 2.0, 1.5), ("b", "D", 1.0, 1.0), ("b", "N", 0.5, 0.2),
        # cell c: measured tie at the top accepts the planner's first
        ("c", "C", 0.3, 0.4), ("c", "D", 0.2, 0.4), ("c", "N", 0.0, 0.0),
    ], columns=["cell", "placement", "predicted", "measured"])
    per_cell, s = decision.figures(table)
    assert per_cell["top1_agrees"].tolist() == [False, True, True]
    assert per_cell["regret"].tolist() == pytest.approx([0.2, 0.0, 0.0])
    assert per_cell["measured_first"].tolist() == ["C", "C", "C = D"]
    assert per_cell["kendall_tau"].tolist() == pytest.approx([1 / 3, 1.0, 2 / math.sqrt(6)])
    assert s["top1_agreement"] == pytest.approx(2 / 3)
    assert s["regret_mean"] == pytest.approx(0.2 / 3) and s["regret_max"] == pytest.approx(0.2)
    assert "top-1 agreement 67% of 3" in decision.summary_line(s)
    with pytest.raises(ValueError):
        decision.figures(table.iloc[0:0])


def test_a_lower_bound_that_could_overtake_the_measured_first_leaves_a_decision_undecided():
    pred = {"A": 2.0, "B": 1.0, "C": 0.5}
    meas = {"A": 1.5, "B": 2.0, "C": 1.0}
    # B is a lower bound and the sole measured first: it only grows, A still misses
    d = decision.decide(pred, meas, {"B"})
    assert (d["undecided"], d["top1_agrees"], d["regret"]) == (False, False, 0.25)
    assert decision.decide(pred, meas)["undecided"] is False
    # C is a lower bound below the first: it may overtake B
    assert decision.decide(pred, meas, {"C"})["undecided"] is True
    # a tie at the top where one of the tied is a lower bound: it may pull ahead
    assert decision.decide(pred, {"A": 2.0, "B": 2.0, "C": 1.0}, {"B"})["undecided"] is True
    assert decision.decide(pred, {"A": 1.0, "B": 1.0, "C": 1.0}, set(pred))["undecided"] is True


def test_undecided_cells_are_left_out_of_the_figures():
    table = pd.DataFrame([
        # a: agrees (regret 0, tau 1); b: misses (regret (2 - 1) / 2, tau -1)
        ("a", "A", 2.0, 2.0, False), ("a", "B", 1.0, 1.0, False),
        ("b", "A", 2.0, 1.0, False), ("b", "B", 1.0, 2.0, False),
        # c: would miss as b does, but A's 1.0 is a lower bound: undecided
        ("c", "A", 2.0, 1.0, True), ("c", "B", 1.0, 2.0, False),
    ], columns=["cell", "placement", "predicted", "measured", "lower_bound"])
    per_cell, s = decision.figures(table)
    assert per_cell["undecided"].tolist() == [False, False, True]
    assert (s["num_cells"], s["num_undecided"]) == (3, 1)
    assert (s["top1_agreement"], s["regret_mean"], s["regret_max"]) == (0.5, 0.25, 0.5)
    assert s["kendall_tau_mean"] == 0.0
    assert decision.summary_line(s) == (
        "top-1 agreement 50% of 2 decision(s) (and 1 undecided, not counted); regret mean "
        "25.0%, worst 50.0% of the measured best goodput; Kendall tau 0.00")
    # without the column every cell counts
    assert decision.figures(table.drop(columns="lower_bound"))[1]["num_undecided"] == 0
    _, none = decision.figures(table[table["cell"] == "c"])
    assert decision.summary_line(none, "open") == "no decided decision (and 1 open, not counted)"


def test_plan_validation_summary_carries_the_decision_figures():
    from experiments import validate
    errors = pd.DataFrame({"attainment_err_points": [2.0, -4.0], **{
        f"{c.removesuffix('_s')}_rel_err": [0.1, -0.1] for c in validate.LATENCIES}})
    # simulated ranks A > B > C; measured B (2.0) > A (1.5) > C (0.5): regret (2 - 1.5) / 2
    s = validate.validation_summary(errors, {"A": 1.5, "B": 2.0, "C": 0.5},
                                    {"A": 3.0, "B": 2.0, "C": 1.0})
    assert not s["first_agrees"] and s["regret"] == pytest.approx(0.25)
    assert s["kendall_tau"] == pytest.approx(1 / 3)  # (A,B) discordant, (A,C), (B,C) concordant
    text = validate.summary_text(s)
    assert "regret 25.0% of the measured best goodput, Kendall tau over placements 0.33" in text
