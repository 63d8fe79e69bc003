"""Tensor parallelism within one instance (``engine.parallel``): shards hold what the
Megatron layout says, and an instance whose ranks are processes (gloo on CPU) decodes
greedy token for token as transformers' ``generate()``."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from conftest import random_prompts, reference_generate
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import TINY_NAMES, load_model
from engine.parallel import (TensorParallelGroup, follow, make_engine, shard_loaded, shard_model,
                             start_instance)
from engine.request import Request, SamplingParams

ENGINE = EngineConfig(kv_cache_memory_gb=0.02, max_num_seqs=8, max_num_batched_tokens=32)  # chunked prompts


def test_shards_hold_their_rows_and_columns_and_sum_to_the_whole():
    """tiny-random-llama3 has biases on every projection: the row-parallel outputs of the
    ranks (each on its own input columns) sum to the whole projection, bias counted once."""
    model = load_model(ModelConfig("tiny-random-llama3")).model
    whole = model.model.layers[0]
    shards = [shard_model(model, r, 2).model.layers[0] for r in range(2)]
    head_dim = model.config.head_dim
    assert [s.self_attn.q_proj.weight.shape[0] for s in shards] == [2 * head_dim] * 2
    assert [s.self_attn.k_proj.weight.shape[0] for s in shards] == [head_dim] * 2
    assert torch.equal(shards[1].self_attn.k_proj.weight, whole.self_attn.k_proj.weight[head_dim:])
    assert torch.equal(shards[1].self_attn.v_proj.bias, whole.self_attn.v_proj.bias[head_dim:])
    assert shards[0].self_attn.o_proj.bias is not None and shards[1].self_attn.o_proj.bias is None
    x = torch.randn(3, model.config.num_attention_heads * head_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parts = [s.self_attn.o_proj(x[:, r * 2 * head_dim:(r + 1) * 2 * head_dim])
                 for r, s in enumerate(shards)]
        torch.testing.assert_close(parts[0] + parts[1], whole.self_attn.o_proj(x))
        inter = model.config.intermediate_size // 2
        h = torch.randn(3, model.config.intermediate_size, generator=torch.Generator().manual_seed(1))
        parts = [s.mlp.down_proj(h[:, r * inter:(r + 1) * inter]) for r, s in enumerate(shards)]
        torch.testing.assert_close(parts[0] + parts[1], whole.mlp.down_proj(h))
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 4 * head_dim  # unchanged


def test_a_shard_reads_its_own_heads_and_kv_geometry(tiny):
    """TP 4 on 4 query heads and 2 KV heads: one query head per rank, each KV head on two
    ranks (replicated), the KV spec of one head."""
    shard = shard_loaded(tiny, 3, 4)
    cfg = shard.model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (1, 1, 32)
    assert shard.kv_spec.num_kv_heads == 1 and shard.kv_spec.model_fingerprint == tiny.kv_spec.model_fingerprint
    k = shard.model.model.layers[0].self_attn.k_proj.weight
    assert torch.equal(k, tiny.model.model.layers[0].self_attn.k_proj.weight[16:])  # KV head 1
    assert tiny.model.config.num_attention_heads == 4  # the loaded model is not changed


def test_a_tp_that_does_not_divide_the_heads_is_refused(tiny):
    with pytest.raises(ValueError, match="TP 3 does not suit .*4 attention heads .* 2 KV heads"):
        shard_model(tiny.model, 0, 3)


def _run_instance(loaded, model_name: str, tp: int, prompts, max_tokens: int,
                  kill_follower: bool = False, timeout_s: float = 60.0):
    """Rank 0 here, ranks 1.. as spawned processes (``start_instance``); returns (outputs,
    step outputs)."""
    instance = start_instance(loaded, ModelConfig(model_name), ENGINE, tp, timeout_s=timeout_s,
                              quiet=True)
    engine = instance.engine
    try:
        if kill_follower:
            instance.processes[0].kill()
            instance.processes[0].join(30)
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=max_tokens)))
        outputs, steps = {f"r{i}": [] for i in range(len(prompts))}, []
        while engine.has_unfinished():
            steps.append(engine.step())
            for out in steps[-1]:
                outputs[out.request_id].append(out.token_id)
    finally:
        codes = instance.close()
    if not kill_follower:
        assert codes == [0] * (tp - 1)
    return outputs, steps


def test_tiny_model_at_tp2_is_greedy_equal_to_generate(tiny):
    prompts = random_prompts([5, 40, 17, 70], seed=3)
    outputs, _ = _run_instance(tiny, "tiny-random-llama", 2, prompts, 16)
    assert outputs == {f"r{i}": reference_generate(tiny.model, p, 16) for i, p in enumerate(prompts)}


@pytest.mark.workers
def test_a_dead_rank_fails_the_step_instead_of_hanging(tiny):
    prompts = random_prompts([6], seed=4)
    outputs, steps = _run_instance(tiny, "tiny-random-llama", 2, prompts, 4,
                                   kill_follower=True, timeout_s=20.0)
    assert outputs == {"r0": []}
    assert [f.request_id for f in steps[0].failed] == ["r0"]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_every_tiny_family_at_tp2_and_tp4_is_greedy_equal_to_generate(name):
    """Each family's features (biases, q/k norms, fused Phi-3 projections, sandwich norms,
    soft-capping, MQA) under the shard layout, at TP 2 and at TP 4 (4 query heads: one per
    rank; 2 KV heads, 1 for Gemma 3: replicated). The ranks are threads of this process here,
    each with its own gloo group member, so eight families stay cheap; the process boundary
    is the tests above."""
    loaded = load_model(ModelConfig(name))
    prompts = random_prompts([5, 17, 30], seed=6)  # Gemma 2's sliding window caps context at 48
    expected = {f"r{i}": reference_generate(loaded.model, p, 10) for i, p in enumerate(prompts)}
    for tp in (2, 4):
        store, got, errors = dist.HashStore(), {}, []

        def rank_main(rank: int) -> None:
            group = TensorParallelGroup(store, rank, tp, timeout_s=30.0)
            try:
                if rank == 0:
                    engine = make_engine(loaded, ENGINE, group, quiet=True)
                    try:
                        got.update(engine.generate([Request(f"r{i}", tuple(p), SamplingParams(
                            max_tokens=10)) for i, p in enumerate(prompts)]))
                    finally:
                        group.stop()
                else:
                    follow(loaded, ENGINE, group)
            except Exception as err:  # reported below, from the test's thread
                errors.append(err)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert got == expected, (name, tp)


def _threaded_instances(loaded, sizes: tuple[int, ...], body, **engine_kwargs) -> None:
    """Instances of TP ``sizes``, each rank > 0 a thread running ``follow``; ``body(engines)``
    runs rank 0 of every instance here (``make_engine`` with ``engine_kwargs``), then every
    group stops."""
    stores = [dist.HashStore() for _ in sizes]
    errors: list[BaseException] = []

    def follower(store, rank: int, size: int) -> None:
        try:
            follow(loaded, ENGINE, TensorParallelGroup(store, rank, size, timeout_s=30.0))
        except Exception as err:  # reported below, from the test's thread
            errors.append(err)

    threads = [threading.Thread(target=follower, args=(store, rank, size))
               for store, size in zip(stores, sizes) for rank in range(1, size)]
    for t in threads:
        t.start()
    groups = [TensorParallelGroup(store, 0, size, timeout_s=30.0) for store, size in zip(stores, sizes)]
    try:
        body([make_engine(loaded, ENGINE, g, quiet=True, **engine_kwargs) for g in groups])
    finally:
        for g in groups:
            g.stop()
        for t in threads:
            t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors


def tp1_kv(loaded, requests) -> dict[str, torch.Tensor]:
    """Each request's prompt KV ``[L, 2, H_kv, T, D]`` as a TP 1 engine exports it: what an
    instance at any TP must hand over."""
    single = Engine(loaded, ENGINE, quiet=True)
    for r in requests:
        single.add_request(r, prefill_only=True)
    while single.has_unfinished():
        single.step()
    return {r.request_id: single.export_kv(r.request_id)[0] for r in requests}


def assert_kv_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding (the shards sum their partial products in another order)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_kv_moves_between_instances_of_different_tp(tiny, prefill_tp, decode_tp):
    """A prefill instance at one TP hands each request's KV (every head, the wire format) to a
    decode instance at another, which decodes greedy-equal to generate(); the KV it exports
    equals a TP 1 engine's for the same prompt."""
    prompts = random_prompts([9, 33, 20], seed=7)
    expected = {f"r{i}": reference_generate(tiny.model, p, 8) for i, p in enumerate(prompts)}
    requests = [Request(f"r{i}", tuple(p), SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
    reference_kv = tp1_kv(tiny, requests)
    outputs = {}

    def body(engines) -> None:
        prefill, decode = engines
        for r in requests:
            prefill.add_request(r, prefill_only=True)
        fetched = {}
        while prefill.has_unfinished():
            for out in prefill.step():
                kv, first = prefill.export_kv(out.request_id)
                assert kv.shape == tiny.kv_spec.kv_shape(len(prompts[int(out.request_id[1:])]))
                assert_kv_equal(kv, reference_kv[out.request_id])
                decode.add_remote(requests[int(out.request_id[1:])], first)
                fetched[out.request_id], outputs[out.request_id] = kv, [first]
        while decode.has_unfinished():
            step = decode.step()
            for out in step:
                outputs[out.request_id].append(out.token_id)
            for rid in step.kv_reserved:
                decode.finish_remote(rid, fetched.pop(rid))
        assert prefill.is_empty() and decode.is_empty()

    _threaded_instances(tiny, (prefill_tp, decode_tp), body)
    assert outputs == expected


@pytest.mark.parametrize("tp", [2, 4])
def test_layer_wise_reads_from_a_tp_instance_give_every_head(tiny, tp):
    """A layer listener reads each finished layer of the prompts completing in the step (as
    the prefill worker streams them): the layers, put together, equal a TP 1 engine's
    exported KV; a listener that raises fails that step's requests and the instance serves
    on (every rank ran the whole forward)."""
    prompts = random_prompts([9, 33], seed=8)
    requests = [Request(f"r{i}", tuple(p), SamplingParams(max_tokens=4)) for i, p in enumerate(prompts)]
    reference_kv = tp1_kv(tiny, requests)
    streamed: dict[str, list[torch.Tensor]] = {}
    mode = {"engine": None, "listen": True, "fail": False}

    def listener(layer, batch) -> None:
        if mode["fail"]:
            raise OSError("transport down")
        for i, state in enumerate(batch.requests):
            if mode["listen"] and batch.completes(i):
                streamed.setdefault(state.request_id, []).append(
                    mode["engine"].read_kv_layers(state.request_id, slice(layer, layer + 1)))

    def body(engines) -> None:
        engine = mode["engine"] = engines[0]
        for r in requests:
            engine.add_request(r, prefill_only=True)
        while engine.has_unfinished():
            for out in engine.step():
                engine.finish_prefilled(out.request_id)
        mode["fail"] = True
        engine.add_request(Request("x", (5, 6, 7), SamplingParams(max_tokens=2)), prefill_only=True)
        step = engine.step()
        assert [f.request_id for f in step.failed] == ["x"] and "transport down" in step.failed[0].error
        mode["fail"], mode["listen"] = False, False
        assert engine.generate([Request("y", (5, 6, 7), SamplingParams(max_tokens=3))])["y"] == \
            reference_generate(tiny.model, [5, 6, 7], 3)

    _threaded_instances(tiny, (tp,), body, on_layer_done=listener)
    assert sorted(streamed) == ["r0", "r1"]
    for rid, layers in streamed.items():
        assert len(layers) == tiny.kv_spec.num_layers
        assert_kv_equal(torch.cat(layers), reference_kv[rid])


@pytest.mark.slow
def test_smollm2_at_tp3_is_greedy_equal_to_generate(smollm2):
    """9 attention heads and 3 KV heads: one KV head and three query heads per rank
    (oversubscribed on fewer cores, which changes the time, not the tokens)."""
    prompts = random_prompts([12, 37], vocab_size=smollm2.vocab_size, seed=5)
    outputs, _ = _run_instance(smollm2, "smollm2-135m", 3, prompts, 12, timeout_s=300.0)
    assert outputs == {f"r{i}": reference_generate(smollm2.model, p, 12) for i, p in enumerate(prompts)}


def test_a_rank_that_cannot_start_is_named_at_once(tiny):
    """A rank whose device does not exist fails the start in one line naming it, without
    waiting out the group's deadline."""
    with pytest.raises(RuntimeError, match="rank 1 failed to start: ValueError: device cpu:999"):
        start_instance(tiny, ModelConfig("tiny-random-llama"), ENGINE, 2,
                       devices=("cpu:0", "cpu:999"), timeout_s=300.0, quiet=True)
