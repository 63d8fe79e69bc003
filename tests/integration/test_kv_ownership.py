"""KV has exactly one owner, and transfer is a scheduler state.

- A decode worker reserves a KV slot before it fetches; several fetches run at once, so a
  slow one never holds back the others.
- A prefill worker never blocks on a full transport buffer: it keeps the KV in its own
  engine and puts it once there is room (the shm example of the issue: arena for three
  64-token prompts, 8 requests, decode max_num_seqs=1: 8 of 8 succeed).
- An abort that arrives while the KV is in flight wins: the request never decodes, its
  handles and its slot are freed.
- A prefill-only request reserves prompt + 1 tokens.
Every test ends with engines empty, transports holding nothing and all slots free.
Plain worker objects in this process (no Ray, no pinning).
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import random_prompts, reference_generate
from placement_helpers import collect_events, events_within

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.engine import Engine
from engine.events import ERROR, KV_GOT, PREFILLED, TOKEN
from engine.request import Request, SamplingParams
from kv_transfer.faults import FaultyTransport
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.nixl import nixl_available
from kv_transfer.shm import SharedMemoryTransport
from prefill_worker import PrefillWorker
from router.calls import LocalCalls
from router.router import Router, WorkerRef

TINY = ModelConfig("tiny-random-llama")
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # 2 * layers * kv_heads * head_dim * fp32 itemsize
NEEDS_NIXL = pytest.mark.skipif(not nixl_available(), reason="pip install 'pdlab[nixl]'")


collect = collect_events  # 20 s deadline, 0.2 s polls


def until(predicate, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, "condition not reached"
        time.sleep(0.005)


def finished(rid: str):
    return lambda events: any(e.request_id == rid and (e.kind == ERROR or (
        e.kind == TOKEN and e.finish_reason)) for e in events)


def assert_empty(*workers) -> None:
    for worker in workers:
        status = worker.status()
        assert status["engine_empty"], status
        assert status["transport_held"] == 0, status
        assert worker.call(lambda w=worker: w.engine.scheduler.capacity.num_used_blocks) == 0


@pytest.fixture
def shutdown_after():
    made = []
    yield made.append
    for worker in made:
        worker.shutdown()


def prefilled_kv(tiny, request: Request):
    """(first token, prompt KV) of ``request`` from a bare prefill engine."""
    engine = Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=128))
    engine.add_request(request, prefill_only=True)
    first = engine.step()[0].token_id
    kv, _ = engine.export_kv(request.request_id)
    return first, kv


# ---- the example: a full shm arena never blocks the prefill loop ----------------

def arena_of(transport_name: str, kv_bytes: int):
    """A transport whose arena holds three ``kv_bytes`` transfers; alloc_timeout_s=0: any put
    made without room fails at once with "arena full", so a prefill loop that tried to put
    into the full arena would fail requests."""
    if transport_name == "nixl":
        from kv_transfer.nixl import ALIGN, TAIL_BYTES, NixlTransport

        extent = -(-(kv_bytes + TAIL_BYTES) // ALIGN) * ALIGN
        return NixlTransport(capacity_bytes=3 * extent, landing_bytes=1 << 20,
                             alloc_timeout_s=0.0)
    return SharedMemoryTransport(capacity_bytes=3 * kv_bytes, num_slots=16, alloc_timeout_s=0.0)


@pytest.mark.parametrize("transport_name", ["shm", pytest.param("nixl", marks=NEEDS_NIXL)])
@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_full_arena_defers_puts_8_of_8_succeed(tiny, shutdown_after, granularity, transport_name):
    kv_bytes = 64 * KV_BYTES_PER_TOKEN  # 32 KiB per 64-token prompt
    shm = arena_of(transport_name, kv_bytes)
    transfer = TransferConfig(transport=transport_name, timeout_s=10.0,
                              granularity=granularity, layers_per_chunk=1)
    prefill = PrefillWorker("prefill-0", TINY, EngineConfig(max_num_seqs=8, max_model_len=128,
                            max_num_batched_tokens=512), transfer, transport=shm, bind=False)
    shutdown_after(prefill)
    decode = DecodeWorker("decode-0", TINY, EngineConfig(max_num_seqs=1, max_model_len=128,
                          max_num_batched_tokens=16), transfer, transport=shm, bind=False,
                          step_delay_s=0.01)
    shutdown_after(decode)
    calls = LocalCalls()
    router = Router([WorkerRef("prefill-0", "prefill", prefill, 0),
                     WorkerRef("decode-0", "decode", decode, 1)], calls, "disagg:1p1d",
                    deadline_s=30.0)
    prompts = random_prompts([64] * 8, seed=11)
    workload = [(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=4, ignore_eos=True)), 0.0)
                for i, p in enumerate(prompts)]
    try:
        records = router.run(workload)
    finally:
        calls.shutdown()
    assert [r.error for r in records] == [None] * 8
    for record, prompt in zip(records, prompts):
        assert record.output_token_ids == reference_generate(tiny.model, prompt, 4)
        assert record.kv_bytes == kv_bytes
    assert prefill.num_deferred_puts >= 1  # the arena really was full at some point
    if transport_name == "nixl":
        assert shm.num_held() == 0 and not shm._arena.extents and not shm._leases
    else:
        assert shm.num_held() == 0 and not shm._allocated and not shm._leases
    assert_empty(prefill, decode)


def test_prefill_loop_stays_responsive_while_the_arena_is_full(tiny, shutdown_after):
    kv_bytes = 16 * KV_BYTES_PER_TOKEN
    shm = SharedMemoryTransport(capacity_bytes=2 * kv_bytes, num_slots=8, alloc_timeout_s=0.0)
    prefill = PrefillWorker("prefill-0", TINY, EngineConfig(max_num_seqs=4, max_model_len=64,
                            max_num_batched_tokens=64), TransferConfig(transport="shm"),
                            transport=shm, bind=False)
    shutdown_after(prefill)
    for i, prompt in enumerate(random_prompts([16] * 4, seed=12)):
        prefill.submit(Request(f"p{i}", tuple(prompt), SamplingParams(max_tokens=3)))
    events = collect(prefill, lambda ev: len([e for e in ev if e.kind == PREFILLED]) == 2)
    assert [e.request_id for e in events if e.kind == PREFILLED] == ["p0", "p1"]
    # the loop answers calls (it is not blocked in a put) and holds p2, p3 in its engine
    until(lambda: prefill.call(lambda: list(prefill._deferred)) == ["p2", "p3"])
    assert prefill.status()["transport_held"] == 2 and not prefill.status()["engine_empty"]
    prefill.abort("p3")  # a deferred request aborted: its prefill slot is freed
    p0 = next(e for e in events if e.request_id == "p0" and e.kind == PREFILLED)
    for handle in p0.kv_handles:
        shm.free(handle)  # the consumer frees p0: the oldest deferred put (p2) goes out
    later = collect(prefill, lambda ev: any(e.kind == PREFILLED for e in ev))
    assert [e.request_id for e in later if e.kind == PREFILLED] == ["p2"]
    assert events_within(prefill, 0.1) == []  # p3 was aborted: it never leaves
    for event in events + later:
        for handle in event.kv_handles:
            shm.free(handle)
    assert shm.num_held() == 0
    assert prefill.status()["engine_empty"] and prefill.num_deferred_puts == 2


# ---- decode side: reserve, then fetch; many fetches at once -------------------------------

def delayed_decode(tiny, shutdown_after, max_num_seqs: int, delay_for: list[str], delay_s: float):
    inner = InProcessTransport()
    transport = FaultyTransport(inner, delay_s=delay_s, only_request_ids=delay_for)
    decode = DecodeWorker("decode-0", TINY, EngineConfig(max_num_seqs=max_num_seqs,
                          max_model_len=128, max_num_batched_tokens=32),
                          TransferConfig(transport="inprocess", timeout_s=10.0),
                          transport=transport, bind=False)
    shutdown_after(decode)
    return decode, inner


def test_slow_transfer_does_not_hold_back_others(tiny, shutdown_after):
    decode, inner = delayed_decode(tiny, shutdown_after, 2, ["slow"], delay_s=1.0)
    slow, fast = (Request(rid, tuple(p), SamplingParams(max_tokens=5, ignore_eos=True))
                  for rid, p in zip(("slow", "fast"), random_prompts([9, 12], seed=13)))
    handles = {}
    for request in (slow, fast):
        first, kv = prefilled_kv(tiny, request)
        handles[request.request_id] = (first, inner.put(request.request_id, tiny.kv_spec, kv))
    for request in (slow, fast):  # slow first: one fetch thread would serve it first
        first, handle = handles[request.request_id]
        decode.admit(request, first, (handle,))
    events = collect(decode, lambda ev: finished("slow")(ev) and finished("fast")(ev))
    order = [(e.kind, e.request_id) for e in events]
    fast_done = max(i for i, (k, rid) in enumerate(order) if rid == "fast" and k == TOKEN)
    assert fast_done < order.index((KV_GOT, "slow"))  # fast decoded entirely meanwhile
    for request in (slow, fast):
        tokens = [e.token_id for e in events if e.kind == TOKEN and e.request_id == request.request_id]
        want = reference_generate(tiny.model, list(request.prompt_token_ids), 5)
        assert [handles[request.request_id][0]] + tokens == want
    assert inner.num_held() == 0
    assert_empty(decode)


class OrderedTransport(InProcessTransport):
    ordered_gets = True  # as NCCL: gets from one sender must follow its puts' order


def test_a_transport_that_needs_ordered_gets_is_fetched_in_order(tiny, shutdown_after):
    inner = OrderedTransport()
    transport = FaultyTransport(inner, delay_s=0.3, only_request_ids=["first"])
    decode = DecodeWorker("decode-0", TINY, EngineConfig(max_num_seqs=2, max_model_len=64,
                          max_num_batched_tokens=32), TransferConfig(transport="inprocess"),
                          transport=transport, bind=False)
    shutdown_after(decode)
    requests = [Request(rid, (5, 6, 7), SamplingParams(max_tokens=2)) for rid in ("first", "next")]
    for request in requests:
        handle = inner.put(request.request_id, tiny.kv_spec, torch.zeros(tiny.kv_spec.kv_shape(3)))
        decode.admit(request, 10, (handle,))
    events = collect(decode, lambda ev: finished("first")(ev) and finished("next")(ev))
    assert [e.request_id for e in events if e.kind == KV_GOT] == ["first", "next"]
    assert_empty(decode)


def test_abort_while_kv_in_flight_never_decodes(tiny, shutdown_after):
    decode, inner = delayed_decode(tiny, shutdown_after, 1, ["inflight"], delay_s=0.5)
    spec = tiny.kv_spec
    inflight = Request("inflight", (5, 6, 7), SamplingParams(max_tokens=4))
    queued = Request("queued", (8, 9), SamplingParams(max_tokens=4))
    h1 = inner.put("inflight", spec, torch.zeros(spec.kv_shape(3)))
    h2 = inner.put("queued", spec, torch.zeros(spec.kv_shape(2)))
    decode.admit(inflight, 10, (h1,))
    decode.admit(queued, 10, (h2,))  # one slot: queued waits for a reservation
    until(lambda: decode.call(lambda: [s.request_id for s in decode.engine.scheduler.receiving])
          == ["inflight"])
    assert inner.num_held() == 2
    decode.abort("queued")  # never reserved: its handle is freed at once
    until(lambda: inner.num_held() == 1)
    decode.abort("inflight")  # its fetch is sleeping in the transport right now
    assert decode.call(lambda: decode.engine.scheduler.capacity.num_used_blocks) == 0
    until(lambda: decode.status()["transfers_held"] == 0)  # the fetch came back
    assert inner.num_held() == 0
    events = collect_events(decode, lambda events: len(events) >= 2)
    assert [(e.kind, e.request_id, e.error) for e in events] == [  # nothing ran, causes named
        (ERROR, "queued", "aborted on decode-0 while waiting for a KV slot"),
        (ERROR, "inflight", "aborted on decode-0 while its KV was in flight")]
    assert decode.engine.step_records == []
    assert_empty(decode)


def test_failed_fetch_frees_the_reserved_slot_and_names_the_cause(tiny, shutdown_after):
    decode, inner = delayed_decode(tiny, shutdown_after, 1, [], delay_s=0.0)
    request = Request("gone", (5, 6, 7), SamplingParams(max_tokens=4))
    handle = inner.put("gone", tiny.kv_spec, torch.zeros(tiny.kv_spec.kv_shape(3)))
    inner.free(handle)  # the bytes are gone before the decode side fetches them
    decode.admit(request, 10, (handle,))
    events = collect(decode, finished("gone"))
    assert "KV transfer failed: TransferFailed" in events[-1].error
    assert_empty(decode)


# ---- a prefill-only request reserves prompt + 1 tokens -----------------------------------

@pytest.mark.parametrize("reservation,reserved", [("full", 31), ("on_demand", 30)])
def test_prefill_only_reserves_prompt_plus_one(tiny, reservation, reserved):
    """Reserved whole: prompt + 1 tokens, never + max_tokens; on demand: the prompt tokens
    it computes (the first token's KV is computed by its decode worker)."""
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256,
                                       max_num_batched_tokens=128, kv_capacity_tokens=256,
                                       kv_reservation=reservation))
    prompts = random_prompts([30] * 4, seed=14)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"p{i}", tuple(prompt), SamplingParams(max_tokens=100)),
                           prefill_only=True)
    outputs = engine.step()
    assert [(s.num_requests, s.num_prefill_tokens) for s in engine.step_records] == [(4, 120)]
    assert engine.scheduler.reserved_tokens == 4 * reserved
    assert engine.num_used_kv_blocks == 4 * 2  # 31 tokens = 2 blocks of 16 each
    assert [o.token_id for o in outputs] == [reference_generate(tiny.model, p, 1)[0] for p in prompts]
    for i in range(4):
        engine.export_kv(f"p{i}")
    assert engine.is_empty()


def test_failed_layer_put_of_a_request_that_ends_with_its_first_token_is_forgotten(tiny):
    """A layer-wise put that fails for a request whose first token ends it (max_tokens=1):
    the token leaves normally, and the stored error (with the frames its traceback pins) is
    dropped, so a later request with the same id is not failed by it."""
    transfer = TransferConfig(transport="inprocess", granularity="layer", layers_per_chunk=1)
    transport = FaultyTransport(InProcessTransport(), fail=True, only_request_ids=["r0"])
    prefill = PrefillWorker("prefill-0", TINY, EngineConfig(max_model_len=64), transfer,
                            transport=transport, bind=False)
    try:
        prompt = random_prompts([9], seed=17)[0]
        prefill.submit(Request("r0", tuple(prompt), SamplingParams(max_tokens=1)))
        events = collect(prefill, finished("r0"))
        assert [(e.kind, e.token_id, e.finish_reason) for e in events] == [
            (TOKEN, reference_generate(tiny.model, prompt, 1)[0], "length")]
        assert prefill.call(lambda: (dict(prefill._put_errors), set(prefill._no_room))) == ({}, set())
        assert prefill.status() == {"name": "prefill-0", "engine_empty": True, "transport_held": 0}
    finally:
        prefill.shutdown()
