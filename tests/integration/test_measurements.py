"""The corrected measurements end to end on the tiny model, in one process:

- the router stamps the *scheduled* arrival and the dispatch time, keeps each token's worker
  time beside its receipt time, and records KV put + get;
- a compare run keeps each (placement, rate, seed) run's own transfer and step rows;
- a tiny-model compare with 2 seeds x 2 rates reports intervals and finds no clear winner
  between two placements that do identical work;
- a workload that cannot fit the model is refused (or clipped) before anything runs.
"""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
from placement_helpers import ENGINE

from engine import metrics
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import SLO, RequestRecord
from engine.request import Request, SamplingParams
from experiments import replay, workload_spec
from experiments import analysis, workloads
from experiments.commands import compare
from experiments.results import write_results
from experiments.workload_spec import WorkloadSpec
from deployment.placement import Deployment

TINY = ModelConfig("tiny-random-llama")
INPROCESS = TransferConfig(transport="inprocess")


def test_router_stamps_schedule_worker_times_and_put_get():
    offsets = [0.0, 0.05, 0.1, 0.1]
    workload = [(Request(f"r{i}", tuple(range(3, 3 + 5 + 3 * i)), SamplingParams(max_tokens=5)), t)
                for i, t in enumerate(offsets)]
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE, INPROCESS,
                    local=True) as dep:
        records = dep.run(workload)
        transfers = {t["request_id"]: t for t in dep.transfer_records()}
    arrived = [r.timeline[metrics.ARRIVED] for r in records]
    # arrived = run start + offset exactly (to float precision of epoch seconds, ~2e-7),
    # however late each was dispatched; a dispatch-time stamp would be off by milliseconds
    assert [a - arrived[0] for a in arrived] == pytest.approx(offsets, abs=1e-6)
    for r in records:
        assert r.error is None
        assert metrics.dispatch_lag_s(r) >= 0
        assert len(r.token_worker_times_s) == len(r.token_times_s) == 5
        # produced before it reached the router, in order
        assert all(w <= t for w, t in zip(r.token_worker_times_s, r.token_times_s))
        assert r.token_worker_times_s == sorted(r.token_worker_times_s)
        # put measured by the prefill worker, get by the decode worker: the transport's own numbers
        assert r.kv_put_s == transfers[r.request_id]["put_s"] > 0
        assert r.kv_get_s >= transfers[r.request_id]["get_s"] > 0
        assert r.kv_transfer_s == pytest.approx(r.kv_put_s + r.kv_get_s)
        assert metrics.kv_transfer_s(r) == r.kv_transfer_s


class FakeDeployment:
    """Stands in for ``Deployment`` in ``run_placement``: every run appends to ever-growing
    step and transfer lists, as real workers do."""

    def __init__(self, placement, *args, **kwargs):
        self.placement = placement.placement
        self.router = type("R", (), {"max_model_len": 1000})()
        self.steps, self.transfers = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def gather(self, method):
        return [{"name": "w0", "role": "colocated", "device": "cpu:0", "torch_num_threads": 1}]

    def reset_prefix_cache(self):
        self.resets = getattr(self, "resets", 0) + 1

    def run(self, workload, on_finish=None):
        records = []
        for request, offset in workload:
            now = time.time()
            r = RequestRecord(request.request_id, self.placement, timeline={"arrived": now},
                              token_times_s=[now + 0.01, now + 0.02], kv_put_s=0.001,
                              kv_get_s=0.002, kv_bytes=100)
            self.transfers.append({"request_id": request.request_id, "num_bytes": 100,
                                   "put_s": 0.001, "get_s": 0.002, "transport": "fake"})
            self.steps.append({"worker": "w0", "start_s": now, "duration_s": 0.01,
                               "num_requests": 1, "num_prefill_tokens": 4,
                               "num_decode_tokens": 0})
            records.append(r)
            if on_finish:
                on_finish(r)
        time.sleep(0.01)  # the next run starts strictly later
        return records

    def step_records(self):
        return list(self.steps)

    def transfer_records(self):
        return list(self.transfers)


def test_each_run_keeps_its_own_transfer_and_step_rows(monkeypatch, tmp_path):
    monkeypatch.setattr(replay, "Deployment", FakeDeployment)
    spec = WorkloadSpec(dataset="synthetic", num_requests=3, seeds=2)
    items = {s: workloads.synthetic(3, s, 4, 2) for s in spec.seed_list}
    results = replay.run_placement("disagg:1p1d", [1.0, 2.0], items, spec, TINY, ENGINE,
                                    INPROCESS, "cpu:0,cpu:1", None)
    assert [(r.rate, r.seed) for r in results] == [(1.0, 0), (1.0, 1), (2.0, 0), (2.0, 1)]
    for r in results:  # 3 transfers and 3 steps each, not the 3, 6, 9, 12 accumulated so far
        ids = {rec.request_id for rec in r.records}
        assert len(r.transfers) == 3 and {t["request_id"] for t in r.transfers} == ids
        assert len(r.steps) == 3
    write_results(tmp_path, results, {"model": "tiny"}, SLO(1.0, 1.0))
    for name in ("transfers.csv", "steps.csv"):
        df = pd.read_csv(tmp_path / name)
        assert list(df.columns[:3]) == ["placement", "rate", "seed"]
        counts = df.groupby(["rate", "seed"]).size()
        assert counts.to_dict() == {(1.0, 0): 3, (1.0, 1): 3, (2.0, 0): 3, (2.0, 1): 3}
        assert set(df["placement"]) == {"disagg:1p1d"}


def test_calibrated_rate_ladder(monkeypatch):
    assert replay.calibrated_rates(2.0) == [1.0, 3.0, 8.0]
    assert replay.calibrated_rates(0.437) == [0.22, 0.66, 1.7]  # 2 significant digits
    with pytest.raises(ValueError, match="no capacity"):
        replay.calibrated_rates(0.0)
    monkeypatch.setattr(replay, "Deployment", FakeDeployment)
    spec = WorkloadSpec(dataset="synthetic", num_requests=3, seeds=1)
    calibration: dict = {}
    results = replay.run_placement("colocated:1", None, workloads.synthetic(3, 0, 4, 2), spec,
                                    TINY, ENGINE, INPROCESS, "cpu:0", None,
                                    calibration=calibration)
    # the fake serves a burst of 3 in ~10 ms: capacity = 3 / that burst's duration
    assert 3 / 1.0 < calibration["capacity_req_s"] < 3 / 0.01
    assert calibration["rates"] == replay.calibrated_rates(calibration["capacity_req_s"])
    assert [r.rate for r in results] == calibration["rates"]
    assert calibration["lone_ttft_s"] == pytest.approx(0.01, abs=0.005)  # the fake's first token
    assert calibration["lone_tpot_s"] == pytest.approx(0.01, abs=0.005)


def test_calibrated_slo_is_never_tighter_than_a_lone_request_allows():
    given = SLO(ttft_s=2.0, tpot_s=0.1)
    assert replay.calibrated_slo(given, 0.2, 0.03) == given  # a fast machine: as given
    assert replay.calibrated_slo(given, 1.0, 0.3) == SLO(ttft_s=4.0, tpot_s=0.6)
    assert replay.calibrated_slo(given, 0.1, None) == given


def test_compare_replays_a_mooncake_trace_once_at_its_own_times(tmp_path):
    """tests/data/mooncake_example.jsonl (16 tokens per hash id = one KV block) through a real
    colocated:1: one run whatever the rates, labelled with the trace's mean rate (11 gaps
    over 1.637 s = 6.72 req/s), and the engine's own prefix hits are the hand-counted ones
    of tests/integration/test_plan_workloads.py: 240 of 529 prompt tokens (each line's
    hits need only lines >= 120 ms earlier to have ended)."""
    from pathlib import Path

    trace = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_example.jsonl")
    spec = WorkloadSpec(dataset="mooncake", trace=trace, trace_block_tokens=16, seeds=1)
    engine = EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128)
    summary, _ = compare.run_experiment(["colocated:1"], [0.5, 2.0], spec, TINY, engine,
                                        INPROCESS, "cpu:0", None, SLO(10.0, 10.0), tmp_path,
                                        local=True)
    assert summary["rate"].tolist() == [6.72] and summary["num_requests"].tolist() == [12]
    assert summary["prefill_tokens_skipped"].tolist() == [240]
    assert summary["prefix_hit_rate"].tolist() == pytest.approx([240 / 529])


def test_tiny_compare_two_seeds_two_rates(tmp_path):
    # colocated:1 and colocated-nochunk:1 do identical work here: every prompt (<= 20 tokens)
    # fits the token budget, so chunking never splits one. Duplicate labels are refused by
    # the CLI, hence this pair.
    engine = EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64)
    spec = WorkloadSpec(dataset="synthetic", num_requests=4, seeds=2, prompt_len="4-20",
                        output_len="3-6")
    placements = ["colocated:1", "colocated-nochunk:1", "disagg:1p1d"]
    summary, verdict = compare.run_experiment(placements, [10.0, 40.0], spec, TINY, engine,
                                              INPROCESS, "cpu:0,cpu:1", None, SLO(10.0, 10.0),
                                              tmp_path, local=True)
    assert list(summary.columns) == analysis.SUMMARY_COLUMNS
    assert len(summary) == 6 and (summary["num_seeds"] == 2).all()
    assert (summary["num_requests"] == 8).all() and (summary["num_failed"] == 0).all()
    for col in analysis.CI_METRICS:
        ok = summary[col].notna()
        assert (summary.loc[ok, col + "_ci_lo"] <= summary.loc[ok, col] + 1e-12).all(), col
        assert (summary.loc[ok, col] <= summary.loc[ok, col + "_ci_hi"] + 1e-12).all(), col
    assert (summary["slo_attainment_ci_lo"] == 1.0).all()  # generous SLO: all meet it
    assert verdict.count("no clear winner at this rate") == 2, verdict
    assert "winner colocated" not in verdict and "winner disagg" not in verdict
    per_seed = pd.read_csv(tmp_path / "summary_seeds.csv")
    assert len(per_seed) == 12 and sorted(set(per_seed["seed"])) == [0, 1]
    transfers = pd.read_csv(tmp_path / "transfers.csv")
    assert set(transfers["placement"]) == {"disagg:1p1d"}
    assert transfers.groupby(["rate", "seed"]).size().tolist() == [4, 4, 4, 4]
    efficiency = pd.read_csv(tmp_path / "transfer_efficiency.csv")  # the report's table
    assert efficiency["placement"].tolist() == ["disagg:1p1d"]
    assert efficiency["num_transfers"].tolist() == [16]
    assert efficiency["kv_bytes_total"].tolist() == [transfers["num_bytes"].sum()]
    assert 0 < efficiency["efficiency_p50"].iloc[0] == transfers["efficiency"].median()
    assert "KV transfer efficiency" in verdict
    assert "## KV transfer efficiency" in (tmp_path / "report.md").read_text()
    assert (pd.read_csv(tmp_path / "goodput.csv")["goodput_per_device_req_s"] > 0).all()
    rows = [json.loads(line) for line in open(tmp_path / "requests.jsonl")]
    config = rows[0]
    assert config["seeds"] == [0, 1] and config["git_commit"] and config["command"]
    assert config["cpu_model"] is not None and "torch" in config["versions"]
    assert set(config["workload"]) == {"dataset", "num_requests", "seed", "seeds", "arrival",
                                       "calibrate", "prompt_len", "output_len"}  # synthetic options only
    workers = config["workers"]
    assert len(workers) == 4 and all(w["torch_num_threads"] >= 1 for w in workers)
    assert all(w["torch_device"] == "cpu" and w["gpu"] is None for w in workers)  # no GPU used
    requests = pd.DataFrame(rows[1:])
    assert len(requests) == 3 * 2 * 2 * 4
    # the same seed draws the same prompts for every placement and rate; seeds differ
    lengths = requests.groupby(["placement", "rate", "seed"])["num_prompt_tokens"].apply(list)
    assert len({tuple(v) for k, v in lengths.items() if k[2] == 0}) == 1
    assert lengths.xs(0, level="seed").iloc[0] != lengths.xs(1, level="seed").iloc[0]
    for name in ("slo_attainment.png", "p99_latency.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 0


def test_workload_that_cannot_fit_is_refused_before_the_run(tmp_path):
    spec = WorkloadSpec(dataset="synthetic")  # prompts up to 512 + outputs up to 64
    max_len = workload_spec.context_len(TINY, EngineConfig())
    assert max_len == 256
    with pytest.raises(ValueError, match=r"prompt_len up to 512 \+ output_len up to 64 = 576 "
                                         r"tokens does not fit tiny-random-llama's context of "
                                         r"256 tokens .*--prompt-len 8-192"):
        compare.run_experiment(["colocated:1"], [1.0], spec, TINY, EngineConfig(), INPROCESS,
                               "cpu:0", None, SLO(1.0, 1.0), tmp_path, local=True)
    assert not (tmp_path / "summary.csv").exists()
    # ShareGPT/HumanEval outputs are clipped instead; a prompt with no room left is refused
    items = [workloads.WorkloadRequest(tuple(range(100)), 50, "a"),
             workloads.WorkloadRequest(tuple(range(10)), 50, "b")]
    fitted = workload_spec.fit_workload(items, 120, "m")
    assert [it.output_len for it in fitted] == [20, 50]
    with pytest.raises(ValueError, match="1 prompt\\(s\\) of up to 100 tokens do not fit m's"):
        workload_spec.fit_workload(items, 100, "m")


def test_config_row_records_only_the_options_that_apply():
    assert WorkloadSpec(dataset="sharegpt").options() == {
        "dataset": "sharegpt", "num_requests": 24, "seed": 0, "seeds": 2, "arrival": "poisson",
        "calibrate": False, "min_prompt_len": 128, "max_prompt_len": 1024, "max_output_len": 48}
    gamma = WorkloadSpec(dataset="humaneval", arrival="gamma", burstiness=0.5).options()
    assert gamma["burstiness"] == 0.5 and gamma["max_output_len"] == 48
    assert "prompt_len" not in gamma and "min_prompt_len" not in gamma
    assert WorkloadSpec(seeds=3, seed=5).seed_list == [5, 6, 7]
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        WorkloadSpec(seeds=0)
