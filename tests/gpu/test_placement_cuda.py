"""Local placements on CUDA (one process, in-process transport): every worker runs on its GPU,
tokens equal generate() on that GPU, and the records name the physical GPU (skipped without
CUDA). Two workers may share one GPU (``worker_devices``), so this runs on a one-GPU box."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.model import load_model
from engine.request import Request, SamplingParams
from deployment.placement import Deployment

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=24,
                      kv_cache_memory_gb=0.05)  # two engines share the GPU: no 0.9 each


@pytest.mark.parametrize("placement,worker_devices,granularity", [
    ("colocated:1", None, "request"),
    ("disagg:1p1d", ("cuda:0", "cuda:0"), "request"),
    ("disagg:1p1d", ("cuda:0", "cuda:0"), "layer"),
], ids=["colocated:1", "disagg:1p1d-one-gpu", "disagg:1p1d-one-gpu-layerwise"])
def test_local_placement_on_cuda_matches_generate(placement, worker_devices, granularity):
    reference = load_model(TINY, device="cuda:0")
    prompts = random_prompts([1, 5, 17, 40, 3, 33], seed=3)
    wants = {}
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda:0")
        with torch.inference_mode():
            wants[f"r{i}"] = reference.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                do_sample=False)[0, len(p):].tolist()
    workload = [(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=10)), 0.01 * i)
                for i, p in enumerate(prompts)]
    with Deployment(PlacementConfig(placement, "cuda:0"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", granularity=granularity),
                    local=True, worker_devices=worker_devices) as deployment:
        records = deployment.run(workload)
        infos = deployment.gather("info")
        statuses = deployment.statuses()
    assert {r.request_id: r.output_token_ids for r in records} == wants
    assert all(r.error is None for r in records)
    if placement.startswith("disagg"):
        assert all(r.kv_bytes == 2 * 2 * 2 * 16 * r.num_prompt_tokens * 4 for r in records)
    uuid = torch.cuda.get_device_properties(0).uuid
    for info in infos:
        assert info["torch_device"] == "cuda:0" and info["gpu"]["index"] == 0
        assert info["gpu"]["name"] == torch.cuda.get_device_name(0)
        assert str(uuid) in info["gpu"]["uuid"]
    assert all(s["engine_empty"] and s.get("transport_held", 0) == 0 for s in statuses)
