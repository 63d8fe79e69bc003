"""The small map a ``pdlab compare`` report carries for its own workload
(``experiments.workload_map``), on the tiny model with workers in this process: the grid is
centred on the run's SLO, map.csv / map.png / report.md's section are written, the verdict
ends with the map's lines, and a one-device run says why it has none."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.metrics import SLO
from experiments import workload_map
from experiments.workload_spec import WorkloadSpec
from planner import slo_map
from planner.latency import DeviceProfile

PROFILE = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"


def test_slo_grid_is_centred_on_the_run_slo():
    ttft, tpot = workload_map.slo_grids(SLO(2.0, 0.1))
    assert ttft == (0.5, 1.0, 2.0, 4.0, 8.0)
    assert tpot == (0.025, 0.05, 0.1, 0.2, 0.4)


def test_profile_for_prefers_simulate_then_measured_then_shipped(tmp_path):
    tiny = DeviceProfile.load(PROFILE)
    assert workload_map.profile_for(ModelConfig("tiny-random-llama"), tiny, tmp_path)[0] is tiny
    none, why = workload_map.profile_for(ModelConfig("tiny-random-llama"), None, tmp_path)
    assert none is None and "run `pdlab profile`" in why
    shipped, where = workload_map.profile_for(ModelConfig("smollm2-135m"), None, tmp_path)
    assert shipped.model == "smollm2-135m" and "ships" in where
    measured = tmp_path / "profile-x" / "device_profile.json"
    shipped.replace(device_name="measured here").save(measured)
    got, where = workload_map.profile_for(ModelConfig("smollm2-135m"), None, tmp_path)
    assert got.device_name == "measured here" and where == str(measured)


def test_compare_report_gains_the_map(tmp_path):
    from experiments.commands import compare

    spec = WorkloadSpec(dataset="synthetic", num_requests=4, seeds=1, prompt_len="4-20",
                        output_len="3-5")
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    _, verdict = compare.run_experiment(
        ["colocated:2", "disagg:1p1d"], [5.0, 40.0], spec, ModelConfig("tiny-random-llama"),
        engine, TransferConfig(transport="inprocess"), "cpu:0,cpu:1", None, SLO(1.0, 0.5),
        tmp_path, local=True, simulate=DeviceProfile.load(PROFILE))
    cells = pd.read_csv(tmp_path / "map.csv")
    assert list(cells.columns) == slo_map.CELL_COLUMNS and len(cells) == 25
    centre = cells[(cells["ttft_index"] == 2) & (cells["tpot_index"] == 2)].iloc[0]
    assert (centre["ttft_slo_s"], centre["tpot_slo_s"]) == (1.0, 0.5)
    assert (tmp_path / "map.png").stat().st_size > 0
    text = (tmp_path / "report.md").read_text()
    assert f"## {workload_map.TITLE}" in text and text.endswith(f"![{workload_map.TITLE}](map.png)\n")
    assert "At this run's SLO (TTFT <= 1 s, TPOT <= 0.5 s) the map says" in verdict
    assert "profile: the --simulate profile" in verdict


def test_one_device_run_has_no_map(tmp_path):
    from experiments.commands import compare

    spec = WorkloadSpec(dataset="synthetic", num_requests=2, seeds=1, prompt_len="4-8",
                        output_len="2-3")
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    _, verdict = compare.run_experiment(
        ["colocated:1"], [5.0], spec, ModelConfig("tiny-random-llama"), engine,
        TransferConfig(transport="inprocess"), "cpu:0", None, SLO(1.0, 0.5), tmp_path, local=True)
    assert verdict.endswith("No map: 1 device (placements need 2 to differ).")
    assert not (tmp_path / "map.csv").exists()


def test_the_map_of_an_emulated_tp_run_places_instances_of_its_sizes(tmp_path):
    """A run on emulated devices with one profile per TP size: the map's placements are those
    of every offered (TP, PP) size on the run's 6 devices, not one device per instance."""
    from experiments.commands import compare

    data = Path(__file__).resolve().parents[1] / "data"
    profiles = ",".join(str(data / f"llama-3.1-8b_h100_sxm_vllm{s}_profile.json")
                        for s in ("", "_tp2", "_tp4"))
    spec = WorkloadSpec(dataset="synthetic", num_requests=4, seeds=1, prompt_len="64-200",
                        output_len="4-8")
    engine = EngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512,
                          device_profile=profiles, emu_kv_scale=1 / 256)
    _, verdict = compare.run_experiment(
        ["disagg:1p1d+ptp2+dtp4"], [20.0], spec, ModelConfig("engine/configs/llama-3.1-8b",
                                                             "bfloat16"),
        engine, TransferConfig(transport="inprocess"), "emu:0-5", None, SLO(0.5, 0.05),
        tmp_path, local=True)
    sizes = ((1, 1), (2, 1), (4, 1))
    expected = len(slo_map.map_candidates(6, sizes=sizes))
    assert expected > len(slo_map.map_candidates(6))
    assert (f"{expected} placements of instance sizes (TP, PP) (1, 1), (2, 1), (4, 1) x rates"
            in verdict), verdict
