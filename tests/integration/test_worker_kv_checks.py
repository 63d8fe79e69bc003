"""A decode worker checks every KV payload against its own KVSpec and the prompt length
before it decodes: a mismatch is an ``error`` event naming the field, expected and got; the
handles are freed; the worker keeps serving. Plain worker objects sharing one in-process
transport (no Ray, no pinning)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_prompts
from placement_helpers import collect_events, events_within

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.engine import Engine
from engine.events import ERROR, KV_GOT, PREFILLED, TOKEN
from engine.model import load_model
from engine.request import Request, SamplingParams
from kv_transfer.inprocess import InProcessTransport
from prefill_worker import PrefillWorker

TINY32 = ModelConfig("tiny-random-llama")
TINY16 = ModelConfig("tiny-random-llama", dtype="bfloat16")
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
TRANSFER = TransferConfig(transport="inprocess", timeout_s=5.0)


@dataclasses.dataclass
class Workers:
    transport: InProcessTransport
    prefill32: PrefillWorker
    prefill16: PrefillWorker
    decode16: DecodeWorker


@pytest.fixture(scope="module")
def workers():
    transport = InProcessTransport()
    made = []
    try:
        for cls, name, model in ((PrefillWorker, "prefill-fp32", TINY32),
                                 (PrefillWorker, "prefill-bf16", TINY16),
                                 (DecodeWorker, "decode-bf16", TINY16)):
            made.append(cls(name, model, ENGINE, TRANSFER, transport=transport, bind=False))
        yield Workers(transport, *made)
    finally:
        for worker in made:
            worker.shutdown()
    assert all(not w._thread.is_alive() for w in made)


def wait_for(worker, done, timeout_s: float = 10.0) -> list:
    """Collect ``worker``'s events until ``done(events)``; fail at the deadline."""
    return collect_events(worker, done, timeout_s, poll_s=0.5)


def has(kind: str, rid: str):
    return lambda events: any(e.kind == kind and e.request_id == rid for e in events)


def only(events, kind: str, rid: str):
    found = [e for e in events if e.kind == kind and e.request_id == rid]
    assert len(found) == 1, events
    return found[0]


def prefill(worker: PrefillWorker, request: Request):
    worker.submit(request)
    events = wait_for(worker, lambda ev: has(PREFILLED, request.request_id)(ev)
                      or has(ERROR, request.request_id)(ev))
    event = only(events, PREFILLED, request.request_id)
    assert len(event.kv_handles) == 1
    return event


def assert_rejected(w: Workers, request: Request, first_token: int, handles, *words,
                    fetched: bool = False, refused: bool = False) -> str:
    """Admit ``request`` with ``handles``; the decode worker must answer with one error event
    containing ``words``, produce no token, and free the handles. ``fetched``: the bytes
    themselves were fine (a ``kv_got`` precedes the error); ``refused``: the admit was refused
    before any fetch. Only a failed fetch is marked ``kv_fetch_failed``."""
    w.decode16.admit(request, first_token, handles)
    events = wait_for(w.decode16, has(ERROR, request.request_id))
    event = only(events, ERROR, request.request_id)
    error = event.error
    assert event.kv_fetch_failed == (not fetched and not refused)
    for word in words:
        assert word in error, f"{word!r} missing from {error!r}"
    rid = request.request_id
    assert not [e for e in events if e.kind == TOKEN and e.request_id == rid]
    assert len([e for e in events if e.kind == KV_GOT and e.request_id == rid]) == int(fetched)
    assert w.transport.num_held() == 0  # the handles were freed on the error path
    assert w.decode16.status()["engine_empty"]
    return error


def serve(w: Workers, request: Request) -> list[int]:
    """Prefill in bf16, decode in bf16; returns every output token."""
    event = prefill(w.prefill16, request)
    assert w.transport.num_held() == 1
    w.decode16.admit(request, event.token_id, event.kv_handles)
    rid = request.request_id
    events = wait_for(w.decode16, lambda ev: any(e.kind == ERROR for e in ev) or any(
        e.kind == TOKEN and e.request_id == rid and e.finish_reason for e in ev))
    assert not [e for e in events if e.kind == ERROR], events
    tokens = [e for e in events if e.kind == TOKEN and e.request_id == rid]
    assert [e.index for e in tokens] == list(range(1, len(tokens) + 1))
    got = only(events, KV_GOT, rid)
    assert got.kv_bytes == 2 * 2 * 2 * 16 * request.num_prompt_tokens * 2  # bf16, not upcast
    assert w.transport.num_held() == 0
    assert w.decode16.status()["engine_empty"] and w.prefill16.status()["engine_empty"]
    return [event.token_id] + [e.token_id for e in tokens]


@pytest.fixture(scope="module")
def bf16_reference():
    """Colocated bf16 engine on the same tiny weights: what disaggregated bf16 must produce."""
    engine = Engine(load_model(TINY16), ENGINE)
    return lambda request: engine.generate([request])[request.request_id]


def ok_request(rid: str, seed: int = 0, length: int = 7, max_tokens: int = 6) -> Request:
    prompt = random_prompts([length], seed=seed)[0]
    return Request(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_baseline_bf16_prefill_to_bf16_decode(workers, bf16_reference):
    request = ok_request("base", seed=1)
    tokens = serve(workers, request)
    assert len(tokens) == 6
    assert tokens == bf16_reference(request)


def test_dtype_mismatch_is_named_then_worker_still_serves(workers, bf16_reference):
    w = workers
    request = ok_request("fp32-kv", seed=2, length=5)
    event = prefill(w.prefill32, request)
    assert w.transport.num_held() == 1
    assert event.kv_bytes == 2 * 2 * 2 * 16 * 5 * 4  # fp32 payload
    error = assert_rejected(w, request, event.token_id, event.kv_handles,
                            "fp32-kv", "dtype", "expected bfloat16", "got float32")
    assert error.startswith("KV transfer failed: KVSpecMismatch")
    assert w.prefill32.status()["engine_empty"]
    after = ok_request("after-dtype", seed=3)
    assert serve(w, after) == bf16_reference(after)


def test_kv_head_mismatch_is_named(workers, bf16_reference):
    w = workers
    spec = w.decode16.engine.kv_spec
    wrong = dataclasses.replace(spec, num_kv_heads=4)
    request = ok_request("heads", seed=4, length=5)
    kv = torch.randn(wrong.kv_shape(5)).to(torch.bfloat16)  # [2, 2, 4, 5, 16]
    handle = w.transport.put("heads", wrong, kv)
    assert w.transport.num_held() == 1
    assert_rejected(w, request, 7, (handle,), "heads", "num_kv_heads", "expected 2", "got 4")
    after = ok_request("after-heads", seed=5)
    assert serve(w, after) == bf16_reference(after)


def test_token_count_mismatch_is_named(workers, bf16_reference):
    w = workers
    spec = w.decode16.engine.kv_spec
    request = ok_request("short-kv", seed=6, length=5)
    handle = w.transport.put("short-kv", spec, torch.zeros(spec.kv_shape(3), dtype=torch.bfloat16))
    assert_rejected(w, request, 7, (handle,), "short-kv", "tokens", "expected 5", "got 3")
    after = ok_request("after-tokens", seed=7)
    assert serve(w, after) == bf16_reference(after)


def test_fingerprint_mismatch_is_named(workers):
    w = workers
    spec = w.decode16.engine.kv_spec
    other = dataclasses.replace(spec, model_fingerprint="some-other-model@000000000000")
    request = ok_request("fp", seed=8, length=4)
    handle = w.transport.put("fp", other, torch.zeros(other.kv_shape(4), dtype=torch.bfloat16))
    assert_rejected(w, request, 7, (handle,), "model_fingerprint", spec.model_fingerprint,
                    "got some-other-model@000000000000")


def test_kv_for_a_request_already_finished_by_its_first_token(workers):
    w = workers
    spec = w.decode16.engine.kv_spec
    request = Request("done", (5, 6, 7), SamplingParams(max_tokens=1))
    handle = w.transport.put("done", spec, torch.zeros(spec.kv_shape(3), dtype=torch.bfloat16))
    # refused at admission: nothing is reserved or fetched, the handle is freed at once
    assert_rejected(w, request, 9, (handle,), "done", "nothing to decode", refused=True)


def test_request_id_mismatch_is_named(workers, bf16_reference):
    w = workers
    spec = w.decode16.engine.kv_spec
    request = ok_request("mine", seed=9, length=4)
    handle = w.transport.put("someone-else", spec, torch.zeros(spec.kv_shape(4), dtype=torch.bfloat16))
    assert_rejected(w, request, 7, (handle,), "KV header mismatch for request mine",
                    "request_id expected 'mine', got 'someone-else'")
    after = ok_request("after-id", seed=10)
    assert serve(w, after) == bf16_reference(after)


def test_nothing_leaked_at_the_end(workers):
    w = workers
    assert w.transport.num_held() == 0
    for worker in (w.prefill32, w.prefill16, w.decode16):
        assert worker.status()["engine_empty"]
        assert events_within(worker, 0.05) == []
