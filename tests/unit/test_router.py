"""Router over fake workers (no model, no Ray): pool rotation, load accounting from
assignment, per-request deadlines, KV handles of late events, dead workers, validation.

The fakes speak the in-process channel (``channel.local``): each time the router waits on
its hub, every fake runs the commands that reached its port and sends what is due as one
message (its "step"), in the router's thread; a fake that died sends its last words (a
``died`` event) and falls silent. A fake prefill worker "prefills" a request
``prefill_s`` after its submit and reports the first token with one KV handle (with
``put_s`` set: a ``token`` event first, the ``prefilled`` one ``put_s`` later), which it
keeps in the shared ``FakeTransport`` until someone frees it; a fake decode worker frees
the handles on ``admit`` (it "fetched" them) and then reports ``kv_got`` and one token
every ``token_s`` seconds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter

import pytest

from channel.contract import Died
from channel.local import LocalHub, open_local_port
from engine import events as ev
from engine.metrics import ARRIVED, FINISHED
from engine.request import Request, SamplingParams
from router.calls import WorkerDied
from router.router import NothingToReplace, Router, StreamEvent, WorkerRef

SPEC = {"model_fingerprint": "fake", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
        "dtype": "float32"}


class FakeTransport:
    def __init__(self) -> None:
        self.held: set[str] = set()


class _Done:
    def __init__(self, value=None, error: Exception | None = None) -> None:
        self.value, self.error = value, error


class FakeCalls:
    """``Calls`` (the lifecycle: ``info``, ``open_channel``) whose calls run at once; a
    worker with ``dead_error`` set raises it on any but ``open_channel``."""

    def call(self, worker, method, *args):
        if worker.dead_error is not None and method != "open_channel":
            return _Done(error=worker.dead_error)
        try:
            return _Done(getattr(worker, method)(*args))
        except Exception as err:
            return _Done(error=err)

    def ready(self, pending, timeout_s):
        return list(pending)

    def result(self, pending):
        if pending.error is not None:
            raise pending.error
        return pending.value


class FakeHub(LocalHub):
    """The in-process hub; before each wait every fake worker runs its step (``FakeWorker.
    step``), and the wait is short (a fake's next event may fall due meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.fakes: list[FakeWorker] = []

    def receive(self, timeout_s: float):
        for fake in list(self.fakes):
            fake.step()
        return super().receive(min(timeout_s, 0.002))


_PORTS: list = []  # every fake's port, closed after each test (their heartbeat threads)


@pytest.fixture(autouse=True)
def _close_ports():
    yield
    while _PORTS:
        _PORTS.pop().close()


class FakeWorker:
    """Events go out at their due time; ``lose`` holds request ids never answered."""

    def __init__(self, name: str, transport: FakeTransport, prefill_s: float = 0.0,
                 token_s: float = 0.0, put_s: float | None = None) -> None:
        self.name, self.role = name, name.split("-")[0]
        self.transport, self.prefill_s, self.token_s = transport, prefill_s, token_s
        self.put_s = put_s
        self.outbox: list[tuple[float, ev.WorkerEvent]] = []
        self.lose: set[str] = set()
        self.delay_s: dict[str, float] = {}  # extra delay of one request's first event
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.released: list[str] = []
        self.owned: dict[str, tuple] = {}  # admitted, handles not yet freed
        self.dead_error: Exception | None = None
        self.router: Router | None = None
        self.loads_at_submit: list[dict[str, int]] = []
        self.min_load = 0
        self.port = None
        self.silent = False  # died and said so

    def open_channel(self, endpoint) -> None:
        hub = self.router.hub if self.router is not None else None
        self.port = open_local_port(endpoint)
        _PORTS.append(self.port)
        if hub is not None and self not in hub.fakes:
            hub.fakes.append(self)

    def _take(self) -> None:
        """Run the commands that reached the port (a dead worker runs nothing more); one
        raising ``WorkerDied`` kills the worker, another raising becomes an error event."""
        taken = self.port.take(0)
        for command in taken.cancelled:
            if command.kind == "admit":
                self.transport.held.difference_update(command.args[2])
        for command in taken.commands:
            if self.dead_error is not None:
                return
            try:
                getattr(self, command.kind)(*command.args)
            except WorkerDied as err:
                self.dead_error = err
            except Exception as err:
                self._emit(time.time(), ev.ERROR, command.request_id or "",
                           error=f"{command.kind} failed: {err!r}")

    def step(self) -> None:
        """Send what is due as one message; a dead worker's loop (``dead_error``, or a
        ``wait_events`` that raised) sends its last words instead of what was not due yet,
        then falls silent."""
        if self.port is None or self.silent:
            return
        self._take()
        try:
            events = self.wait_events(0.0)
        except Exception as err:  # its loop died
            self.dead_error, events = self.dead_error or err, []
        if events:
            self.port.send(tuple(events))
        if self.dead_error is not None:
            self.port.send((ev.WorkerEvent(ev.DIED, "", self.name, time.time(),
                                           error=str(self.dead_error)),))
            self.port.close()
            self.silent = True

    def info(self) -> dict:
        return {"kv_spec": SPEC, "max_model_len": 128, "vocab_size": 256}

    def _emit(self, due_s: float, kind: str, rid: str, **fields) -> None:
        self.outbox.append((due_s, ev.WorkerEvent(kind, rid, self.name, due_s, **fields)))

    def _watch(self) -> None:
        if self.router is not None:
            self.min_load = min(self.min_load, *self.router.loads.values())

    def submit(self, request: Request, dst_rank=None, kv_token_start: int = 0) -> None:
        self._watch()
        rid = request.request_id
        self.submitted.append(rid)
        if self.router is not None:
            self.loads_at_submit.append(dict(self.router.loads))
        if rid in self.lose:
            return
        due_s = time.time() + self.prefill_s + self.delay_s.get(rid, 0.0)
        if self.role == "colocated":
            self._tokens(request, due_s, first_index=0)
            return
        handle = f"kv-{rid}"
        self.transport.held.add(handle)
        if self.put_s is not None:
            self._emit(due_s, ev.TOKEN, rid, token_id=7, index=0, num_cached_prompt_tokens=0)
            due_s += self.put_s
        self._emit(due_s, ev.PREFILLED, rid, token_id=7, index=0, kv_handles=(handle,),
                   kv_bytes=100, num_cached_prompt_tokens=0)

    def admit(self, request: Request, first_token: int, kv_handles, kv_token_start: int = 0) -> None:
        self._watch()
        rid = request.request_id
        self.submitted.append(rid)
        if rid in self.lose:  # the handles are this worker's now: an abort frees them
            self.owned[rid] = tuple(kv_handles)
            return
        self.transport.held.difference_update(kv_handles)  # fetched: freed by the consumer
        now = time.time()
        self._emit(now, ev.KV_GOT, rid, kv_transfer_s=0.0)
        self._tokens(request, now, first_index=1)

    def _tokens(self, request: Request, start_s: float, first_index: int) -> None:
        max_tokens = request.sampling.max_tokens
        for i in range(first_index, max_tokens):
            self._emit(start_s + (i - first_index + 1) * self.token_s, ev.TOKEN,
                       request.request_id, token_id=10 + i, index=i,
                       finish_reason="length" if i == max_tokens - 1 else None)

    def abort(self, request_id: str) -> None:
        self._watch()
        self.aborted.append(request_id)
        self.transport.held.difference_update(self.owned.pop(request_id, ()))
        for _, event in [item for item in self.outbox if item[1].request_id == request_id]:
            self.transport.held.difference_update(event.kv_handles)  # never collected: ours
        self.outbox = [item for item in self.outbox if item[1].request_id != request_id]

    def release(self, handles) -> None:
        self.released.extend(handles)
        self.transport.held.difference_update(handles)

    def wait_events(self, timeout_s: float) -> list[ev.WorkerEvent]:
        self._watch()
        now = time.time()
        due = [e for t, e in self.outbox if t <= now]
        self.outbox = [(t, e) for t, e in self.outbox if t > now]
        if not due:
            time.sleep(min(timeout_s, 0.002))  # a short long-poll: the router does not spin
        return due


def build(placement: str, policy: str = "least_loaded", deadline_s: float = 60.0, **timing):
    """Fake workers for ``colocated:N`` / ``disagg:xPyD`` and a router over them."""
    transport = FakeTransport()
    kind, _, counts = placement.partition(":")
    if kind == "colocated":
        names = [f"colocated-{i}" for i in range(int(counts))]
    else:
        num_prefill, num_decode = counts.rstrip("d").split("p")
        names = ([f"prefill-{i}" for i in range(int(num_prefill))]
                 + [f"decode-{i}" for i in range(int(num_decode))])
    workers = {name: FakeWorker(name, transport, **timing) for name in names}
    refs = [WorkerRef(name, w.role, w, rank) for rank, (name, w) in enumerate(workers.items())]
    hub = FakeHub()
    router = Router(refs, FakeCalls(), placement, policy, deadline_s=deadline_s, poll_s=0.005,
                    hub=hub)
    for worker in workers.values():
        worker.router = router
        hub.fakes.append(worker)
    return router, workers, transport


def requests(n: int, prompt_len: int = 4, max_tokens: int = 3, spacing_s: float = 0.0):
    prompt = tuple(range(3, 3 + prompt_len))
    return [(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)), spacing_s * i)
            for i in range(n)]


def assert_drained(router, workers, transport) -> None:
    """Loads exactly 0 and never negative; no KV handle left anywhere."""
    assert router.loads == dict.fromkeys(workers, 0)
    assert all(w.min_load >= 0 for w in workers.values())
    assert transport.held == set()


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_each_pool_splits_evenly_on_2p2d(policy):
    router, workers, transport = build("disagg:2p2d", policy)
    records = router.run(requests(8))
    assert Counter(r.prefill_worker for r in records) == {"prefill-0": 4, "prefill-1": 4}
    assert Counter(r.decode_worker for r in records) == {"decode-0": 4, "decode-1": 4}
    assert all(r.error is None and r.output_token_ids == [7, 11, 12] for r in records)
    assert_drained(router, workers, transport)


def test_round_robin_rotates_colocated_instances():
    router, workers, transport = build("colocated:3", "round_robin")
    records = router.run(requests(6))
    assert [r.prefill_worker for r in records] == ["colocated-0", "colocated-1", "colocated-2"] * 2
    assert all(r.output_token_ids == [10, 11, 12] for r in records)
    assert_drained(router, workers, transport)


def test_least_loaded_counts_a_burst_from_assignment():
    """6 requests at t=0 on 1p2d: each counts against its decode worker at once: 3/3."""
    router, workers, transport = build("disagg:1p2d", prefill_s=0.02)
    records = router.run(requests(6, prompt_len=4, max_tokens=3))
    assert Counter(r.decode_worker for r in records) == {"decode-0": 3, "decode-1": 3}
    # At the 6th submit every request is charged: prefill by prompt, decode by prompt + max.
    assert workers["prefill-0"].loads_at_submit[-1] == {
        "prefill-0": 6 * 4, "decode-0": 3 * (4 + 3), "decode-1": 3 * (4 + 3)}
    assert_drained(router, workers, transport)


def test_decode_load_counts_whole_kv_blocks(monkeypatch):
    """Workers with 16-token KV blocks: a request of 4 + 3 tokens holds one whole block, so
    it charges 16 tokens to its decode worker; the prefill load stays in prompt
    tokens."""
    monkeypatch.setattr(FakeWorker, "info", lambda self: {
        "kv_spec": SPEC, "max_model_len": 128, "vocab_size": 256, "kv_block_size": 16})
    router, workers, transport = build("disagg:1p2d", prefill_s=0.02)
    router.run(requests(6, prompt_len=4, max_tokens=3) + [
        (Request("two-blocks", tuple(range(3, 23)), SamplingParams(max_tokens=3)), 0.0)])
    assert router.kv_block_size == 16
    assert workers["prefill-0"].loads_at_submit[-1] == {
        "prefill-0": 6 * 4 + 20, "decode-0": 3 * 16 + 32, "decode-1": 3 * 16}  # ties: first
    assert_drained(router, workers, transport)


def test_decode_death_at_hand_over_moves_its_requests_to_the_live_decode_worker():
    """decode-1 refuses every admit as dead (the requests had not reached it, so
    the survivor takes them): all 6 decode on decode-0 with their own KV handles, none is
    released, none fails, loads return to 0."""
    router, workers, transport = build("disagg:1p2d")
    decode = workers["decode-1"]

    def admit_on_dead_worker(*args):
        decode.dead_error = WorkerDied("actor decode-1 is gone")
        raise decode.dead_error

    decode.admit = admit_on_dead_worker
    records = router.run(requests(6))
    assert not router.workers["decode-1"].alive
    assert all(r.error is None and r.output_token_ids == [7, 11, 12] for r in records)
    assert {r.decode_worker for r in records} == {"decode-0"}
    assert workers["prefill-0"].released == []
    assert_drained(router, workers, transport)


def test_a_decode_worker_dying_after_fetching_fails_the_moved_request_naming_it():
    """decode-0 takes the admit, fetches (frees) the KV, and dies before its kv_got is
    collected: the router still holds the handles and moves the request to decode-1, whose
    fetch finds the KV gone. The request fails naming decode-0's death, not a bare
    transfer error, and nothing leaks."""
    router, workers, transport = build("disagg:1p2d")
    dead, other = workers["decode-0"], workers["decode-1"]

    def fetch_then_die(request, first_token, kv_handles, kv_token_start=0):
        transport.held.difference_update(kv_handles)  # fetched and freed there
        dead.dead_error = WorkerDied("actor decode-0 is gone")  # before kv_got left it

    def fetch_gone(request, first_token, kv_handles, kv_token_start=0):
        missing = [h for h in kv_handles if h not in transport.held]
        other._emit(time.time(), ev.ERROR, request.request_id,
                    error=f"KV transfer failed: TransferFailed: no KV under {missing[0]}")

    dead.admit, other.admit = fetch_then_die, fetch_gone
    [record] = router.run(requests(1))
    assert record.error.startswith("decode worker decode-0 died: actor decode-0 is gone (after "
                                   "its KV was handed over); fetching it again failed: decode-1: "
                                   "KV transfer failed")
    assert record.decode_worker == "decode-1"
    assert_drained(router, workers, transport)


def test_decode_death_at_hand_over_with_no_decode_worker_left_frees_the_kv():
    """disagg:1p1d, no restart coming: the requests fail at once naming the empty pool, and
    the KV handles the router held go back to their producer, which frees them."""
    router, workers, transport = build("disagg:1p1d")
    decode = workers["decode-0"]

    def admit_on_dead_worker(*args):
        decode.dead_error = WorkerDied("actor decode-0 is gone")
        raise decode.dead_error

    decode.admit = admit_on_dead_worker
    records = router.run(requests(4))
    assert all("no live decode worker: decode worker decode-0 died" in r.error
               for r in records), records[0].error
    assert sorted(workers["prefill-0"].released) == [f"kv-r{i}" for i in range(4)]
    assert_drained(router, workers, transport)


def test_a_replacement_rejoins_waiting_requests_go_to_it_and_the_dead_one_is_ignored():
    """decode-0 dies (its restart is coming: the hook answers None); requests that arrive
    meanwhile wait, prefilled, their KV handles held; ``rejoin`` with a new worker sends
    them there; a late reply of the dead incarnation changes nothing."""
    router, workers, transport = build("disagg:1p1d")
    died = []
    router.on_worker_died = lambda name, cause: died.append((name, cause))  # returns None
    dead = workers["decode-0"]
    dead.dead_error = WorkerDied("actor decode-0 is gone")
    replacement = FakeWorker("decode-0", transport)
    replacement.router = router
    rejoined_s = []

    def rejoin() -> None:
        rejoined_s.append(time.time())  # before the replacement can serve anything
        router.rejoin("decode-0", replacement, replacement.info())

    timer = threading.Timer(0.2, rejoin)
    timer.start()
    records = router.run(requests(3))
    timer.join()
    assert died == [("decode-0", "died: actor decode-0 is gone")]
    assert all(r.error is None and r.output_token_ids == [7, 11, 12] for r in records)
    assert replacement.submitted == ["r0", "r1", "r2"] and dead.submitted == []
    ref = router.workers["decode-0"]
    assert (ref.handle, ref.state, ref.incarnation, ref.restarts) == (replacement, "live", 1, 1)
    assert all(r.timeline[FINISHED] >= rejoined_s[0] for r in records)  # they waited for it
    # a message of the dead incarnation (its last words, late) is dropped: stale
    router.hub.arrive("decode-0", 0, 0, (ev.WorkerEvent(ev.DIED, "", "decode-0", time.time(),
                                                        error="late"),))
    router._step(0.0)
    assert ref.alive and router.hub.stale[("decode-0", 0)] == 1
    assert_drained(router, workers | {"decode-0": replacement}, transport)


def fetching(worker: FakeWorker, transport: FakeTransport, corrupted=(), dies_at=None):
    """``worker.admit`` as a real decode worker fetches: KV no longer held fails the
    request ("no KV"), a corrupted request's KV fails its checksum (both reported as an
    ``error`` event, the handles freed before, as ``DecodeWorker`` does); the admit of
    ``dies_at`` raises ``WorkerDied`` (the worker died while it ran; what it reported
    before is still on its way)."""
    fetch_whole = worker.admit

    def admit(request, first_token, kv_handles, kv_token_start=0):
        rid = request.request_id
        if rid == dies_at:
            raise WorkerDied(f"actor {worker.name} is gone")
        missing = [h for h in kv_handles if h not in transport.held]
        if not missing and rid not in corrupted:
            return fetch_whole(request, first_token, kv_handles, kv_token_start)
        worker.submitted.append(rid)
        transport.held.difference_update(kv_handles)
        worker._emit(time.time(), ev.ERROR, rid, kv_fetch_failed=True, error=(
            f"KV transfer failed: TransferFailed: no KV under {missing[0]}" if missing else
            "KV transfer failed: KVChecksumError: payload checksum mismatch"))

    return admit


def die_after_reporting(placement: str, corrupted=("r0",), token_s: float = 0.0):
    """decode-0 takes r0's admit and reports on it (fetched, or its checksum failed:
    ``corrupted``), then dies while r1 (1p1d) or r2 (1p2d) is admitted there. Its channel
    carries r0's news (what was due) before its last words: the router hears them in that
    order. 1p1d: a replacement is coming (its hook rejoins it); 1p2d: decode-1 takes the
    moved requests."""
    router, workers, transport = build(placement, token_s=token_s)
    dead = workers["decode-0"]
    replacement = FakeWorker("decode-0", transport)
    replacement.router = router
    dead.admit = fetching(dead, transport, corrupted,
                          dies_at="r1" if placement == "disagg:1p1d" else "r2")
    replacement.admit = fetching(replacement, transport)
    if "decode-1" in workers:
        workers["decode-1"].admit = fetching(workers["decode-1"], transport)
    else:
        def on_worker_died(name, cause):
            router.rejoin(name, replacement, replacement.info())  # its answer comes later

        router.on_worker_died = on_worker_died  # returns None: a replacement is coming
    records = router.run(requests(3 if "decode-1" in workers else 2))
    return records, workers, transport, replacement, router


@pytest.mark.parametrize("placement", ["disagg:1p1d", "disagg:1p2d"])
def test_a_checksum_error_reported_as_the_decode_worker_dies_is_the_request_s_cause(placement):
    """r0's KV is corrupted: decode-0 fetches it, fails the checksum, frees the handles,
    reports the error and dies. r0 fails with its first cause, the checksum error, not with
    a later fetch of freed KV elsewhere (a 500-request soak's 'q147': "fetching it again
    failed: ... no KV for request q147"); the request that decode-0 never took decodes
    elsewhere; no handle is given back twice, none leaks."""
    records, workers, transport, replacement, router = die_after_reporting(placement)
    assert records[0].error == ("decode-0: KV transfer failed: KVChecksumError: payload "
                                "checksum mismatch")
    assert all(r.error is None and r.output_token_ids == [7, 11, 12] for r in records[1:])
    assert workers["prefill-0"].released == []  # the handles were freed at the fetch
    if placement == "disagg:1p1d":
        assert replacement.submitted == ["r1"]
        assert replacement.aborted == []
        workers["decode-0"] = replacement
    assert_drained(router, workers, transport)


@pytest.mark.parametrize("placement", ["disagg:1p1d", "disagg:1p2d"])
def test_a_kv_got_reported_as_the_decode_worker_dies_fails_the_request_naming_it(placement):
    """The same death, r0's KV healthy: decode-0 fetched and freed it and reported kv_got
    as it died (its next tokens, 0.05 s away, never came). r0 was decoding there: it fails
    at once naming the death and is never fetched again (the rejoin once assigned such a
    request afresh: "request_id q107 is already assigned")."""
    records, workers, transport, replacement, router = die_after_reporting(
        placement, corrupted=(), token_s=0.05)
    assert records[0].error == "decode worker decode-0 died: actor decode-0 is gone"
    assert records[0].output_token_ids == [7]
    assert all(r.error is None and r.output_token_ids == [7, 11, 12] for r in records[1:])
    assert workers["prefill-0"].released == []
    if placement == "disagg:1p1d":
        assert replacement.submitted == ["r1"]
        workers["decode-0"] = replacement
    assert_drained(router, workers, transport)


@pytest.mark.parametrize("owner", ["heard dead first", "heard dead after the report",
                                   "dead, silent", "alive"])
def test_a_fetch_failing_after_its_kv_producer_died_names_the_death(owner):
    """prefill-0 put r0's KV; as decode-0 starts fetching it, prefill-0 dies and its KV goes
    with it (a Ray owner's objects do), so the fetch fails ("no KV"). r0 fails naming the
    death, the transport's error after it, whether the router hears of the death before the
    report, in the same turn after it, or only from its own ``info`` call (the channel not
    yet silent long enough). A producer alive leaves the transport's error as it was."""
    router, workers, transport = build("disagg:1p1d")
    prefill, decode = workers["prefill-0"], workers["decode-0"]
    fetch = fetching(decode, transport)

    def admit(request, first_token, kv_handles, kv_token_start=0):
        transport.held.difference_update(kv_handles)  # lost: dead owner, or any other cause
        if owner != "alive":
            prefill.dead_error = WorkerDied("actor prefill-0 is gone")
            prefill.silent = owner == "dead, silent"  # no last words
        fetch(request, first_token, kv_handles, kv_token_start)

    decode.admit = admit
    if owner == "heard dead after the report":  # decode-0's message reaches the hub first
        router.hub.fakes.sort(key=lambda fake: fake.role != "decode")
    [record] = router.run(requests(1))
    fetch_error = LOST_KV_ERROR
    if owner == "alive":
        assert record.error == fetch_error
        assert router.workers["prefill-0"].state == "live"
    else:
        assert record.error == f"prefill worker prefill-0 died holding the KV of r0: {fetch_error}"
        assert router.workers["prefill-0"].cause == "died: actor prefill-0 is gone"
    assert record.output_token_ids == [7] and decode.submitted == ["r0"]
    assert prefill.released == []  # decode-0 freed the handles before reporting
    assert_drained(router, workers, transport)


def test_an_admit_refused_by_validation_is_the_request_s_error_even_if_its_producer_died():
    """decode-0 refuses r0's admit (its validation: no fetch; it frees the handles and reports
    an error not marked ``kv_fetch_failed``) as prefill-0 dies silently. r0 fails with the
    refusal; nobody asks prefill-0 (``info``) whether it died holding the KV."""
    router, workers, transport = build("disagg:1p1d")
    prefill, decode = workers["prefill-0"], workers["decode-0"]
    asked = []
    info = prefill.info
    prefill.info = lambda: asked.append("info") or info()

    def refuse(request, first_token, kv_handles, kv_token_start=0):
        decode.submitted.append(request.request_id)
        transport.held.difference_update(kv_handles)
        prefill.dead_error, prefill.silent = WorkerDied("actor prefill-0 is gone"), True
        decode._emit(time.time(), ev.ERROR, request.request_id,
                     error="request r0 has nothing to decode")

    decode.admit = refuse
    [record] = router.run(requests(1))
    assert record.error == "decode-0: request r0 has nothing to decode"
    assert asked == [] and prefill.released == []
    assert_drained(router, workers, transport)


LOST_KV_ERROR = "decode-0: KV transfer failed: TransferFailed: no KV under kv-r0"


def assert_lost_kv_keeps_the_fetch_error(router, workers, transport) -> None:
    """r0's KV is lost on the way while its producer lives: decode-0's fetch fails, and r0
    ends with the transport's error, prefill-0 still live, nothing held."""
    decode = workers["decode-0"]
    fetch = fetching(decode, transport)

    def admit(request, first_token, kv_handles, kv_token_start=0):
        transport.held.difference_update(kv_handles)  # lost, its producer alive
        fetch(request, first_token, kv_handles, kv_token_start)

    decode.admit = admit
    [record] = router.run(requests(1))
    assert record.error == LOST_KV_ERROR
    assert router.workers["prefill-0"].state == "live"
    assert_drained(router, workers, transport)


def test_a_failed_fetch_whose_producer_never_answers_ends_at_its_deadline_with_its_error():
    """prefill-0 lives but its ``info`` never answers (a hung process): r0 ends at its own
    deadline with the transport's error, not a bare deadline message."""
    router, workers, transport = build("disagg:1p1d", deadline_s=0.3)
    calls, never = router.calls, object()

    class HungInfo:
        def call(self, worker, method, *args):
            return never if method == "info" else calls.call(worker, method, *args)

        def ready(self, pending, timeout_s):
            return [p for p in pending if p is not never]

        result = staticmethod(calls.result)

    router.calls = HungInfo()
    assert_lost_kv_keeps_the_fetch_error(router, workers, transport)


def test_an_owner_check_is_matched_by_equality_not_identity():
    """``Calls.ready`` may hand back equal, not identical, pending objects (Ray's
    ``ObjectRef``s): the producer check of a failed fetch still ends its request with the
    transport's error."""
    router, workers, transport = build("disagg:1p1d")
    calls = router.calls

    @dataclasses.dataclass(frozen=True)
    class Ref:  # equal and hashable by what it refers to, as an ObjectRef
        done: _Done

    class CopyingCalls:
        def call(self, worker, method, *args):
            return Ref(calls.call(worker, method, *args))

        def ready(self, pending, timeout_s):
            return [Ref(p.done) for p in pending]

        def result(self, pending):
            return calls.result(pending.done if isinstance(pending, Ref) else pending)

    router.calls = CopyingCalls()
    assert_lost_kv_keeps_the_fetch_error(router, workers, transport)


def test_a_replacement_with_another_kv_geometry_is_refused():
    """The refusal is the rejoin's answer; its caller (``deployment.restarts``, its budget
    spent here) then says no replacement will come, and requests fail at once."""
    router, workers, transport = build("disagg:1p1d")
    router.on_worker_died = lambda name, cause: None
    workers["decode-0"].dead_error = WorkerDied("gone")
    other = FakeWorker("decode-0", transport)
    info = {**other.info(), "kv_spec": {**SPEC, "num_kv_heads": 4}}
    answers = []

    def rejoin() -> None:
        joined = router.rejoin("decode-0", other, info)
        joined.add_done_callback(lambda f: (answers.append(f.result()),
                                            router.worker_lost("decode-0", f.result())))

    threading.Timer(0.1, rejoin).start()
    records = router.run(requests(1, spacing_s=0.0) + [
        (Request("late", (3, 4), SamplingParams(max_tokens=2)), 0.3)])
    assert len(answers) == 1 and answers[0].startswith(
        "its replacement has a different KV geometry than the placement")
    assert "different KV geometry" in records[-1].error
    assert router.workers["decode-0"].state == "dead"
    assert other.port is None and router.workers["decode-0"].incarnation == 0  # never attached


def test_an_incarnation_declared_dead_is_stopped_and_again_when_it_speaks():
    """A false death: decode-0's silence was reported (a starved host) while it ran on.
    The router hands that incarnation to ``stop_worker`` at once, and again once its
    heartbeats reach the hub (stale news: dropped, not delivered); the prefill worker,
    heard all along, is never stopped."""
    router, workers, transport = build("disagg:1p1d")
    stopped: list[tuple[str, object]] = []
    router.stop_worker = lambda name, handle: stopped.append((name, handle))
    assert router.run(requests(1))[0].error is None  # both ports open and heard
    alive = workers["decode-0"]
    router._on_died(Died("decode-0", 0, 3.5))  # what the hub reports after 3 s of silence
    assert stopped == [("decode-0", alive)]
    assert router.workers["decode-0"].state == "dead"
    end_s = time.monotonic() + 30
    while len(stopped) < 2:  # its heartbeat thread runs on: the hub hears it, stale
        assert time.monotonic() < end_s, "the dead incarnation's heartbeat never came"
        router._step(0.01)
    for _ in range(5):
        router._step(0.01)
    assert stopped == [("decode-0", alive)] * 2  # told once more, not on every heartbeat
    assert router.hub.stale[("decode-0", 0)] >= 1


def test_a_rejoin_of_a_live_worker_is_refused_as_nothing_to_replace():
    """Its caller (``deployment.restarts``) tells this refusal apart: no restart failed."""
    router, workers, transport = build("disagg:1p1d")
    answer = router.rejoin("decode-0", FakeWorker("decode-0", transport), {})
    router._drain_inbox()
    assert isinstance(answer.result(timeout=0), NothingToReplace)
    assert answer.result() == "worker decode-0 is live: nothing to replace"
    assert router.workers["decode-0"].handle is workers["decode-0"]


def decode_1_dead_and_its_replacement():
    """1p2d with decode-1 dead and restarting (as if ``on_worker_died`` had answered None),
    and the replacement that will rejoin for it: (router, workers, transport, replacement)."""
    router, workers, transport = build("disagg:1p2d")
    workers["decode-1"].dead_error = WorkerDied("gone")
    router._worker_died("decode-1", WorkerDied("gone"))
    router.workers["decode-1"].restarting = True
    replacement = FakeWorker("decode-1", transport)
    replacement.router = router
    return router, workers, transport, replacement


def test_a_replacement_s_death_reported_while_it_joins_refuses_it():
    """decode-1 dead, its replacement joining: the deployment's watch reports the
    replacement's death (``worker_died`` with its handle) before its channel's ``opened``
    news. The rejoin is refused naming the death, and the late ``opened`` does not make the
    dead replacement live."""
    router, workers, transport, replacement = decode_1_dead_and_its_replacement()
    joined = router.rejoin("decode-1", replacement, replacement.info())
    router.worker_died("decode-1", replacement, "actor decode-1 died")  # queued after rejoin
    router._drain_inbox()  # the rejoin starts its open_channel thread, then the death
    assert joined.result(timeout=0) == ("its replacement died while it joined: "
                                        "actor decode-1 died")
    for thread in threading.enumerate():
        if thread.name == "open-channel-decode-1":
            thread.join(30)
    router._drain_inbox()  # its "opened" news
    ref = router.workers["decode-1"]
    assert (ref.state, ref.handle, ref.restarts) == ("restarting", workers["decode-1"], 0)


def test_a_replacement_opens_its_channel_while_the_loop_serves():
    """1p2d, decode-1 dead: its replacement's ``open_channel`` takes until the last of 4
    requests (all on decode-0) has finished; the loop serves them meanwhile, then routes to
    the replacement."""
    router, workers, transport, replacement = decode_1_dead_and_its_replacement()
    gate = threading.Event()
    open_channel = replacement.open_channel

    def slow_open(endpoint):
        assert gate.wait(30), "the gate never opened"
        open_channel(endpoint)

    replacement.open_channel = slow_open

    class ThreadedOpen(FakeCalls):
        """``open_channel`` runs on a thread of its own, as a Ray call would."""

        def call(self, worker, method, *args):
            if method != "open_channel":
                return super().call(worker, method, *args)
            done = _Done()
            done.event = threading.Event()

            def run():
                try:
                    done.value = worker.open_channel(*args)
                except Exception as err:
                    done.error = err
                done.event.set()

            threading.Thread(target=run, daemon=True).start()
            return done

        def ready(self, pending, timeout_s):
            return [p for p in pending if getattr(p, "event", None) is None
                    or p.event.wait(timeout_s)]

    router.calls = ThreadedOpen()
    joined = router.rejoin("decode-1", replacement, replacement.info())
    finished = []

    def on_finish(record):
        finished.append(record)
        if len(finished) == 4:
            gate.set()

    records = router.run(requests(4), on_finish=on_finish)
    assert [r.decode_worker for r in records] == ["decode-0"] * 4
    assert all(r.error is None for r in records)
    end_s = time.monotonic() + 30
    while not joined.done():
        assert time.monotonic() < end_s, "the replacement never joined"
        router._step(0.01)
    assert joined.result() is None
    ref = router.workers["decode-1"]
    assert (ref.state, ref.handle, ref.incarnation, ref.restarts) == ("live", replacement, 1, 1)
    after = router.run([(Request(f"t{i}", (3, 4), SamplingParams(max_tokens=2)), 0.0)
                        for i in range(2)])
    assert sorted(r.decode_worker for r in after) == ["decode-0", "decode-1"]
    assert replacement.submitted == [r.request_id for r in after if r.decode_worker == "decode-1"]


@pytest.mark.parametrize("lost_in,where", [
    ("prefill-0", "waiting for prefill on prefill-0"),
    ("decode-0", "waiting for KV transfer on decode-0"),
])
def test_request_lost_in_a_busy_worker_ends_at_its_own_deadline(lost_in, where):
    """The worker keeps reporting other requests (every 0.05 s, well inside the deadline),
    so only a per-request deadline ends the lost one."""
    deadline_s = 0.3
    router, workers, transport = build("disagg:1p1d", deadline_s=deadline_s, token_s=0.05)
    workers[lost_in].lose.add("r1")
    records = router.run(requests(20, max_tokens=4, spacing_s=0.05))
    lost = records[1]
    assert lost.error is not None and where in lost.error, lost.error
    assert lost.timeline[FINISHED] - lost.timeline[ARRIVED] >= deadline_s
    # it ended while its worker was still busy reporting others (a deadline counted from the
    # worker's last news would end it only after the last of them)
    assert lost.timeline[FINISHED] < records[-1].timeline[FINISHED]
    assert all(r.error is None and r.output_token_ids == [7, 11, 12, 13]
               for r in records if r.request_id != "r1")
    assert "r1" in workers[lost_in].aborted
    assert_drained(router, workers, transport)


def test_a_request_s_own_events_refresh_its_deadline():
    """20 tokens 0.05 s apart take 1 s, far past the 0.3 s deadline: no error."""
    router, workers, transport = build("disagg:1p1d", deadline_s=0.3, token_s=0.05)
    [record] = router.run(requests(1, max_tokens=20))
    assert record.error is None and len(record.output_token_ids) == 20
    assert_drained(router, workers, transport)


def test_a_request_lost_after_an_idle_spell_still_ends_at_its_deadline():
    """r0 is served and its deadline passes with nothing in flight; r1, lost, comes after:
    the router still watches its deadline (it would otherwise wait forever)."""
    router, workers, transport = build("colocated:1", deadline_s=0.2)
    workers["colocated-0"].lose.add("r1")
    [served] = router.run(requests(1))
    idle_until_s = served.timeline[FINISHED] + 0.2  # r0's last deadline is before this
    turns = 0
    while time.time() <= idle_until_s or turns == 0:  # turns of the loop, nothing in flight
        router._step(0.01)
        turns += 1
    heard: list[StreamEvent] = []
    router.submit(Request("r1", (3, 4), SamplingParams(max_tokens=2)), heard.append)
    end_s = time.monotonic() + 30
    while not heard:
        assert time.monotonic() < end_s, "r1 never ended"
        router._step(0.01)
    assert served.error is None
    [finish] = heard
    assert (finish.kind, finish.finish_reason, finish.error) == (
        "finish", "error", "deadline: no news of the request for 0.2 s while waiting for "
        "prefill on colocated-0")
    assert_drained(router, workers, transport)


def test_waiting_and_running_counts_follow_the_requests():
    """/metrics' counts: both submitted requests wait for prefill; once r1's prefill is done
    it runs (its KV handed over, tokens 10 s apart) while the lost r0 still waits."""
    router, workers, _ = build("disagg:1p1d", token_s=10.0)
    workers["prefill-0"].lose.add("r0")
    for request, _ in requests(2, max_tokens=3):
        router.submit(request, lambda event: None)
    router._drain_inbox()
    assert (router.num_waiting, router.num_running) == (2, 0)
    for _ in range(1000):  # turns of the loop until r1's prefilled event came
        router._step(0.005)
        if router.num_running:
            break
    assert (router.num_waiting, router.num_running) == (1, 1)


def test_a_plain_token_event_equals_the_constructor_s():
    """``StreamEvent.token`` (the router's per-token path) makes the constructor's event."""
    fast = StreamEvent.token("r1", 12.5, 42, 3)
    assert fast == StreamEvent("r1", "token", 12.5, token_id=42, index=3)
    assert hash(fast) == hash(StreamEvent("r1", "token", 12.5, token_id=42, index=3))
    assert (fast.finish_reason, fast.record, fast.top_logprobs, fast.unavailable) == (
        None, None, (), False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.token_id = 7


def test_late_prefilled_event_gives_its_kv_back_to_the_producer():
    """r1's first token comes after its deadline: the router ended it, so the handles the
    late event carries go back to prefill-0, which frees them."""
    router, workers, transport = build("disagg:1p1d", deadline_s=0.2, token_s=0.04)
    prefill = workers["prefill-0"]
    prefill.delay_s["r1"] = 0.4
    prefill.abort = lambda rid: prefill.aborted.append(rid)  # too late: already reported
    # r0 decodes 20 tokens (0.8 s), so the router is still running when r1's event comes
    work = [(Request("r0", (3, 4), SamplingParams(max_tokens=20)), 0.0),
            (Request("r1", (3, 4), SamplingParams(max_tokens=20)), 0.0)]
    records = router.run(work)
    assert records[0].error is None and len(records[0].output_token_ids) == 20
    assert "waiting for prefill on prefill-0" in records[1].error
    assert prefill.released == ["kv-r1"]
    assert_drained(router, workers, transport)


@pytest.mark.parametrize("error", [RuntimeError("prefill worker prefill-0: engine loop died: "
                                                "RuntimeError: boom"),
                                   WorkerDied("ActorDiedError: the actor died")])
def test_dead_worker_fails_its_requests_at_once_and_gets_nothing_new(error):
    """Death comes as the worker's last words (long before the 60 s deadline): its
    requests fail naming the cause; later requests all go to prefill-1."""
    router, workers, transport = build("disagg:2p1d", policy="round_robin", prefill_s=0.2)
    dying = workers["prefill-0"]
    real_wait = dying.wait_events

    def wait_then_die(timeout_s):
        if len(dying.submitted) >= 2:
            dying.dead_error = error
            raise error
        return real_wait(timeout_s)

    dying.wait_events = wait_then_die
    records = router.run(requests(8, spacing_s=0.05))
    failed = [r for r in records if r.error]
    assert {r.request_id for r in failed} == set(dying.submitted) == {"r0", "r2"}
    assert all(f"prefill worker prefill-0 died: {error}" in r.error for r in failed)
    rest = [r for r in records if not r.error]
    assert all(r.prefill_worker == "prefill-1" and r.output_token_ids == [7, 11, 12] for r in rest)
    assert len(rest) == 6
    assert router.loads == dict.fromkeys(workers, 0)


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    router, workers, transport = build("disagg:1p1d")
    bad = [Request(f"bad{t}", (3, 4), SamplingParams(max_tokens=2, stop_token_ids=(5, t)))
           for t in (256, -1)]
    records = router.run([(r, 0.0) for r in bad] + requests(1))
    assert records[0].error == "stop_token_ids must be in [0, 256), got [256]"
    assert records[1].error == "stop_token_ids must be in [0, 256), got [-1]"
    assert workers["prefill-0"].submitted == ["r0"]  # nothing scheduled for them
    assert records[2].error is None
    assert_drained(router, workers, transport)


def test_decode_death_mid_transfer_gives_the_kv_back_to_its_producer():
    """decode-0 accepted r0's handles but dies before fetching them: nobody else will free
    them, so the router hands them back to prefill-0."""
    router, workers, transport = build("disagg:1p1d")
    decode = workers["decode-0"]
    decode.lose.add("r0")
    real_wait = decode.wait_events

    def wait_then_die(timeout_s):
        if "r0" in decode.owned:
            decode.dead_error = WorkerDied("actor decode-0 is gone")
            raise decode.dead_error
        return real_wait(timeout_s)

    decode.wait_events = wait_then_die
    [record] = router.run(requests(1))
    assert "decode worker decode-0 died: actor decode-0 is gone" in record.error
    assert workers["prefill-0"].released == ["kv-r0"]
    assert_drained(router, workers, transport)


def test_request_larger_than_a_roles_kv_cache_is_refused_before_any_prefill(monkeypatch):
    """Decode workers holding 32 KV tokens, the prefill worker 64: 20 + 13 = 33 tokens fails
    at once (naming the decode cache), before the prefill worker sees it; 20 + 12 runs; a
    63-token prompt fits the prefill cache (63 + 1) but not decode's."""
    def info(self):
        capacity = 64 if self.name.startswith("prefill") else 32
        return {"kv_spec": SPEC, "max_model_len": 128, "vocab_size": 256,
                "kv_capacity_tokens": capacity, "kv_block_size": 16}

    monkeypatch.setattr(FakeWorker, "info", info)
    router, workers, transport = build("disagg:1p2d", prefill_s=0.02)
    assert router.kv_capacity_tokens == {"prefill": 64, "decode": 32}
    records = {r.request_id: r for r in router.run([
        (Request("too-big", tuple(range(3, 23)), SamplingParams(max_tokens=13)), 0.0),
        (Request("fits", tuple(range(3, 23)), SamplingParams(max_tokens=12)), 0.0)])}
    assert records["too-big"].error.endswith(
        "needs 33 KV tokens, more than a decode worker's whole KV cache (32 tokens; raise "
        "kv_cache_memory_gb or kv_capacity_tokens)"), records["too-big"].error
    assert records["fits"].error is None
    assert workers["prefill-0"].submitted == ["fits"]
    with pytest.raises(ValueError, match="needs 64 KV tokens, more than a decode"):
        router.validate(Request("p", tuple(range(63)), SamplingParams(max_tokens=1)))
    assert_drained(router, workers, transport)


def batched_wait_events(worker: FakeWorker, timeout_s: float) -> list:
    """``FakeWorker.wait_events`` as a real worker sends them: each run of plain tokens
    (not a request's first or last) as one ``TokenBatch``, in its place."""
    out, run = [], []
    for event in _one_per_token(worker, timeout_s) + [None]:
        if event is not None and event.kind == ev.TOKEN and event.index > 0 and \
                event.finish_reason is None:
            run.append(event)
            continue
        if run:
            out.append(ev.TokenBatch(worker.name, run[0].time_s,
                                     tuple(e.request_id for e in run),
                                     tuple(e.token_id for e in run), tuple(e.index for e in run)))
            run = []
        if event is not None:
            out.append(event)
    return out


_one_per_token = FakeWorker.wait_events


@pytest.mark.parametrize("placement, first", [("colocated:2", 10), ("disagg:1p1d", 7)])
def test_token_batches_give_the_same_records_and_streams(placement, first, monkeypatch):
    """A step's plain tokens as one ``TokenBatch`` (engine.events): the same records as one
    event per token, the same tokens and indices streamed online, and a replay's sinks
    (``submit(tokens=False)``) hear only the finish."""
    expected = [first, 11, 12, 13, 14]
    router, workers, transport = build(placement)
    assert [r.output_token_ids for r in router.run(requests(4, max_tokens=5))] == [expected] * 4
    monkeypatch.setattr(FakeWorker, "wait_events", batched_wait_events)
    router, workers, transport = build(placement)
    records = router.run(requests(4, max_tokens=5))
    assert [r.output_token_ids for r in records] == [expected] * 4
    assert all(len(r.token_times_s) == len(r.token_worker_times_s) == 5 for r in records)
    assert_drained(router, workers, transport)
    heard: list = []
    router.start()
    try:
        streams = [router.submit(Request(f"s{i}", (3, 4, 5), SamplingParams(max_tokens=5)))
                   for i in range(3)]
        router.submit(Request("quiet", (3, 4, 5), SamplingParams(max_tokens=5)), heard.append,
                      tokens=False)
        events = [list(stream) for stream in streams]
    finally:
        router.stop()
    for got in events:
        assert [(e.kind, e.token_id, e.index) for e in got] == [
            ("token", t, i) for i, t in enumerate(expected)] + [("finish", None, None)]
        assert got[-1].record.output_token_ids == expected
    assert [e.kind for e in heard] == ["finish"] and heard[0].record.output_token_ids == expected


def test_a_first_token_before_its_kv_streams_once_and_the_hand_over_waits_for_prefilled():
    """The prefill worker's first token comes 0.05 s before its ``prefilled`` event: it
    streams at once while the request still waits for its KV (no admit yet), and is neither
    recorded nor streamed again when ``prefilled`` brings the handles. Past its prefill, it
    counts as running (/metrics), as in the KV transfer that follows."""
    router, workers, transport = build("disagg:1p1d", put_s=0.05)
    seen = []

    def sink(event: StreamEvent) -> None:
        seen.append((event.kind, event.index, event.token_id))
        if event.kind == "token" and event.index == 0:
            seen.append(("admitted", list(workers["decode-0"].submitted),
                         router.num_waiting))

    router.start()
    try:
        router.submit(Request("r0", (3, 4, 5, 6), SamplingParams(max_tokens=3)), sink)
        until(lambda: seen and seen[-1][0] == "finish")
    finally:
        router.stop()
    assert seen == [("token", 0, 7), ("admitted", [], 0), ("token", 1, 11), ("token", 2, 12),
                    ("finish", None, None)]
    assert_drained(router, workers, transport)


def test_a_prefill_worker_dying_between_first_token_and_prefilled_fails_the_request():
    router, workers, transport = build("disagg:1p1d", put_s=5.0)
    prefill = workers["prefill-0"]
    events = []

    def sink(event: StreamEvent) -> None:
        events.append(event)
        if event.kind == "token":
            prefill.dead_error = WorkerDied("actor prefill-0 is gone")

    router.start()
    try:
        router.submit(Request("r0", (3, 4, 5, 6), SamplingParams(max_tokens=3)), sink)
        until(lambda: events and events[-1].kind == "finish")
    finally:
        router.stop()
    assert [(e.kind, e.token_id) for e in events] == [("token", 7), ("finish", None)]
    record = events[-1].record
    assert record.error == "prefill worker prefill-0 died: actor prefill-0 is gone"
    assert record.output_token_ids == [7] and len(record.token_times_s) == 1
    assert router.loads == {"prefill-0": 0, "decode-0": 0}


def test_an_abort_between_first_token_and_prefilled_frees_the_kv():
    router, workers, transport = build("disagg:1p1d", put_s=5.0)
    events = []
    router.start()
    try:
        router.submit(Request("r0", (3, 4, 5, 6), SamplingParams(max_tokens=3)), events.append)
        until(lambda: events)
        router.abort("r0")
        until(lambda: events[-1].kind == "finish")
    finally:
        router.stop()
    assert [(e.kind, e.token_id) for e in events] == [("token", 7), ("finish", None)]
    assert events[-1].record.finish_reason == "abort"
    assert events[-1].record.output_token_ids == [7]
    assert workers["prefill-0"].aborted == ["r0"] and workers["decode-0"].submitted == []
    assert_drained(router, workers, transport)


def until(predicate, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, "condition not reached"
        time.sleep(0.002)


def test_submits_wake_the_loop_only_from_a_thread_that_does_not_drive_it():
    """A replay's arrivals are submitted on the thread that drives the loop (``run``): it takes
    them at its next turn, so the hub is never woken for them; a submit from another thread
    (the online front end's callers) wakes it once each."""
    router, workers, transport = build("disagg:1p1d")
    wakes: list[str] = []
    wake = router.hub.wake
    router.hub.wake = lambda: (wakes.append(threading.current_thread().name), wake())[1]
    records = router.run(requests(5, spacing_s=0.001))
    assert [r.error for r in records] == [None] * 5 and wakes == []
    router.start()
    try:
        streams = [router.submit(Request(f"s{i}", (3, 4, 5), SamplingParams(max_tokens=3)))
                   for i in range(2)]
        assert all(list(stream)[-1].record.error is None for stream in streams)
    finally:
        router.stop()
    main = threading.current_thread().name
    assert wakes.count(main) == 3  # the two submits and stop()'s
    assert_drained(router, workers, transport)
