"""The paged KV cache on a real device under ``--gpu-memory-utilization``: its size follows
``engine.kv_cache.kv_budget_bytes`` (the fraction of the device, less what is already in
use), the memory really is taken, and requests run in it (skipped without CUDA)."""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_models import smollm2

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import GIB
from engine.model import load_model
from engine.request import Request, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("utilization", [0.3, 0.5])
def test_kv_cache_takes_the_fraction_of_the_device_left_after_the_weights(tmp_path_factory,
                                                                          utilization):
    """SmolLM2's shapes at max_num_seqs 256 x max_model_len 8192 could use ~96 GB of fp32
    KV, more than either fraction of an H200 leaves: the budget, not the cap, sizes it."""
    model_config, _ = smollm2("float32", tmp_path_factory.mktemp("smollm2"))
    loaded = load_model(model_config, device="cuda:0")
    config = EngineConfig(max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=2048,
                          gpu_memory_utilization=utilization, device="cuda:0")
    torch.cuda.synchronize()
    free_bytes, total_bytes = torch.cuda.mem_get_info(0)
    want_budget = int(utilization * total_bytes) - (total_bytes - free_bytes)
    allocated_before = torch.cuda.memory_allocated(0)
    engine = Engine(loaded, config)
    block_bytes = config.block_size * engine.kv_spec.bytes_per_token
    assert engine.kv_spec.bytes_per_token == 2 * 30 * 3 * 64 * 4  # 2 L H_kv D itemsize
    assert engine.kv_store.num_blocks < config.max_kv_blocks  # the budget binds
    # the budget is read again inside Engine: allow what this process allocated in between
    assert abs(engine.kv_store.num_blocks - want_budget // block_bytes) <= 64 * 2**20 // block_bytes
    taken = torch.cuda.memory_allocated(0) - allocated_before
    assert taken >= engine.kv_store.num_bytes
    assert engine.kv_store.num_bytes <= want_budget + 64 * 2**20
    # the process now holds about the fraction asked for (weights + KV; CUDA's own context
    # and the caching allocator's slack on top)
    in_use_bytes = total_bytes - torch.cuda.mem_get_info(0)[0]
    assert in_use_bytes <= utilization * total_bytes + 2 * GIB
    requests = [Request(f"r{i}", tuple(range(3, 3 + 500 + i)),
                        SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(8)]
    outputs = engine.generate(requests)
    assert all(len(tokens) == 4 for tokens in outputs.values()) and engine.is_empty()
    del engine, loaded
    gc.collect()
    torch.cuda.empty_cache()
