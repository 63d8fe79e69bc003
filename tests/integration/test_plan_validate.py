"""``pdlab plan``'s validation on the tiny model: the same requests run for real (workers in
this process) and simulated at two rates; the per-point error figures are computed and
written, both results directories are complete, and the measured report overlays the
simulated curve. (The accuracy target is a benchmark, not this test.)"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.metrics import SLO
from experiments.workload_spec import WorkloadSpec
from planner import search
from experiments import validate
from planner.latency import DeviceProfile

PROFILE = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"


def test_validation_writes_per_point_errors(tmp_path):
    profile = DeviceProfile.load(PROFILE)
    two = len(os.sched_getaffinity(0)) >= 2
    cands = [search.Candidate("colocated:1")] + ([search.Candidate("disagg:1p1d")] if two else [])
    spec = WorkloadSpec(dataset="synthetic", num_requests=6, seeds=1, prompt_len="4-30",
                        output_len="3-6")
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    transfer = TransferConfig(transport="inprocess")
    errors, summary = validate.validate(
        cands, [5.0, 50.0], spec, ModelConfig("tiny-random-llama"), engine, transfer, profile,
        profile.transfer("inprocess"), SLO(ttft_s=1.0, tpot_s=0.5), tmp_path,
        devices="cpu:0,cpu:1" if two else "cpu:0", local=True, speed_spread=0.2, num_reruns=1)
    written = pd.read_csv(tmp_path / "validation.csv")
    assert list(written.columns) == (validate.COLUMNS + validate.OUTCOME_COLUMNS
                                     + validate.REPLAY_COLUMNS + validate.BAND_COLUMNS
                                     + validate.RERUN_COLUMNS)
    assert len(written) == 2 * len(cands)
    assert set(zip(written["placement"], written["rate"])) == {
        (c.placement, r) for c in cands for r in (5.0, 50.0)}
    for col in ("attainment_err_points", "ttft_p50_rel_err", "ttft_p99_rel_err",
                "tpot_p50_rel_err", "tpot_p99_rel_err"):
        assert written[col].map(math.isfinite).all(), col
    row = written.iloc[0]
    assert row["attainment_err_points"] == 100 * (row["simulated_attainment"] - row["measured_attainment"])
    assert row["ttft_p50_rel_err"] == (row["simulated_ttft_p50_s"] - row["measured_ttft_p50_s"]) / row["measured_ttft_p50_s"]
    assert summary["num_points"] == len(written)
    assert summary["attainment_mae_points"] == written["attainment_err_points"].abs().mean()
    assert summary["measured_first"] in {c.placement for c in cands}
    assert "mean abs error" in validate.summary_text(summary)
    assert (written["num_requests"] == 6).all()
    assert summary["num_requests"] == 6 * len(written)
    assert summary["attainment_resolution_points"] == 100 / 6
    # |attainment error| is at most the share of requests whose outcome flipped
    assert (written["attainment_err_points"].abs() <= 100 * written["num_flipped"] / 6 + 1e-9).all()
    assert summary["step_correction"] > 0 and "corrected" in summary
    assert set(summary["step_correction_by_worker"]) >= {"colocated:1 colocated-0"}
    assert set(summary["step_factor_by_run"]) >= {"colocated:1@5/s0", "colocated:1@50/s0"}
    steps = pd.read_csv(tmp_path / "validation_steps.csv")
    assert steps["rebuilt"].all() and (steps["placement"] == "colocated:1").any()
    fixed = pd.read_csv(tmp_path / "validation_corrected.csv")
    assert list(fixed.columns) == validate.COLUMNS + validate.OUTCOME_COLUMNS
    assert len(fixed) == len(written)
    own = summary["step_factor_by_run"]["colocated:1@5/s0"]
    assert fixed.set_index(["placement", "rate"]).loc[("colocated:1", 5.0), "step_factor"] == own
    assert (fixed["measured_attainment"] == written["measured_attainment"]).all()
    # the drift replay: each run's speed trace written, its simulation scored beside
    trace = pd.read_csv(tmp_path / "validation_speed_trace.csv")
    assert set(zip(trace["placement"], trace["rate"])) == set(zip(written["placement"], written["rate"]))
    assert (trace["factor"] > 0).all() and (trace["window_start_s"] % 5.0 == 0).all()
    replay = pd.read_csv(tmp_path / "validation_replay.csv")
    assert list(replay["simulated_attainment"]) == list(written["replay_simulated_attainment"])
    assert (written["replay_attainment_err_points"]
            == 100 * (written["replay_simulated_attainment"] - written["measured_attainment"])).all()
    for col in validate.REPLAY_COLUMNS:
        assert written[col].map(math.isfinite).all(), col
    assert summary["replay"]["attainment_mae_points"] == written["replay_attainment_err_points"].abs().mean()
    assert "replaying this run's measured machine speed: MAE" in validate.summary_text(summary)
    # the speed band: every step 1.2x and 0.8x, slower steps never meet more SLOs
    assert (written["band_slow_attainment"] <= written["band_fast_attainment"]).all()
    assert summary["band"]["num_in_band"] == written["measured_in_band"].sum()
    assert set(summary["band"]["goodput_band"]) == {c.placement for c in cands}
    assert "speed band ±20%" in validate.summary_text(summary)
    # the rerun: the same points run again for real, scored against the first run
    reruns = pd.read_csv(tmp_path / "validation_reruns.csv")
    assert (reruns["rerun"] == 1).all() and len(reruns) == len(written)
    rerun_summary = pd.read_csv(tmp_path / "measured_rerun1" / "summary.csv")
    at = rerun_summary.set_index(["placement", "rate"])["slo_attainment"]
    assert list(written["rerun_measured_attainment"]) == [at[k] for k in zip(written["placement"], written["rate"])]
    assert (written["rerun_attainment_err_points"]
            == 100 * (written["rerun_measured_attainment"] - written["measured_attainment"])).all()
    assert (written["rerun_attainment_err_points"].abs() <= 100 * written["rerun_num_flipped"] / 6 + 1e-9).all()
    assert summary["num_reruns"] == 1
    assert summary["rerun"]["attainment_mae_points"] == written["rerun_attainment_err_points"].abs().mean()
    assert "the machine against itself: MAE" in validate.summary_text(summary)
    # the saved real runs score again to the same figures (the workload rebuilt from records)
    from benchmarks.plan_accuracy import rescore

    again, _ = rescore(tmp_path, profile, tmp_path / "again", speed_spread=0.2)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again" / "validation.csv"), written)
    for side, simulated in (("measured", False), ("simulated", True)):
        out = tmp_path / side
        for name in ("requests.jsonl", "summary.csv", "goodput.csv", "report.md", "slo_attainment.png"):
            assert (out / name).stat().st_size > 0, (side, name)
        config = json.loads((out / "requests.jsonl").read_text().splitlines()[0])
        assert config["simulated"] is simulated
        summary_csv = pd.read_csv(out / "summary.csv")
        assert (summary_csv["num_requests"] == 6).all() and (summary_csv["num_failed"] == 0).all()


def test_compare_simulate_overlays_and_writes_the_errors(tmp_path, monkeypatch):
    from experiments import plots
    from experiments.commands import compare

    drawn = {}
    real_plot = plots.plot_attainment

    def spy(curve, path, simulated=None):
        drawn["simulated"] = simulated
        return real_plot(curve, path, simulated)

    monkeypatch.setattr(plots, "plot_attainment", spy)
    spec = WorkloadSpec(dataset="synthetic", num_requests=5, seeds=1, prompt_len="4-20",
                        output_len="3-5")
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    _, verdict = compare.run_experiment(
        ["colocated:1"], [5.0, 40.0], spec, ModelConfig("tiny-random-llama"), engine,
        TransferConfig(transport="inprocess"), "cpu:0", None, SLO(1.0, 0.5), tmp_path,
        local=True, simulate=DeviceProfile.load(PROFILE))
    errors = pd.read_csv(tmp_path / "validation.csv")
    assert list(errors["rate"]) == [5.0, 40.0]
    assert list(errors.columns) == validate.COLUMNS + validate.OUTCOME_COLUMNS
    assert (errors["num_requests"] == 5).all() and (errors["step_factor"] > 0).all()
    assert "Simulated twin" in verdict and "mean abs error" in verdict
    assert "requests flipped" in verdict and "real steps took" in verdict
    assert list(drawn["simulated"]["rate"]) == [5.0, 40.0]  # the dashed curve in the report
