"""The engine on a CUDA device: greedy tokens equal generate() on the same device (skipped
without CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import TINY_FAMILIES, load_model
from engine.request import Request, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["tiny-random-llama"]
                         + [f"tiny-random-{f}" for f in TINY_FAMILIES])
def test_engine_on_cuda_matches_generate(name):
    """Every supported family: on CUDA the projections are plain F.linear (fused ones split)."""
    loaded = load_model(ModelConfig(name), device="cuda:0")
    prompts = random_prompts([1, 7, 19, 33])
    engine = Engine(loaded, EngineConfig(max_num_seqs=4, max_model_len=64,
                                         max_num_batched_tokens=16, device="cuda:0"))
    outputs = engine.generate([Request(f"r{i}", tuple(p), SamplingParams(max_tokens=8))
                               for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda:0")
        want = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False)[0, len(p):].tolist()
        assert outputs[f"r{i}"] == want
    assert engine.kv_store.kv.is_cuda and engine.is_empty()
