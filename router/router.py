"""The router: admits requests, picks workers, relays tokens, stamps every timeline.

A request's life through the router (DESIGN §3):

1. At its arrival time it is validated (prompt + max_tokens within the model's context,
   token ids within the vocabulary; else it ends at once with an error, nothing scheduled),
   stamped ``arrived``, and given a prefill and a decode worker (or one colocated instance)
   by the policy.
2. ``submit`` sends it to the prefill (or colocated) worker: ``prefill_queued``.
3. The prefill worker's ``prefilled`` event brings the first token: it leaves the router at
   once (**TTFT ends here**). The router calls the decode worker's ``admit`` with the KV
   handles: with Ray the handles are ObjectRefs and the bytes go worker to worker.
4. ``kv_got`` and every ``token`` event are stamped as they arrive; the last token (or an
   error) ends the request, whose ``RequestRecord`` is returned.

No wait is unbounded: every worker is long-polled with a short timeout; a worker whose
poll fails is dead and its requests end with an error naming it; a worker that holds
requests and reports nothing for ``deadline_s`` seconds (counted from when each request
reached it, or its last event) has its requests failed and aborted (freeing their KV). The router never touches KV bytes or tensors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import events as ev
from engine.metrics import ARRIVED, DISPATCHED, ERROR, FINISHED, PREFILL_QUEUED, RequestRecord
from engine.request import Request
from router.calls import Calls, WorkerDied
from router.policy import pick


@dataclass
class WorkerRef:
    """A worker as the router sees it: a name, a role, and whatever ``Calls`` calls."""

    name: str
    role: str  # "prefill", "decode" or "colocated"
    handle: Any
    rank: int | None = None  # torch.distributed rank, for point-to-point transports
    alive: bool = True


@dataclass
class _Flight:
    request: Request
    record: RequestRecord
    worker: str  # the worker the request waits on now
    load_tokens: int
    since_s: float = 0.0  # when it started waiting on that worker


class Router:
    """Routes requests over prefill/decode workers (disaggregated) or colocated instances.

    Args:
        workers: every worker of the placement.
        calls: how to call them (Ray or local threads).
        placement: recorded in every RequestRecord (e.g. ``disagg:1p1d``).
        policy: ``least_loaded`` (prefill by queued prompt tokens, decode by resident KV
            tokens) or ``round_robin``.
        deadline_s: a worker holding requests that reports nothing for this long fails them.
        poll_s: long-poll timeout of each ``wait_events`` call.
        startup_timeout_s: how long each worker may take to answer its first call (it may
            still be loading its model).

    Raises:
        ValueError: no workers for a role, or prefill and decode KV geometries differ.
        RuntimeError: a worker failed to start or did not answer within startup_timeout_s.
    """

    def __init__(self, workers: list[WorkerRef], calls: Calls, placement: str,
                 policy: str = "least_loaded", deadline_s: float = 60.0,
                 poll_s: float = 0.05, startup_timeout_s: float = 300.0) -> None:
        self.workers = {w.name: w for w in workers}
        self.calls = calls
        self.placement = placement
        self.policy = policy
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self.colocated = all(w.role == "colocated" for w in workers)
        roles = ("colocated",) if self.colocated else ("prefill", "decode")
        for role in roles:
            if not any(w.role == role for w in workers):
                raise ValueError(f"placement {placement} has no {role} worker")
        infos = [self._first_info(w, startup_timeout_s) for w in workers]
        specs = {tuple(sorted(i["kv_spec"].items())) for i in infos}
        if len(specs) != 1:
            raise ValueError(f"workers disagree on the KV geometry: {infos}")
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = min(i["vocab_size"] for i in infos)
        self.loads = {w.name: 0 for w in workers}
        self._counter = 0

    def call_now(self, worker: WorkerRef, method: str, *args: Any,
                 timeout_s: float | None = None) -> Any:
        """Call one worker and wait for the answer (bounded by ``deadline_s``)."""
        timeout_s = self.deadline_s if timeout_s is None else timeout_s
        pending = self.calls.call(worker.handle, method, *args)
        if not self.calls.ready([pending], timeout_s):
            raise TimeoutError(f"worker {worker.name} did not answer {method} in {timeout_s} s")
        return self.calls.result(pending)

    def _first_info(self, worker: WorkerRef, timeout_s: float) -> dict:
        try:
            return self.call_now(worker, "info", timeout_s=timeout_s)
        except (WorkerDied, TimeoutError) as err:
            raise RuntimeError(f"{worker.role} worker {worker.name} failed to start: {err}") from err

    # ---- public ----------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError naming the field and its range (Request and SamplingParams have
        checked their own fields already)."""
        total = request.num_prompt_tokens + request.sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                             f"({request.sampling.max_tokens}) = {total} exceeds the context "
                             f"length {self.max_model_len}")
        top = max(request.prompt_token_ids)
        if top >= self.vocab_size:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {top}")

    def run(self, workload: list[tuple[Request, float]],
            on_finish: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Serve ``workload`` (requests with arrival offsets in seconds from now) to the end.

        Returns:
            One RequestRecord per request, in arrival order.

        Raises:
            ValueError: two requests share a request_id.
        """
        ids = [request.request_id for request, _ in workload]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id must be unique within a workload")
        arrivals = sorted(workload, key=lambda item: item[1])
        start_s = time.time()
        self._flights: dict[str, _Flight] = {}
        self._done: dict[str, RequestRecord] = {}
        self._pending: dict[Any, tuple[str, str, str | None]] = {}  # call -> (method, worker, rid)
        self._polls: dict[str, Any] = {}
        self._last_heard = {name: time.time() for name in self.workers}
        self._on_finish = on_finish
        next_index = 0
        while next_index < len(arrivals) or self._flights:
            while next_index < len(arrivals) and start_s + arrivals[next_index][1] <= time.time():
                # arrived = the scheduled time, however late we got here (no coordinated omission)
                self._dispatch(arrivals[next_index][0], start_s + arrivals[next_index][1])
                next_index += 1
            self._poll_workers()
            wait_s = self.poll_s
            if next_index < len(arrivals):
                wait_s = min(wait_s, max(0.0, start_s + arrivals[next_index][1] - time.time()))
            everything = list(self._polls.values()) + list(self._pending)
            for pending in self.calls.ready(everything, wait_s) if everything else []:
                self._complete(pending)
            self._check_deadlines()
        self._drain_polls()
        return [self._done[request.request_id] for request, _ in arrivals]

    # ---- dispatch ---------------------------------------------------------------------
    def _live(self, role: str) -> list[str]:
        return [w.name for w in self.workers.values() if w.role == role and w.alive]

    def _pick(self, role: str) -> str:
        self._counter += 1
        return pick(self.policy, self._live(role), self.loads, self._counter)

    def _dispatch(self, request: Request, arrived_s: float | None = None) -> None:
        """``arrived_s``: the scheduled arrival (default: now); ``dispatched`` is stamped now."""
        now = time.time()
        request = dataclasses.replace(request, arrival_time_s=now if arrived_s is None else arrived_s)
        record = RequestRecord(request_id=request.request_id, placement=self.placement,
                               num_prompt_tokens=request.num_prompt_tokens)
        record.timeline[ARRIVED] = request.arrival_time_s
        record.timeline[DISPATCHED] = now
        flight = _Flight(request, record, "", 0)
        self._flights[request.request_id] = flight
        try:
            self.validate(request)
            if self.colocated:
                first = self._pick("colocated")
                record.prefill_worker = record.decode_worker = first
                self._send(first, "submit", request.request_id, request)
            else:
                first, decode = self._pick("prefill"), self._pick("decode")
                record.prefill_worker, record.decode_worker = first, decode
                self._send(first, "submit", request.request_id, request,
                           self.workers[decode].rank)
        except ValueError as err:
            self._finish(flight, error=str(err))
            return
        flight.worker, flight.load_tokens, flight.since_s = first, request.num_prompt_tokens, time.time()
        self.loads[first] += flight.load_tokens
        record.timeline[PREFILL_QUEUED] = time.time()

    def _send(self, worker: str, method: str, request_id: str | None, *args: Any) -> None:
        pending = self.calls.call(self.workers[worker].handle, method, *args)
        self._pending[pending] = (method, worker, request_id)

    # ---- events -----------------------------------------------------------------------
    def _poll_workers(self) -> None:
        for name, worker in self.workers.items():
            if worker.alive and name not in self._polls:
                self._polls[name] = self.calls.call(worker.handle, "wait_events", self.poll_s)

    def _complete(self, pending: Any) -> None:
        if pending in self._pending:
            method, worker, request_id = self._pending.pop(pending)
        else:
            worker = next(name for name, p in self._polls.items() if p is pending)
            method, request_id = "wait_events", None
            del self._polls[worker]
        try:
            result = self.calls.result(pending)
        except WorkerDied as err:
            self._worker_died(worker, err)
            return
        except Exception as err:  # a remote call that raised: only its request fails
            if request_id in self._flights:
                self._finish(self._flights[request_id], error=f"{worker}.{method}: {err}")
            return
        if method == "wait_events":
            if result:
                self._last_heard[worker] = time.time()
            for event in result:
                self._on_event(event)

    def _on_event(self, event: ev.WorkerEvent) -> None:
        flight = self._flights.get(event.request_id)
        if flight is None:  # late news of a request already ended (e.g. timed out)
            return
        record = flight.record
        record.timeline.update(event.stamps)
        if event.kind == ev.ERROR:
            self._finish(flight, error=f"{event.worker}: {event.error}")
        elif event.kind == ev.KV_GOT:
            record.kv_get_s = event.kv_get_s
            record.kv_transfer_s = event.kv_transfer_s
            if record.kv_put_s is not None and event.kv_get_s is not None:
                record.kv_transfer_s = record.kv_put_s + event.kv_get_s  # full cost: put + get
        elif event.kind in (ev.TOKEN, ev.PREFILLED):
            record.token_times_s.append(time.time())  # the token leaves the router now
            record.token_worker_times_s.append(event.time_s)  # the worker produced it then
            if event.kind == ev.PREFILLED:
                record.kv_put_s = event.kv_put_s
            record.output_token_ids.append(event.token_id)
            if event.finish_reason is not None:
                self._finish(flight, finish_reason=event.finish_reason)
            elif event.kind == ev.PREFILLED:
                self._hand_over(flight, event)

    def _hand_over(self, flight: _Flight, event: ev.WorkerEvent) -> None:
        """First token out; now the decode worker fetches the KV and decodes."""
        record = flight.record
        record.kv_bytes = event.kv_bytes
        self.loads[flight.worker] -= flight.load_tokens
        decode = record.decode_worker
        if not self.workers[decode].alive:
            self._finish(flight, error=f"decode worker {decode} died before the KV hand-over")
            return
        flight.worker, flight.since_s = decode, time.time()
        flight.load_tokens = flight.request.num_prompt_tokens + flight.request.sampling.max_tokens
        self.loads[decode] += flight.load_tokens
        self._send(decode, "admit", flight.request.request_id, flight.request, event.token_id,
                   event.kv_handles)

    def _finish(self, flight: _Flight, finish_reason: str | None = None,
                error: str | None = None) -> None:
        record = flight.record
        now = time.time()
        record.timeline[FINISHED] = now
        if error is not None:
            record.timeline[ERROR] = now
            record.error, record.finish_reason = error, "error"
            for name in {record.prefill_worker, record.decode_worker} - {None}:
                if self.workers[name].alive:  # free whatever KV it holds there
                    self._send(name, "abort", None, record.request_id)
        else:
            record.finish_reason = finish_reason
        if flight.worker:
            self.loads[flight.worker] -= flight.load_tokens
        del self._flights[record.request_id]
        self._done[record.request_id] = record
        if self._on_finish is not None:
            self._on_finish(record)

    # ---- failures ---------------------------------------------------------------------
    def _worker_died(self, name: str, err: Exception) -> None:
        worker = self.workers[name]
        if not worker.alive:
            return
        worker.alive = False
        self._polls.pop(name, None)
        for flight in list(self._flights.values()):
            if flight.worker == name:
                self._finish(flight, error=f"{worker.role} worker {name} died: {err}")

    def _check_deadlines(self) -> None:
        now = time.time()
        for flight in list(self._flights.values()):
            name = flight.worker
            if name and now - max(flight.since_s, self._last_heard[name]) > self.deadline_s:
                self._finish(flight, error=f"{self.workers[name].role} worker {name} reported "
                                           f"nothing for {self.deadline_s} s")

    def _drain_polls(self) -> None:
        """Let the outstanding long polls and calls end before returning (bounded)."""
        everything = list(self._polls.values()) + list(self._pending)
        if everything:
            self.calls.ready(everything, self.poll_s * 2)
        self._polls.clear()
        self._pending.clear()
