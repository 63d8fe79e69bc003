"""A TP 2 instance over NCCL on two GPUs (``engine.parallel``, backend chosen by the device):
greedy fp32 tokens equal generate()'s on one of them (skipped with fewer than 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine.config import EngineConfig, ModelConfig
from engine.model import load_model
from engine.parallel import start_instance
from engine.request import Request, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen2"])
def test_tp2_over_nccl_matches_generate(name):
    torch.cuda.set_device(0)
    model = ModelConfig(name)
    loaded = load_model(model, device="cuda:0")
    prompts = random_prompts([3, 19, 40])
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
                          device="cuda:0", kv_cache_memory_gb=0.05)
    instance = start_instance(loaded, model, config, 2, devices=("cuda:0", "cuda:1"), quiet=True)
    try:
        assert instance.group.backend == "nccl"
        outputs = instance.engine.generate([Request(f"r{i}", tuple(p), SamplingParams(max_tokens=8))
                                            for i, p in enumerate(prompts)])
    finally:
        assert instance.close() == [0]
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda:0")
        with torch.inference_mode():
            want = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                         do_sample=False)[0, len(p):].tolist()
        assert outputs[f"r{i}"] == want, (name, i)
