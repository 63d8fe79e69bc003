"""The planner sizes each simulated instance's KV cache by the engine's own rule
(``engine.config.kv_budget_bytes_for``): on a CUDA profile without ``--kv-cache-memory-gb``,
``--gpu-memory-utilization`` x the device's memory less the weights, as an engine on that GPU
computes it from ``torch.cuda.mem_get_info``. Block counts are hand-computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import kv_cache
from engine.config import EngineConfig
from engine.kv_cache import GIB, KVSpec
from engine.request import Request, SamplingParams
from experiments import cli
from planner import search
from planner.latency import DeviceProfile

TINY_PROFILE = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"
# SmolLM2-135M in bf16 on an 80 GiB GPU: K and V of 30 layers x 3 KV heads x 64 dims x 2 bytes
SMOLLM2_BF16 = KVSpec("smollm2-135m@x", num_layers=30, num_kv_heads=3, head_dim=64,
                      dtype="bfloat16")
DEVICE_BYTES = 80 * GIB                    # 85_899_345_920
WEIGHT_BYTES = 269_030_016                 # 134_515_008 parameters x 2 bytes (tied embedding once)
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 2     # 368_640 bytes per block of 16 tokens
# max_kv_blocks = 256 x 8192 / 16 = 131_072: the cap binds only above that
ENGINE = EngineConfig(max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=512)


def _cuda_profile(**changes) -> DeviceProfile:
    return DeviceProfile.load(TINY_PROFILE).replace(**{
        "device_kind": "cuda", "device_name": "NVIDIA H100 80GB HBM3",
        "kv_bytes_per_token": SMOLLM2_BF16.bytes_per_token, "device_memory_bytes": DEVICE_BYTES,
        "weight_bytes": WEIGHT_BYTES, **changes})


def _simulated_blocks(profile: DeviceProfile, engine: EngineConfig) -> int:
    sim = search.simulator(search.Candidate("colocated:1"), engine, profile, None)
    sim.run([(Request("r", (3, 4, 5), SamplingParams(max_tokens=2, ignore_eos=True)), 0.0)])
    return sim._instances["colocated-0"].scheduler.capacity.num_blocks


@pytest.mark.parametrize("utilization,blocks", [
    (0.5, 115_778),   # (0.5 x 85_899_345_920 - 269_030_016) // 368_640 = 42_680_642_944 // 368_640
    (0.25, 57_524),   # (21_474_836_480 - 269_030_016) // 368_640 = 21_205_806_464 // 368_640
    (0.9, 131_072),   # 77_040_381_312 // 368_640 = 208_985 > the cap 256 x 512
])
def test_a_cuda_plan_gets_the_blocks_the_engine_gets_on_that_gpu(monkeypatch, utilization, blocks):
    engine = EngineConfig(**{**ENGINE.__dict__, "gpu_memory_utilization": utilization})
    assert _simulated_blocks(_cuda_profile(), engine) == blocks
    # the engine on such a GPU with only its weights loaded: the same rule, the same blocks
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (DEVICE_BYTES - WEIGHT_BYTES, DEVICE_BYTES))
    assert kv_cache.kv_cache_num_blocks(engine, SMOLLM2_BF16, "cuda:0") == blocks
    assert BLOCK_BYTES == 16 * SMOLLM2_BF16.bytes_per_token


def test_kv_cache_memory_gb_and_cpu_profiles_keep_their_rule():
    engine = EngineConfig(**{**ENGINE.__dict__, "gpu_memory_utilization": 0.5})
    pinned = EngineConfig(**{**engine.__dict__, "kv_cache_memory_gb": 2.0})
    assert _simulated_blocks(_cuda_profile(), pinned) == 2 * GIB // BLOCK_BYTES == 5825
    cpu = _cuda_profile(device_kind="cpu", device_memory_bytes=None)  # the utilization is CUDA's
    assert _simulated_blocks(cpu, engine) == 4 * GIB // BLOCK_BYTES == 11_650
    old_cuda = _cuda_profile(device_memory_bytes=None, weight_bytes=None)  # nothing to apply it to
    with pytest.raises(ValueError, match="records no device_memory_bytes / weight_bytes"):
        _simulated_blocks(old_cuda, engine)
    assert _simulated_blocks(old_cuda, pinned) == 5825


def test_the_memory_facts_round_trip_and_old_profiles_load_without_them(tmp_path):
    old = DeviceProfile.load(TINY_PROFILE)
    assert old.device_memory_bytes is None and old.weight_bytes is None
    profile = _cuda_profile()
    d = json.loads(profile.save(tmp_path / "p.json").read_text())
    assert (d["device_memory_bytes"], d["weight_bytes"]) == (DEVICE_BYTES, WEIGHT_BYTES)
    assert DeviceProfile.load(tmp_path / "p.json") == profile
    assert "device_memory_bytes" not in json.loads(old.save(tmp_path / "o.json").read_text())


def _plan(tmp_path, profile: DeviceProfile, *options: str) -> int:
    return cli.main(["plan", "--model", "tiny-random-llama", "--profile",
                     str(profile.save(tmp_path / "cuda.json")), "--dataset", "synthetic",
                     "--prompt-len", "16", "--output-len", "4", "--num-requests", "4",
                     "--devices", "1", "--rates", "100", "--transport", "inprocess",
                     "--seeds", "1", "--jobs", "1", "--out", str(tmp_path / "plan"), *options])


def test_pdlab_plan_on_a_cuda_profile_applies_gpu_memory_utilization(tmp_path, capsys):
    """The tiny model (512 KV bytes per token, 8192 per block; max_kv_blocks 256 x 256 / 16
    = 4096) on a 64 MiB device with 427_264 bytes of weights: at 0.5, (33_554_432 - 427_264)
    // 8192 = 4043 blocks per instance; a budget below one block, and a CUDA profile without
    the memory facts, are refused before anything runs."""
    tiny = _cuda_profile(kv_bytes_per_token=512, device_memory_bytes=64 * 2**20,
                         weight_bytes=427_264)
    assert _plan(tmp_path, tiny, "--gpu-memory-utilization", "0.5") == 0
    out = capsys.readouterr().out
    assert "KV cache per instance: 4043 blocks of 16 tokens; budget" in out
    assert "0.5 x 0.0625 GiB - 0.000398 GiB of weights" in out
    with pytest.raises(SystemExit):  # 422_785 - 427_264 < 0 bytes
        _plan(tmp_path, tiny, "--gpu-memory-utilization", "0.0063")
    assert "argument --gpu-memory-utilization: each instance's KV budget of 0 GiB holds no " \
        "block of 16 tokens (8192 bytes)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _plan(tmp_path, tiny.replace(weight_bytes=None))
    assert "argument --profile: the device profile (cuda" in capsys.readouterr().err


def test_pdlab_profile_records_the_memory_facts(tiny, monkeypatch):
    """The tiny Llama's parameters by hand: embedding and (untied) LM head 256 x 64 each, per
    layer q, o 64 x 64, k, v 64 x 32, gate, up, down 64 x 128 and two norms of 64, x 2
    layers, plus the final norm of 64 = 106_816 float32 parameters = 427_264 bytes."""
    import pandas as pd

    from experiments.commands import profile

    steps = {"batch_size": [1, 2], "context_len": [8, 16], "step_median_s": [0.005, 0.007]}
    result = profile.ProfileResult(
        prefill=pd.DataFrame({"prompt_len": [4, 16], "prefill_median_s": [0.01, 0.02]}),
        decode_context=pd.DataFrame(steps), decode_batch=pd.DataFrame(steps), batch_fit=None,
        context_fit=None, ratio={}, pg=None, estimator="min of 1 runs", notes=[])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 150_754_820_096))
    on_gpu = profile.fit_device_profile(result, tiny, "float32", "cuda:0")
    assert (on_gpu.device_kind, on_gpu.device_name) == ("cuda", "NVIDIA H200")
    assert (on_gpu.device_memory_bytes, on_gpu.weight_bytes) == (150_754_820_096, 427_264)
    on_cpu = profile.fit_device_profile(result, tiny, "float32", "cpu")
    assert (on_cpu.device_memory_bytes, on_cpu.weight_bytes) == (None, 427_264)
