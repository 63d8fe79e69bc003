"""The paged KV cache: the store's block reads/writes, the budget -> blocks rule,
decode attention over every block layout the runner plans (strided runs, single views,
gathers, the store's end) against the model's own forward, masked positions safe without a
zero-filled store, and admission errors for requests larger than the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, reference_generate
from placement_helpers import BOUNDARY_LENGTHS, assert_clean, assert_outputs

from engine import ops
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.engine import Engine
from engine.kv_cache import GIB, KVSpec, KVStore, kv_budget_bytes, kv_cache_num_blocks
from engine.request import Request, RequestState, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import ScheduledBatch
from deployment.placement import Deployment

SPEC = KVSpec("t", num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32")


def test_store_round_trip_consecutive_and_scattered_blocks():
    store = KVStore(SPEC, num_blocks=8, block_size=4)
    assert store.num_bytes == 8 * 4 * SPEC.bytes_per_token and store.num_tokens == 32
    for blocks, num_tokens in (([1, 2, 3], 9), ([7, 0, 5], 12), ([6], 1), ([4, 6], 5)):
        kv = torch.randn(SPEC.kv_shape(num_tokens))
        store.write(blocks, kv)
        torch.testing.assert_close(store.read(blocks, num_tokens), kv, rtol=0, atol=0)
        torch.testing.assert_close(store.read(blocks, num_tokens, slice(1, 3)), kv[1:3],
                                   rtol=0, atol=0)
        assert store.read(blocks, num_tokens).is_contiguous()
        seen = store.read(blocks, num_tokens, slice(1, 3), may_view=True)
        torch.testing.assert_close(seen, kv[1:3], rtol=0, atol=0)
        shares = seen.untyped_storage().data_ptr() == store.kv.untyped_storage().data_ptr()
        assert shares == (blocks in ([1, 2, 3], [6]))  # a view where the blocks run in order
    kv = torch.randn(SPEC.kv_shape(6, 1))  # one layer at a time (layer-wise import)
    store.write([3, 1], kv, layer_start=2)
    torch.testing.assert_close(store.read([3, 1], 6, slice(2, 3)), kv, rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not fit 2 blocks of 4"):
        store.write([3, 1], torch.randn(SPEC.kv_shape(9)))
    with pytest.raises(ValueError, match="exceed the model's 3"):
        store.write([3, 1], kv, layer_start=3)
    with pytest.raises(ValueError, match="KV tensor mismatch"):
        store.write([3, 1], kv.to(torch.float64))


def test_claim_zeroes_only_blocks_never_used():
    store = KVStore(SPEC, num_blocks=6, block_size=4)
    store.kv.fill_(float("nan"))  # what uninitialised memory may hold
    store.claim(2)
    assert store.high_water == 2 and not store.kv[:, :, :, :2].isnan().any()
    assert store.kv[:, :, :, 2:].isnan().all()
    store.kv[:, :, :, 0] = 7.0  # a used block keeps its values on a later claim
    store.claim(1)
    store.claim(4)
    assert (store.kv[:, :, :, 0] == 7.0).all() and not store.kv[:, :, :, 2:4].isnan().any()
    assert store.kv[:, :, :, 4:].isnan().all()
    store.claim(99)  # capped at the store's end
    assert store.high_water == 6


def test_budget_to_blocks_rule(tiny, capsys):
    spec = tiny.kv_spec  # 512 bytes per token: a 16-token block is 8192 bytes
    config = EngineConfig(max_num_seqs=256, max_model_len=2048, kv_cache_memory_gb=1e-4)
    assert kv_budget_bytes(config) == int(1e-4 * GIB) == 107374
    assert kv_cache_num_blocks(config, spec) == 107374 // 8192 == 13
    engine = Engine(tiny, config)
    assert engine.kv_store.num_blocks == engine.scheduler.capacity.num_blocks == 13
    assert engine.kv_capacity_tokens == 13 * 16
    assert "KV cache: 13 blocks = 208 tokens = " in capsys.readouterr().err
    # never more than max_num_seqs requests of max_model_len can use: 2 x ceil(40 / 16)
    small = EngineConfig(max_num_seqs=2, max_model_len=40, kv_cache_memory_gb=1.0)
    assert kv_cache_num_blocks(small, spec) == 6
    # the CPU default budget; the cap follows the model's context (tiny: 256 tokens)
    assert kv_budget_bytes(EngineConfig()) == 4 * GIB
    assert Engine(tiny, EngineConfig(max_num_seqs=3)).kv_store.num_blocks == 3 * 256 // 16
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        Engine(tiny, EngineConfig(kv_cache_memory_gb=1e-6))


def test_cuda_budget_is_the_utilisation_share_left(monkeypatch):
    """vLLM's gpu_memory_utilization: the process may use util * total; the KV cache gets
    what is left of that after what is already in use (weights)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))
    config = EngineConfig(gpu_memory_utilization=0.5)
    assert kv_budget_bytes(config, "cuda:0") == 40 * GIB - 20 * GIB
    assert kv_budget_bytes(EngineConfig(gpu_memory_utilization=0.2), "cuda") == 0
    assert kv_budget_bytes(EngineConfig(kv_cache_memory_gb=3.0), "cuda:1") == 3 * GIB


def test_masked_positions_are_safe_without_a_zero_filled_store(tiny):
    """The store starts as NaN (uninitialised memory may): every length around the block
    boundaries still decodes exactly, so no read of a masked position reached NaN."""
    engine = Engine(tiny, EngineConfig(max_num_seqs=6, max_model_len=64, max_num_batched_tokens=24))
    engine.kv_store.kv.fill_(float("nan"))
    prompts = random_prompts([n - 3 for n in BOUNDARY_LENGTHS], seed=21)
    outputs = engine.generate([Request(f"r{i}", tuple(p), SamplingParams(max_tokens=6))
                               for i, p in enumerate(prompts)])
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [
        reference_generate(tiny.model, p, 6) for p in prompts]
    assert engine.is_empty()


def _forward_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0, -1]


@pytest.mark.parametrize("tables,lengths,group_sizes", [
    # three equally spaced runs (one strided view; the DP splits off the short row), a
    # run on its own, a scattered table (gathered)
    ([[0, 1, 2], [3, 4, 5], [6, 7, 8], [12, 13], [11, 9, 15, 10]], [33, 31, 17, 16, 40],
     [("view", 3), ("view", 1), ("gather", 1)]),
    # a strided pair whose short last row sits at the store's end: read past it -> split
    ([[0, 1], [2]], [31, 15], [("view", 1), ("view", 1)]),
])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_over_every_block_layout_equals_forward(tiny, tables, lengths, group_sizes,
                                                       paged, monkeypatch):
    """SDPA groups (the planned layout) or one C paged call (``paged``: every row's blocks
    read in place), forced; the blocks no row uses hold NaN, which neither may read."""
    num_blocks = max(max(t) for t in tables) + 1
    store = KVStore(tiny.kv_spec, num_blocks, 16)
    store.kv.fill_(float("nan"))
    runner = ModelRunner(tiny.model, store)
    if paged and "paged" not in getattr(runner.ops, "decode_candidates", ()):
        pytest.skip("the C kernels are not built for AVX2/FMA here")
    monkeypatch.setenv(ops.FORCE_ENV, f"decode_attention={'paged' if paged else 'planned'}")
    runner = ModelRunner(tiny.model, store)
    if paged:
        group_sizes = [("paged", len(tables))]
    prompts = random_prompts(lengths, seed=len(lengths))
    states = []
    for i, (prompt, table) in enumerate(zip(prompts, tables)):
        state = RequestState(Request(f"r{i}", tuple(prompt), SamplingParams(max_tokens=4)))
        state.block_ids = table
        prefill = ScheduledBatch()
        prefill.add(state, len(prompt) - 1)  # the KV of all but the last token
        runner.execute(prefill)
        state.num_computed_tokens = len(prompt) - 1
        states.append(state)
    batch = ScheduledBatch()
    for state in states:
        batch.add(state, 1)
    groups = runner._layout(batch).decode_groups
    kind = lambda g: ("paged" if g.block_tables is not None  # noqa: E731
                      else "gather" if g.block_idx is not None else "view")
    assert [(kind(g), g.num_rows) for g in groups] == group_sizes
    logits = runner.execute(batch)
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _forward_logits(tiny.model, prompt),
                                   rtol=1e-4, atol=1e-5)


def test_request_larger_than_the_cache_fails_alone_through_a_placement(tiny):
    """3 blocks (48 tokens) per engine: a 50-token request is refused at admission with the
    cache named; the others are token-exact and nothing leaks."""
    engine = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=24,
                          kv_capacity_tokens=48)
    prompts = random_prompts([40, 5, 12], seed=23)
    workload = [(Request("big", tuple(prompts[0]), SamplingParams(max_tokens=10)), 0.0)] + [
        (Request(f"ok{i}", tuple(p), SamplingParams(max_tokens=8)), 0.01 * (i + 1))
        for i, p in enumerate(prompts[1:])]
    with Deployment(PlacementConfig("colocated:1", "cpu:0"), ModelConfig("tiny-random-llama"),
                    engine, TransferConfig(transport="inprocess", timeout_s=5.0),
                    local=True) as deployment:
        records = {r.request_id: r for r in deployment.run(workload)}
        assert_clean(deployment)
    big = records.pop("big")
    # refused by the router, before the worker sees it (the engine's own check says the
    # same in blocks: test_scheduler.py::test_request_larger_than_the_cache_is_refused_at_add_and_blocks_nothing)
    assert ("needs 50 KV tokens, more than a colocated worker's whole KV cache (48 tokens"
            in big.error), big.error
    assert_outputs(records.values(), {f"ok{i}": reference_generate(tiny.model, p, 8)
                                      for i, p in enumerate(prompts[1:])})


def test_fragmented_cache_stays_token_exact_and_frees_every_block(tiny):
    """5 blocks of 16: a (1 block), b (2), c (1), d (1) fill the cache; e (2 blocks) waits.
    a and c end first, leaving blocks 0 and 3 free but no run of two, so e gets the
    scattered table [0, 3] and its prompt chunk and decodes take the gather paths beside
    b's and d's in-place views. Outputs equal generate(); every block is free at the end.
    (Blocks reserved whole at admission, ``kv_reservation="full"``, so the tables are these.)"""
    engine = Engine(tiny, EngineConfig(max_num_seqs=6, max_model_len=96, max_num_batched_tokens=24,
                                       kv_capacity_tokens=80, kv_reservation="full"))
    tables = []
    allocate = engine.scheduler.capacity.allocate
    engine.scheduler.capacity.allocate = lambda n: tables.append((n, allocate(n))) or tables[-1][1]
    spec = {"a": (10, 2), "b": (20, 10), "c": (10, 2), "d": (5, 10), "e": (20, 8)}
    prompts = dict(zip(spec, random_prompts([p for p, _ in spec.values()], seed=29)))
    outputs = engine.generate([Request(r, tuple(prompts[r]), SamplingParams(max_tokens=m))
                               for r, (_, m) in spec.items()])
    assert tables == [(12, [0]), (30, [1, 2]), (12, [3]), (15, [4]), (28, [0, 3])]
    for r, (_, m) in spec.items():
        assert outputs[r] == reference_generate(tiny.model, prompts[r], m), r
    assert engine.is_empty()
