"""Disaggregated workers whose instances have different TP sizes (``rank_devices``): prefill
TP 2 to decode TP 1, 1 to 2 and 2 to 2, over the in-process and shared-memory transports, whole
and layer-wise, with a prefix cached on the decode side; the tokens equal ``generate()`` and
each decode rank receives the formula's bytes over its TP. Over shared memory each rank puts
and gets its own slices (its process in the records; rank 0 never gathers nor scatters every
head); in-process, rank 0 does. Each instance's other ranks are spawned processes (gloo)."""

from __future__ import annotations

import os

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import collect_events

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.events import ERROR, KV_GOT, PREFILLED, TOKEN
from engine.kv_heads import bytes_per_decode_rank, transfer_map
from engine.parallel import InstanceKVStore
from engine.request import Request, SamplingParams
from engine.serving import EngineLoop
from kv_transfer.inprocess import InProcessTransport
from prefill_worker import PrefillWorker

TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64,
                      kv_cache_memory_gb=0.02)


def _ranks(tp: int) -> tuple[str, ...]:
    return ("cpu",) * (tp - 1)  # not bound (bind=False): the device names only count ranks


def _per_rank(records, rid: str) -> tuple[dict[int, int], set[tuple[int, int, int, int]]]:
    """A request's bytes per decode rank and its (prefill rank, decode rank, heads) slices."""
    mine = [r for r in records if r["request_id"] == rid]
    sent: dict[int, int] = {}
    for r in mine:
        sent[r["decode_rank"]] = sent.get(r["decode_rank"], 0) + r["num_bytes"]
    return sent, {(r["prefill_rank"], r["decode_rank"], r["head_start"], r["head_end"])
                  for r in mine}


@pytest.mark.parametrize("transport,granularity,prefill_tp,decode_tp", [
    ("inprocess", "request", 2, 1), ("shm", "layer", 2, 1),
    ("shm", "request", 1, 2), ("inprocess", "layer", 1, 2),
    ("shm", "layer", 2, 2), ("inprocess", "request", 2, 2),
])
def test_prefill_and_decode_at_different_tp_give_generates_tokens(
        tiny, transport, granularity, prefill_tp, decode_tp, monkeypatch):
    """Each decode rank receives its KV heads, kv_bytes / decode TP per request (2 KV heads,
    TP <= 2), in the slices transfer_map names; a prompt whose first 32 tokens the decode
    instance caches receives only the rest. Over shm the process of prefill rank i puts and
    the process of decode rank j gets slice (i, j), and no instance's rank 0 reads or writes
    every head."""
    whole_heads = {"read": 0, "write": 0}  # InstanceKVStore's gathers and scatters
    for op in whole_heads:
        def counted(self, *args, _op=op, _f=getattr(InstanceKVStore, op), **kwargs):
            whole_heads[_op] += 1
            return _f(self, *args, **kwargs)
        monkeypatch.setattr(InstanceKVStore, op, counted)
    transfer = TransferConfig(transport=transport, granularity=granularity, timeout_s=20.0)
    shared = InProcessTransport() if transport == "inprocess" else None  # shm: one per worker
    spec = tiny.kv_spec
    slices = {(s.prefill_rank, s.decode_rank, s.heads.start, s.heads.stop)
              for s in transfer_map(spec.num_kv_heads, prefill_tp, decode_tp)}
    workers = []
    try:
        prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer, transport=shared,
                                bind=False, rank_devices=_ranks(prefill_tp), decode_tp=decode_tp)
        workers.append(prefill)
        decode = DecodeWorker("decode-0", TINY, ENGINE, transfer, transport=shared, bind=False,
                              rank_devices=_ranks(decode_tp))
        workers.append(decode)
        assert (prefill.info()["tp"], decode.info()["tp"]) == (prefill_tp, decode_tp)
        assert prefill.info()["kv_spec"] == decode.info()["kv_spec"] == spec.to_dict()
        prompts = random_prompts([11, 40, 23], seed=9)
        prompts.append(prompts[1][:32] + random_prompts([9], seed=10)[0])  # 2 cached blocks
        for i, prompt in enumerate(prompts):
            start = 32 if i == 3 else 0
            request = Request(f"r{i}", tuple(prompt), SamplingParams(max_tokens=8))
            prefill.submit(request, kv_token_start=start)
            events = collect_events(prefill, lambda ev: any(
                e.kind in (PREFILLED, ERROR) and e.request_id == request.request_id for e in ev),
                30.0, poll_s=0.2)
            done = [e for e in events if e.kind in (PREFILLED, ERROR)]
            assert [e.kind for e in done] == [PREFILLED], done
            event = done[0]
            formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4 * (len(prompt) - start)
            assert event.kv_bytes == formula == spec.kv_bytes(len(prompt) - start)  # every head
            decode.admit(request, event.token_id, event.kv_handles, kv_token_start=start)
            events = collect_events(decode, lambda ev: any(e.kind == ERROR for e in ev) or any(
                e.kind == TOKEN and e.finish_reason for e in ev), 30.0, poll_s=0.2)
            assert not [e.error for e in events if e.kind == ERROR]
            assert [e.kv_bytes for e in events if e.kind == KV_GOT] == [event.kv_bytes]
            tokens = [event.token_id] + [e.token_id for e in events if e.kind == TOKEN]
            assert tokens == reference_generate(tiny.model, prompt, 8)
            records = decode.transfer_records()
            per_rank, got = _per_rank(records, request.request_id)
            assert per_rank == {j: formula // decode_tp for j in range(decode_tp)}
            assert formula // decode_tp == bytes_per_decode_rank(spec, len(prompt) - start,
                                                                 decode_tp)
            assert got == slices
            if transport == "shm":  # who put and who got each slice: its ranks' processes
                put_by, got_by = _pids(prefill), _pids(decode)
                assert {(r["prefill_rank"], r["decode_rank"], r["put_pid"], r["get_pid"])
                        for r in records if r["request_id"] == request.request_id} == {
                    (i, j, put_by[i], got_by[j]) for i, j, _, _ in slices}
        assert prefill.status()["transport_held"] == decode.status()["transport_held"] == 0
        if transport == "shm":
            assert whole_heads == {"read": 0, "write": 0}
        else:  # rank 0 gathers (prefill TP 2) or scatters (decode TP 2) every head
            assert (whole_heads["read"] > 0, whole_heads["write"] > 0) == (
                prefill_tp > 1, decode_tp > 1)
        assert prefill.status()["engine_empty"] and decode.status()["engine_empty"]
    finally:
        for worker in workers:
            worker.shutdown()
        assert all(p.exitcode == 0 for w in workers if w._instance for p in w._instance.processes)


def _pids(worker) -> list[int]:
    """The process of each rank of a worker's instance (rank 0: this one)."""
    return [os.getpid()] + [p.pid for p in (worker._instance.processes if worker._instance else [])]


def test_a_decode_instance_refuses_kv_split_for_another_tp(tiny):
    """KV split for a TP-2 decode instance reaching a TP-1 one fails that request, naming both."""
    transfer = TransferConfig(transport="inprocess", timeout_s=20.0)
    shared = InProcessTransport()
    prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer, transport=shared, bind=False,
                            decode_tp=2)
    decode = DecodeWorker("decode-0", TINY, ENGINE, transfer, transport=shared, bind=False)
    try:
        request = Request("r0", tuple(random_prompts([20], seed=4)[0]), SamplingParams(max_tokens=4))
        prefill.submit(request)
        events = collect_events(prefill, lambda ev: any(e.kind == PREFILLED for e in ev), 30.0)
        event = next(e for e in events if e.kind == PREFILLED)
        assert len(event.kv_handles) == 2
        decode.admit(request, event.token_id, event.kv_handles)
        events = collect_events(decode, lambda ev: any(e.kind == ERROR for e in ev), 30.0)
        error = next(e.error for e in events if e.kind == ERROR)
        assert "split for a TP 2 decode instance; decode-0 runs at TP 1" in error
        assert decode.status()["engine_empty"]
    finally:
        prefill.shutdown()
        decode.shutdown()


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


def test_a_rank_whose_put_or_get_fails_fails_its_request_alone(tiny):
    """TP 2 to TP 2 over shm: a put failing on the prefill ranks and a get failing on decode
    rank 1 (its slice freed before the fetch) each fail their request with an error naming
    the rank and the cause, every handle freed; the next request is served."""
    transfer = TransferConfig(transport="shm", timeout_s=20.0)
    prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer, bind=False,
                            rank_devices=_ranks(2), decode_tp=2,
                            faults={"fail": True, "only_request_ids": ["bad"]})
    decode = DecodeWorker("decode-0", TINY, ENGINE, transfer, bind=False, rank_devices=_ranks(2))
    workers = [prefill, decode]

    def prefilled(request: Request):
        prefill.submit(request)
        events = collect_events(prefill, lambda ev: any(
            e.kind in (PREFILLED, ERROR) and e.request_id == request.request_id for e in ev),
            30.0, poll_s=0.2)
        return next(e for e in events if e.kind in (PREFILLED, ERROR))

    def decoded(request: Request, event):
        decode.admit(request, event.token_id, event.kv_handles)
        return collect_events(decode, lambda ev: any(e.kind == ERROR for e in ev) or any(
            e.kind == TOKEN and e.finish_reason for e in ev), 30.0, poll_s=0.2)

    try:
        prompts = random_prompts([30, 21, 17], seed=12)
        bad = prefilled(Request("bad", tuple(prompts[0]), SamplingParams(max_tokens=4)))
        assert bad.kind == ERROR
        assert ("KV of request bad: prefill rank 0: TransferFailed: injected put failure for "
                "request bad; prefill rank 1: TransferFailed: injected put failure") in bad.error

        lost = Request("lost", tuple(prompts[1]), SamplingParams(max_tokens=4))
        event = prefilled(lost)
        assert event.kind == PREFILLED and sorted(h.decode_rank for h in event.kv_handles) == [0, 1]
        rank1 = next(h for h in event.kv_handles if h.decode_rank == 1)
        prefill.call(lambda: prefill.transport.free(rank1))
        errors = [e for e in decoded(lost, event) if e.kind == ERROR]
        assert len(errors) == 1 and errors[0].kv_fetch_failed
        assert errors[0].error.startswith("KV transfer failed: TransferFailed: KV of request "
                                          "lost: decode rank 1: TransferFailed: no KV for "
                                          "request lost in slot")
        assert "already freed" in errors[0].error and "decode rank 0" not in errors[0].error

        good = Request("good", tuple(prompts[2]), SamplingParams(max_tokens=6))
        event = prefilled(good)
        events = decoded(good, event)
        assert not [e.error for e in events if e.kind == ERROR]
        tokens = [event.token_id] + [e.token_id for e in events if e.kind == TOKEN]
        assert tokens == reference_generate(tiny.model, prompts[2], 6)
        assert prefill.status()["transport_held"] == decode.status()["transport_held"] == 0
        assert decode.status()["engine_empty"] and decode.status()["transfers_held"] == 0
    finally:
        for worker in workers:
            worker.shutdown()
    assert all(p.exitcode == 0 for w in workers for p in w._instance.processes)
