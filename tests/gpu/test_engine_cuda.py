"""The engine on a CUDA device: greedy tokens equal generate() on the same device, for every
supported family in fp32 and bf16 (skipped without CUDA)."""

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
NAMES = ["tiny-random-llama"] + [f"tiny-random-{f}" for f in TINY_FAMILIES]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", NAMES)
def test_engine_on_cuda_matches_generate(name, dtype):
    """Every supported family: on CUDA the projections are plain F.linear (fused ones split).
    fp32: every prompt's tokens equal generate()'s. bf16: a batched step rounds in another
    order than generate()'s one sequence, so (as tests/integration/test_engine.py's bf16
    test on CPU) every first token must match and at least 3 of the 4 whole sequences."""
    loaded = load_model(ModelConfig(name, dtype=dtype), device="cuda:0")
    prompts = random_prompts([1, 7, 19, 33])
    engine = Engine(loaded, EngineConfig(max_num_seqs=4, max_model_len=64,
                                         max_num_batched_tokens=16, device="cuda:0"))
    outputs = engine.generate([Request(f"r{i}", tuple(p), SamplingParams(max_tokens=8))
                               for i, p in enumerate(prompts)])
    wants = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda:0")
        with torch.inference_mode():
            wants.append(loaded.model.generate(ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=8, do_sample=False
                                               )[0, len(p):].tolist())
    got = [outputs[f"r{i}"] for i in range(len(prompts))]
    if dtype == "float32":
        assert got == wants
    else:
        assert [g[:1] for g in got] == [w[:1] for w in wants]
        assert sum(g == w for g, w in zip(got, wants)) >= 3, (got, wants)
    assert engine.kv_store.kv.is_cuda and engine.kv_store.kv.dtype == loaded.model.dtype
    assert engine.is_empty()
