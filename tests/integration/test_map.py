"""``pdlab map`` end to end on the tiny model: a 2 x 2 map of 2 devices, with 2 cells checked
for real (workers in this process) and one rerun; every output is written, the map's cells
are the planner's, and the checked cells' figures are decision.figures' own. Bad ranges are
refused before anything runs."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from experiments import map_validate
from experiments.cli import main
from experiments.commands import map as map_cmd
from planner import decision, slo_map

PROFILE = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"
BASE = ["map", "--model", "tiny-random-llama", "--device-profile", str(PROFILE),
        "--io-ratio", "1", "--request-tokens", "16", "--max-model-len", "64",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--transport", "inprocess",
        "--num-rates", "3", "--num-requests", "30", "--jobs", "1"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores")
def test_map_2x2_with_validate_2(tmp_path, capsys):
    out = tmp_path / "map"
    code = main(BASE + ["--devices", "2", "--ttft-slo", "0.05:1:2", "--tpot-slo", "0.003:0.05:2",
                        "--local", "--validate", "2", "--validate-requests", "6",
                        "--validate-rates", "20,200", "--validate-window-s", "0.1",
                        "--validate-reruns", "1", "--out", str(out)])
    assert code == 0
    cells = pd.read_csv(out / "map.csv")
    assert list(cells.columns) == slo_map.CELL_COLUMNS
    assert len(cells) == 4
    assert sorted(cells["ttft_slo_s"].unique()) == [0.05, 1.0]
    assert sorted(cells["tpot_slo_s"].unique()) == [0.003, 0.05]
    # every cell names a verdict the planner gives, and margins come with winners
    assert set(cells["verdict"]) <= {slo_map.NONE, slo_map.NO_CLEAR, "colocated:2",
                                     "colocated-nochunk:2", "disagg:1p1d", "conditional:1p1d"}
    won = cells[cells["verdict"] != slo_map.NONE]
    assert (won["margin"].between(0, 1)).all()
    assert ((won["goodput_per_device_req_s"] - won["runner_up_goodput_per_device_req_s"])
            / won["goodput_per_device_req_s"] - won["margin"]).abs().max() < 1e-12
    checked = pd.read_csv(out / "map_validation.csv")
    assert len(checked) == 2
    # the corner (min, min) is checked first, then the next cell of pick_cells' order
    assert (checked.iloc[0]["ttft_slo_s"], checked.iloc[0]["tpot_slo_s"]) == (0.05, 0.003)
    assert checked["regret"].between(0, 1).all()
    # the tiny model's map meets every SLO at its top rate, 1400 req/s (a goodput of 1.4e3
    # req/s over 2 devices): the ladder doubles past 1.5 x that to the cap, twice the top;
    # a run has 0.1 s of arrivals, at least 6 requests and at most the map's 30
    printed = capsys.readouterr().out
    assert ("io 1: rates 20, 200, 400, 800, 1600, 2800 req/s (the top above 1.5 x the highest "
            "predicted goodput of the placements run, 1.4e+03 req/s, or at the cap 2800); "
            "requests per run 6, 20, 30, 30, 30, 30 (window 0.1 s, at least 6, at most 30)"
            ) in printed
    runs = pd.read_csv(out / "map_validation_runs.csv")
    # 4 placements x (6 + 20 + 4 x 30) requests x 2 passes (first run and one rerun)
    assert len(runs) == 4 * 146 * 2 and set(runs["pass"]) == {0, 1}
    assert runs.groupby(["candidate", "pass", "rate"]).size().unique().tolist() == [6, 20, 30]
    # every placement ran, so the same runs score every cell of the map too
    every = pd.read_csv(out / "map_validation_every_cell.csv")
    assert len(every) == 4 and set(every["ttft_slo_s"]) == {0.05, 1.0}
    merged = every.merge(checked, on=["ttft_slo_s", "tpot_slo_s"], suffixes=("", "_picked"))
    assert (merged["measured_goodput"] == merged["measured_goodput_picked"]).all()
    assert (out / "map_io1.png").stat().st_size > 0
    regions = (out / "regions.txt").read_text()
    assert "io ratio 1" in regions and "io 1: rates 20, 200" in regions
    # an undecided cell counts neither way: the figures are over the decided ones
    for head, table in (("validated 2 cell(s) for real", checked),
                        ("every cell of the map, scored from the same real runs", every)):
        decided = table[~table["undecided"]]
        undecided = len(table) - len(decided)
        more = (f" (and {undecided} undecided at the validation ladder's top, not counted)"
                if undecided else "")
        assert (f"{head}: top-1 agreement {100 * decided['top1_agrees'].mean():.0f}% of "
                f"{len(decided)} decision(s){more}" if len(decided) else
                f"{head}: no decided decision{more}") in printed
    # the printed mean is map_validation.csv's, formatted as summary_line does (a numeric
    # compare within 0.05 failed at 11.25 printed as 11.2); the CSV's 3-digit goodput
    # texts move a regret by < 1e-3
    decided = checked[~checked["undecided"]]
    if len(decided):
        mean = decision.figures(map_validate.decision_table(checked))[1]["regret_mean"]
        assert abs(mean - decided["regret"].mean()) < 1e-3
        assert f"regret mean {100 * mean:.1f}%" in printed


@pytest.mark.parametrize("option, value, words", [
    ("--ttft-slo", "4:0.1:8", "MIN must be <= MAX"),
    ("--tpot-slo", "0.01:0.2:0", "STEPS must be >= 1"),
    ("--ttft-slo", "-1:2:3", "> 0"),
    ("--io-ratio", "1,0", "io ratios"),
])
def test_bad_ranges_are_refused_before_anything_runs(tmp_path, capsys, option, value, words):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as err:
        main(BASE + ["--devices", "2", f"{option}={value}", "--out", str(out)])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert f"argument {option}:" in message and words in message
    assert not out.exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores")
def test_a_stopped_validation_keeps_the_maps_files(tmp_path, monkeypatch):
    """The map's own files are written before its validation runs (minutes to hours of
    real runs): stopped there, they are all on disk."""
    def stop(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(map_cmd, "_validate", stop)
    out = tmp_path / "map"
    with pytest.raises(KeyboardInterrupt):
        main(BASE + ["--devices", "2", "--ttft-slo", "0.05:1:2", "--tpot-slo", "0.003:0.05:2",
                     "--local", "--validate", "1", "--out", str(out)])
    assert sorted(f.name for f in out.iterdir()) == ["map.csv", "map.md", "map_io1.png",
                                                      "map_runs.csv", "regions.txt"]
    assert (out / "regions.txt").read_text().startswith("pdlab map: tiny-random-llama on 2")


LLAMA_PROFILE = Path(__file__).resolve().parents[1] / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json"


def test_map_validates_on_emulated_h100s(tmp_path, capsys):
    """``--validate-on emu``: one cell of a 2-device Llama-3.1-8B H100 map checked on
    ``emu:0-1`` (workers in this process, 4 requests a run): every output says
    emulated, and every real request's TPOT is at least the profile's smallest step
    intercept (the mixed model's 5.54 ms: an emulated step is never shorter than modelled).
    ``--validate-placements contenders`` runs each family's best: at 2 devices every family
    has one placement, so all 4 run, and the summary says which were run."""
    out = tmp_path / "map"
    code = main(["map", "--model", "engine/configs/llama-3.1-8b", "--dtype", "bfloat16",
                 "--device-profile", str(LLAMA_PROFILE), "--io-ratio", "1",
                 "--request-tokens", "64", "--max-model-len", "256", "--max-num-seqs", "16",
                 "--transport", "inprocess", "--local", "--num-rates", "3",
                 "--num-requests", "20", "--jobs", "1", "--devices", "2",
                 "--ttft-slo", "0.05:1:2", "--tpot-slo", "0.01:0.1:2", "--validate", "1",
                 "--validate-on", "emu", "--validate-requests", "4", "--validate-rates", "20",
                 "--validate-window-s", "0.005", "--validate-placements", "contenders",
                 "--out", str(out)])
    assert code == 0
    checked = pd.read_csv(out / "map_validation.csv")
    assert len(checked) == 1 and checked["emulated"].all()
    assert set(checked["devices"]) == {"emu:0,emu:1"}
    runs = pd.read_csv(out / "map_validation_runs.csv")
    # colocated:2, colocated-nochunk:2, disagg:1p1d, conditional:1p1d x 6 rates x 4 requests:
    # 20 req/s doubled past 1.5 x the map's top goodput (its top rate, 280 req/s) to the cap
    # of twice that; 0.005 s of arrivals is under the 4 requests of the floor at every rate
    assert sorted(runs["rate"].unique()) == [20, 40, 80, 160, 320, 560]
    assert len(runs) == 4 * 6 * 4 and runs["lateness_p99"].ge(1.0).all()
    assert runs["tpot_s"].gt(0.00554).all()
    printed = capsys.readouterr().out
    assert "validating 1 cell(s) for real on emulated devices (emu:0,emu:1: h100_sxm" in printed
    assert "io 1: 4 of 4 placements (contenders)" in printed
    assert "KV x 0.00390625" in printed and "emulated steps' lateness p99" in printed
    md = (out / "map.md").read_text()
    assert "## Checked against real runs on emulated devices" in md
    # 4-request runs are bursts every placement may meet: the cell may be undecided
    head = ("validated 1 cell(s) on emulated devices, each family's best placement per cell "
            "(--validate-placements contenders): ")
    assert f"{head}top-1 agreement 100% of 1" in md or f"{head}top-1 agreement 0% of 1" in md \
        or f"{head}no decided decision (and 1 undecided at the validation ladder's top" in md
