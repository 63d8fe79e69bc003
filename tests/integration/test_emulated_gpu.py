"""A GPU box rehearsed on this machine: ``disagg:2p2d`` on ``emu:0-3`` with the
Llama-3.1-8B H100 SXM vLLM profile (``pdlab profile --from-silicon-db h100_sxm --backend
vllm --model engine/configs/llama-3.1-8b``, shipped as tests/data/...json so the test runs
without the optional aiconfigurator extra), KV scaled to 1/256: the run completes with the
emulated model's output lengths, and its added latency and validation table are computed.
(The added-latency targets are benchmarks/control_plane.py's, not this test's.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pandas as pd

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.metrics import SLO
from experiments import cli
from experiments.commands import serve
from experiments.commands.compare import run_experiment
from server.app import ServerThread
from experiments.workload_spec import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
PROFILE = str(ROOT / "tests" / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json")
LLAMA = ModelConfig("engine/configs/llama-3.1-8b", "bfloat16")


def test_disagg_2p2d_on_four_emulated_h100s(tmp_path):
    spec = WorkloadSpec(dataset="synthetic", num_requests=24, seeds=1, prompt_len="64-400",
                        output_len="8-40")
    engine = EngineConfig(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512,
                          device_profile=PROFILE, emu_kv_scale=1 / 256)
    summary, verdict = run_experiment(["disagg:2p2d"], [20.0, 40.0], spec, LLAMA, engine,
                                      TransferConfig(transport="inprocess"), "emu:0-3", None,
                                      SLO(ttft_s=0.5, tpot_s=0.05), tmp_path, local=True)
    assert list(summary["num_failed"]) == [0, 0]
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    config = json.loads(lines[0])
    assert config["emulated"] is True
    assert config["emulation"]["system"] == "h100_sxm" and config["emulation"]["backend"] == "vllm"
    assert config["emulation"]["kv_scale"] == 1 / 256
    assert (tmp_path / "report.md").read_text().startswith(
        "# pdlab placement comparison (emulated devices)")
    requests = [json.loads(line) for line in lines[1:] if json.loads(line)["type"] == "request"]
    # every request ran to its reference length (emulated tokens are never EOS) and its
    # prompt's KV crossed the transport at 1/256 of Llama-3.1-8B's 131072 bytes per token
    assert all(r["finish_reason"] == "length" and 8 <= len(r["output_token_ids"]) <= 40
               for r in requests)
    assert all(r["kv_bytes"] == 512 * r["num_prompt_tokens"] for r in requests)
    added = pd.read_csv(tmp_path / "added_latency.csv")
    assert list(added["rate"]) == [20.0, 40.0]
    for metric in ("ttft_p50", "tpot_p50"):
        assert (added[f"added_{metric}_s"] == added[f"{metric}_measured_s"]
                - added[f"{metric}_modelled_s"]).all()
        assert all(math.isfinite(v) for v in added[f"added_{metric}_pct"])
    # a modelled TPOT of an H100 decode step: 6-9 ms (the profile's decode model)
    assert added["tpot_p50_modelled_s"].between(0.006, 0.009).all()
    validation = pd.read_csv(tmp_path / "validation.csv")
    assert len(validation) == 2 and validation["measured_attainment"].notna().all()
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert (steps["lateness"] >= 1.0).all()
    assert "Simulated twin" in verdict
    stages = pd.read_csv(tmp_path / "added_latency_stages.csv")  # where the added latency goes
    assert set(stages["stage"]) >= {"arrival to prefill start", "hand-over to KV fetched",
                                    "later decode gaps"}
    assert (stages["added_s"] == stages["measured_s"] - stages["modelled_s"]).all()
    assert "disagg:2p2d: pdlab's largest added stage is" in verdict


def test_serve_on_emulated_devices_streams_the_emulated_tokens():
    """``pdlab serve`` on ``emu:0-1`` (disagg:1p1d, in-process): a completion of 7 tokens of
    prompt ids comes back whole, and a second one of the same prompt gets the same tokens."""
    args = cli.build_parser().parse_args(
        ["serve", "--model", "engine/configs/llama-3.1-8b", "--devices", "emu:0-1",
         "--placement", "disagg:1p1d", "--local", "--device-profile", PROFILE,
         "--emu-kv-scale", "0.00390625", "--max-model-len", "512"])
    dep, app = serve.build(args, serve.check(args))
    try:
        thread = ServerThread(app.app).start()
        try:
            body = {"model": "engine/configs/llama-3.1-8b", "prompt": list(range(100, 140)),
                    "max_tokens": 7}
            replies = [httpx.post(f"{thread.url}/v1/completions", json=body, timeout=60).json()
                       for _ in range(2)]
        finally:
            thread.stop()
    finally:
        dep.close()
    assert [r["usage"]["completion_tokens"] for r in replies] == [7, 7]
    assert [r["choices"][0]["finish_reason"] for r in replies] == ["length", "length"]
    assert replies[0]["choices"][0]["text"] == replies[1]["choices"][0]["text"]


def test_plan_validation_on_emulated_devices_names_the_added_stages(tmp_path):
    """``pdlab plan --validate`` with --device-profile (``validate.validate`` on emu
    devices): added_latency_stages.csv is written and the summary names the largest stage."""
    from experiments import validate
    from planner import search
    from planner.latency import DeviceProfile

    profile = DeviceProfile.load(PROFILE)
    engine = EngineConfig(max_num_seqs=16, max_model_len=512, max_num_batched_tokens=512,
                          device_profile=PROFILE, emu_kv_scale=1 / 256)
    spec = WorkloadSpec(dataset="synthetic", num_requests=12, seeds=1, prompt_len="64-300",
                        output_len="8-24")
    _, summary = validate.validate(
        [search.Candidate("colocated:1")], [20.0], spec, LLAMA, engine,
        TransferConfig(transport="inprocess"), profile, profile.transfer("inprocess"),
        SLO(ttft_s=0.5, tpot_s=0.05), tmp_path, devices="emu:0", local=True)
    stages = pd.read_csv(tmp_path / "added_latency_stages.csv")
    assert set(stages["placement"]) == {"colocated:1"} and len(stages) == 8
    assert summary["added_stages"].startswith("colocated:1: pdlab's largest added stage is ")
