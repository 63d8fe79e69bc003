"""Disaggregated workers whose instances have different TP sizes (``rank_devices``): a
prefill instance at TP 2 hands its KV to a decode instance at TP 1 and the other way round,
over the in-process and shared-memory transports, whole and layer-wise; the tokens equal
``generate()``. Each instance's other ranks are spawned processes (gloo)."""

from __future__ import annotations

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import collect_events

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.events import ERROR, KV_GOT, PREFILLED, TOKEN
from engine.request import Request, SamplingParams
from engine.serving import EngineLoop
from kv_transfer.inprocess import InProcessTransport
from prefill_worker import PrefillWorker

TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64,
                      kv_cache_memory_gb=0.02)


def _ranks(tp: int) -> tuple[str, ...]:
    return ("cpu",) * (tp - 1)  # not bound (bind=False): the device names only count ranks


@pytest.mark.parametrize("transport,granularity", [("inprocess", "request"), ("shm", "layer"),
                                                   ("shm", "request"), ("inprocess", "layer")])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_at_different_tp_give_generates_tokens(
        tiny, transport, granularity, prefill_tp, decode_tp):
    transfer = TransferConfig(transport=transport, granularity=granularity, timeout_s=20.0)
    shared = InProcessTransport() if transport == "inprocess" else None  # shm: one per worker
    workers = []
    try:
        prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer, transport=shared,
                                bind=False, rank_devices=_ranks(prefill_tp), decode_tp=decode_tp)
        workers.append(prefill)
        decode = DecodeWorker("decode-0", TINY, ENGINE, transfer, transport=shared, bind=False,
                              rank_devices=_ranks(decode_tp))
        workers.append(decode)
        assert (prefill.info()["tp"], decode.info()["tp"]) == (prefill_tp, decode_tp)
        assert prefill.info()["kv_spec"] == decode.info()["kv_spec"] == tiny.kv_spec.to_dict()
        for i, prompt in enumerate(random_prompts([11, 40, 23], seed=9)):
            request = Request(f"r{i}", tuple(prompt), SamplingParams(max_tokens=8))
            prefill.submit(request)
            events = collect_events(prefill, lambda ev: any(
                e.kind in (PREFILLED, ERROR) and e.request_id == request.request_id for e in ev),
                30.0, poll_s=0.2)
            done = [e for e in events if e.kind in (PREFILLED, ERROR)]
            assert [e.kind for e in done] == [PREFILLED], done
            event = done[0]
            assert event.kv_bytes == tiny.kv_spec.kv_bytes(len(prompt))  # every head
            decode.admit(request, event.token_id, event.kv_handles)
            events = collect_events(decode, lambda ev: any(e.kind == ERROR for e in ev) or any(
                e.kind == TOKEN and e.finish_reason for e in ev), 30.0, poll_s=0.2)
            assert not [e.error for e in events if e.kind == ERROR]
            assert [e.kv_bytes for e in events if e.kind == KV_GOT] == [event.kv_bytes]
            tokens = [event.token_id] + [e.token_id for e in events if e.kind == TOKEN]
            assert tokens == reference_generate(tiny.model, prompt, 8)
        assert prefill.status()["engine_empty"] and decode.status()["engine_empty"]
    finally:
        for worker in workers:
            worker.shutdown()
        assert all(p.exitcode == 0 for w in workers if w._instance for p in w._instance.processes)


def test_a_colocated_worker_at_tp2_serves_generates_tokens(tiny):
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False, rank_devices=_ranks(2))
    try:
        assert loop.info()["tp"] == 2
        prompts = random_prompts([6, 45, 19, 30], seed=10)
        for i, prompt in enumerate(prompts):
            loop.submit(Request(f"c{i}", tuple(prompt), SamplingParams(max_tokens=10)))
        events = collect_events(loop, lambda ev: any(e.kind == ERROR for e in ev) or sum(
            1 for e in ev if e.kind == TOKEN and e.finish_reason) == len(prompts), 60.0)
        assert not [e for e in events if e.kind == ERROR], events
        for i, prompt in enumerate(prompts):
            got = [e.token_id for e in events if e.kind == TOKEN and e.request_id == f"c{i}"]
            assert got == reference_generate(tiny.model, prompt, 10)
        assert loop.status()["engine_empty"]
    finally:
        loop.shutdown()
    assert [p.exitcode for p in loop._instance.processes] == [0]
