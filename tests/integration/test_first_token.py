"""A prefill worker's first token leaves before its KV put: real prefill and decode workers in
this process behind a router, over an in-process transport whose put waits for the test.

- The first token reaches the router's stream while the put is still held; once released the
  request decodes to ``generate()``'s tokens, exactly ``max_tokens`` of them.
- A put that fails, or a prefill loop that dies inside it, after the first token left: the
  request fails naming the cause, with that token counted once.
- An abort between the token and ``prefilled`` frees the KV the put left at the prefill worker.
- A put deferred for want of buffer room sends the first token all the same; when room comes
  with a later step, that step's first tokens leave before the deferred put starts.
Every test ends with engines empty and transports holding nothing.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import collect_events, watch_sends

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.metrics import KV_PUT
from engine.request import Request, RequestStatus, SamplingParams
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.transport import TransferFailed
from prefill_worker import PrefillWorker
from router.calls import LocalCalls
from router.router import FINISH, TOKEN, Router, WorkerRef

TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128)
WAIT_S = 20.0  # bound on every wait: a broken order fails the test, never hangs it


class LoopKilled(BaseException):
    """Escapes ``PrefillWorker``'s put handling (which catches ``Exception``): its loop dies."""


class GatedTransport(InProcessTransport):
    """Each put waits for ``release``, then raises ``fail`` if set, else stores the KV; the
    buffer has room while ``room`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.put_done = threading.Event()
        self.room = threading.Event()
        self.room.set()
        self.fail: BaseException | None = None

    def has_room(self, num_bytes: int) -> bool:
        return self.room.is_set()

    def _put_frames(self, request_id, frames, dst_rank):
        if not self.release.wait(WAIT_S):
            raise TransferFailed("the test never released the put")
        if self.fail is not None:
            raise self.fail
        key = super()._put_frames(request_id, frames, dst_rank)
        self.put_done.set()
        return key


class Served:
    """A router over one prefill and one decode worker sharing a ``GatedTransport``; a
    request's stream events in ``events``, ``first`` set when its first token arrives."""

    def __init__(self) -> None:
        self.transport = GatedTransport()
        transfer = TransferConfig(transport="inprocess", timeout_s=10.0)
        self.prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer,
                                     transport=self.transport, bind=False)
        self.decode = DecodeWorker("decode-0", TINY, ENGINE, transfer,
                                   transport=self.transport, bind=False)
        self.calls = LocalCalls()
        self.router = Router([WorkerRef("prefill-0", "prefill", self.prefill, 0),
                              WorkerRef("decode-0", "decode", self.decode, 1)],
                             self.calls, "disagg:1p1d", deadline_s=30.0)
        self.events: list = []
        self.first = threading.Event()
        self.done = threading.Event()

    def sink(self, event) -> None:
        self.events.append(event)
        if event.kind == TOKEN and event.index == 0:
            self.first.set()
        if event.kind == FINISH:
            self.done.set()

    def record(self):
        assert self.done.wait(WAIT_S), self.events
        return self.events[-1].record

    def tokens(self) -> list[tuple[int, int]]:
        return [(e.index, e.token_id) for e in self.events if e.kind == TOKEN]

    def close(self) -> None:
        self.transport.release.set()
        self.router.stop()
        self.calls.shutdown()
        self.prefill.shutdown()
        self.decode.shutdown()


@pytest.fixture
def served():
    s = Served()
    s.router.start()
    yield s
    s.close()


def until(predicate) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline_s, "condition not reached"
        time.sleep(0.005)


def assert_empty(*workers) -> None:
    for worker in workers:
        status = worker.status()
        assert status["engine_empty"] and status["transport_held"] == 0, status


PROMPT = random_prompts([40], seed=5)[0]


def submit(served: Served, max_tokens: int = 4) -> None:
    served.router.submit(Request("r0", tuple(PROMPT), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), served.sink)


def test_the_first_token_streams_while_the_put_is_held(tiny, served):
    want = reference_generate(tiny.model, PROMPT, 4)
    submit(served)
    assert served.first.wait(WAIT_S), served.events
    assert served.tokens() == [(0, want[0])]  # nothing more can come: the KV is not out yet
    assert not served.transport.put_done.is_set()
    served.transport.release.set()
    record = served.record()
    assert record.error is None, record.error
    assert record.output_token_ids == want
    assert served.tokens() == list(enumerate(want))  # the first token not streamed again
    assert len(record.token_times_s) == len(record.token_worker_times_s) == 4
    assert record.timeline[KV_PUT] > record.token_times_s[0]  # the put ended after it left
    assert record.kv_bytes > 0 and record.kv_put_s is not None
    until(lambda: served.prefill.status()["transport_held"] == 0)
    assert_empty(served.prefill, served.decode)


@pytest.mark.parametrize("fault, cause", [
    (TransferFailed("link down"), "KV put failed: TransferFailed: link down"),
    (LoopKilled("the put's process crashed"),
     "prefill worker prefill-0 died: prefill worker prefill-0: engine loop died: "
     "LoopKilled: the put's process crashed")])
def test_a_put_failing_after_the_first_token_fails_the_request_with_its_cause(
        tiny, served, fault, cause):
    want = reference_generate(tiny.model, PROMPT, 1)
    submit(served)
    assert served.first.wait(WAIT_S), served.events
    served.transport.fail = fault
    served.transport.release.set()
    record = served.record()
    assert record.finish_reason == "error" and cause in record.error, record.error
    assert record.output_token_ids == want and served.tokens() == [(0, want[0])]
    assert len(record.token_times_s) == 1
    if isinstance(fault, LoopKilled):
        assert not served.router.workers["prefill-0"].alive
        assert_empty(served.decode)
    else:
        assert_empty(served.prefill, served.decode)


def test_an_abort_between_the_first_token_and_prefilled_frees_the_kv(tiny, served):
    want = reference_generate(tiny.model, PROMPT, 1)
    submit(served)
    assert served.first.wait(WAIT_S), served.events
    served.router.abort("r0")
    record = served.record()
    assert record.finish_reason == "abort" and record.output_token_ids == want
    served.transport.release.set()
    assert served.transport.put_done.wait(WAIT_S)
    until(lambda: served.prefill.status()["transport_held"] == 0)
    assert_empty(served.prefill, served.decode)
    assert served.tokens() == [(0, want[0])]


def test_a_deferred_put_sends_the_first_token_at_once(tiny, served):
    want = reference_generate(tiny.model, PROMPT, 4)
    served.transport.room.clear()
    served.transport.release.set()
    submit(served)
    assert served.first.wait(WAIT_S), served.events
    assert served.tokens() == [(0, want[0])]
    assert served.prefill.call(lambda: served.prefill.num_deferred_puts) == 1
    served.transport.room.set()
    record = served.record()
    assert record.error is None and record.output_token_ids == want
    assert served.tokens() == list(enumerate(want))
    until(lambda: served.prefill.status()["transport_held"] == 0)
    assert_empty(served.prefill, served.decode)


class RoomOnceR1Prefilled(InProcessTransport):
    """The buffer has room only once r1 is PREFILLED; each put notes whether r1's first token
    had left the worker's port by then."""

    def __init__(self) -> None:
        super().__init__()
        self.worker, self.sent, self.puts = None, [], []

    def has_room(self, num_bytes: int) -> bool:
        state = self.worker.engine.states.get("r1")
        return state is not None and state.status == RequestStatus.PREFILLED

    def put(self, request_id, *args, **kwargs):
        self.puts.append((request_id, "r1" in self.sent))
        return super().put(request_id, *args, **kwargs)


def test_a_deferred_put_that_finds_room_starts_after_that_step_s_first_tokens():
    """r0's put waits for room, which comes with r1's step: r1's first token leaves before
    r0's put starts (a put is never inside another request's TTFT), then r1's put."""
    transport = RoomOnceR1Prefilled()
    worker = PrefillWorker("prefill-0", TINY, ENGINE, TransferConfig(), transport=transport,
                           bind=False)
    transport.worker = worker
    watch_sends(worker, lambda events: transport.sent.extend(
        e.request_id for e in events if e.kind == "token"))
    try:
        worker.submit(Request("r0", tuple(range(10, 50)), SamplingParams(max_tokens=4)))
        until(lambda: worker.call(lambda: worker.num_deferred_puts) == 1)
        worker.submit(Request("r1", tuple(range(60, 90)), SamplingParams(max_tokens=4)))
        events = collect_events(worker, lambda got: sum(e.kind == "prefilled" for e in got) == 2,
                                timeout_s=WAIT_S)
        status = worker.status()
    finally:
        worker.shutdown()
    assert transport.puts == [("r0", True), ("r1", True)]
    assert [e.request_id for e in events if e.kind == "prefilled"] == ["r0", "r1"]
    assert status["engine_empty"]
