"""The router: admits requests, picks their workers (``router.assignment``), relays tokens and
stamps every timeline. A request's life is told once, in docs/architecture.md ("A request's
life"); this module's contract:

- A request that cannot be served (``validate``; its id already in flight; no live worker)
  gets one ``finish`` event with reason ``error`` and nothing is scheduled.
- A ``prefilled`` event's KV handles stay in the router's hands until ``admit`` hands them to
  the decode worker; those it cannot pass on go back to the incarnation that put them.
- Commands go out in order over one channel per worker (``channel.contract.Hub``) and step
  outputs come back; lifecycle calls go through ``Calls``. The loop waits on the hub until
  news, a death, its inbox (``wake``) or the next deadline.
- A request fails ``deadline_s`` after its own last news. A worker is dead once its channel
  falls silent, it sends ``died`` or its deployment says so (``worker_died``): its requests
  fail naming the cause or, remote and not yet decoding there, move to another decode worker.
  An incarnation declared dead goes to ``stop_worker`` (a false death must not run on).
  A KV fetch that fails once its producer incarnation died names that death; while the
  producer seems alive, the failure waits for its answer to an ``info`` call.
  If ``on_worker_died`` answers None, ``rejoin`` attaches the replacement as the next
  incarnation (the hub drops news of earlier ones) once its channel is open, which the loop
  never waits for; else requests parked for the empty pool fail as ``unavailable``.
- ``start()`` runs the loop on a thread and any thread may ``submit``/``abort`` (sinks run on
  the loop thread); ``run(workload)`` replays on the caller's thread.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine import events as ev
from engine.config import ConditionalConfig
from engine.placement import Placement
from engine.errors import describe_error
from engine.kv_blocks import prompt_block_hashes
from engine.limits import Limits
from engine.clock import precise_timers
from engine.metrics import ARRIVED, DISPATCHED, ERROR, FINISHED, PREFILL_QUEUED, RequestRecord
from engine.request import Request
from router.assignment import Assigner, NoLiveWorker
from channel.contract import Command, Died, Hub, Message, Stale
from channel.local import LocalHub
from router.calls import Calls, WorkerDied

# What a request waits for on its current worker (named in deadline errors); POOL: a
# live worker in a pool that has none (its workers restart).
PREFILL, TRANSFER, DECODE, POOL = "prefill", "KV transfer", "decode", "a live worker"


@dataclass
class WorkerRef:
    """A worker as the router sees it: a name, a role, and whatever ``Calls`` calls (its
    lifecycle: ``info``, ``open_channel``, reads).

    ``alive``: routed to; else ``restarting`` (a replacement is being started) or dead for
    good, ``cause`` saying why. ``incarnation`` numbers its channel attachments (0: the
    first; a replacement refused at its channel uses one up), ``restarts`` counts the
    replacements that joined."""

    name: str
    role: str  # "prefill", "decode" or "colocated"
    handle: Any
    rank: int | None = None  # torch.distributed rank, for point-to-point transports
    alive: bool = True
    restarting: bool = False
    cause: str | None = None
    incarnation: int = 0
    restarts: int = 0

    @property
    def state(self) -> str:
        """``live``, ``restarting`` or ``dead`` (for good)."""
        return "live" if self.alive else "restarting" if self.restarting else "dead"


class NothingToReplace(str):
    """``Router.rejoin``'s refusal of a replacement its worker does not need: that worker is
    live, or another replacement of it is joining. The one offered is spare (its caller
    stops it); it is no failed restart."""


@dataclass
class _Flight:
    """A request between arrival and its end, as the router tracks it."""

    request: Request
    record: RequestRecord
    worker: str = ""  # the worker it waits on now
    stage: str = ""  # what it waits for there: PREFILL, TRANSFER or DECODE
    deadline_s: float = float("inf")  # time.time() by which its next event is due
    # KV in transit: handles put by kv_owner, handed to the decode worker, not yet fetched
    kv_owner: str | None = None
    kv_owner_incarnation: int = 0
    kv_handles: tuple[Any, ...] = ()
    kv_token_start: int = 0  # the KV sent starts here (its decode worker caches the prefix)
    # the dead decode worker it was handed over to before being moved (``_move_decode``):
    # its name and incarnation, and the error a request decoding there got at its death
    moved_from: str | None = None
    moved_from_incarnation: int = 0
    moved_from_death: str = ""
    stream_tokens: bool = True  # its sink hears token events (``submit(tokens=...)``)
    fetch_error: str = ""  # its decode worker's failed fetch; it ends once kv_owner answers


TOKEN, FINISH = "token", "finish"  # StreamEvent kinds


@dataclass(frozen=True)
class StreamEvent:
    """What a front end hears of its request (on the router's loop thread).

    Attributes:
        request_id: the request.
        kind: ``token`` (one output token) or ``finish`` (the last event of the request).
        time_s: ``time.time()`` when the router relayed it.
        token_id: the token (``token`` events).
        index: 0 for the first output token, 1 for the second, ... (``token`` events).
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` (``finish``); on the
            last ``token`` event its worker's reason (``stop`` or ``length``), so a front end
            can end its response with that token.
        error: why it failed (``finish`` with reason ``error``), else None.
        record: the request's finished ``RequestRecord`` (``finish``).
        logprob, top_logprobs: the token's raw logprob and its top ``(token_id, logprob)``
            pairs (``token`` events of requests with ``SamplingParams.logprobs``; the first
            token's come with the prefill worker's ``prefilled`` event), else None / ().
        unavailable: (``finish`` with an error) the request never reached a worker: a pool
            it needs had no live worker (module docstring, restarts).
    """

    request_id: str
    kind: str
    time_s: float
    token_id: int | None = None
    index: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    record: RequestRecord | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    unavailable: bool = False

    @classmethod
    def token(cls, request_id: str, time_s: float, token_id: int, index: int) -> StreamEvent:
        """A plain ``token`` event (other fields at their defaults), equal to the constructor's
        at a third of its cost (no per-field ``object.__setattr__``): one per token relayed."""
        event = object.__new__(cls)
        event.__dict__.update(_PLAIN_TOKEN, request_id=request_id, time_s=time_s,
                              token_id=token_id, index=index)
        return event


_PLAIN_TOKEN = vars(StreamEvent("", TOKEN, 0.0))  # StreamEvent.token's defaults


class TokenStream:
    """A request's ``StreamEvent``s as a blocking iterator (ends after ``finish``); the
    default sink of ``Router.submit``. ``timeout_s``: longest wait for one event (the
    router's own deadline normally ends a request long before)."""

    def __init__(self, request_id: str, timeout_s: float = 600.0) -> None:
        self.request_id = request_id
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()

    def put(self, event: StreamEvent) -> None:
        self._queue.put(event)

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            event = self._queue.get(timeout=self.timeout_s)
            yield event
            if event.kind == FINISH:
                return

    def result(self) -> RequestRecord:
        """Wait for the end; the finished record."""
        for event in self:
            if event.kind == FINISH:
                return event.record
        raise RuntimeError("unreachable")


def _safe_call(sink: Callable[[StreamEvent], None], event: StreamEvent) -> None:
    """Hand ``event`` to a front end's sink; a sink that raises hears no more (never kills
    the caller: the router loop, or a thread submitting to a stopped router)."""
    try:
        sink(event)
    except Exception:
        pass

class Router:
    """Routes requests over prefill/decode workers (disaggregated) or colocated instances.

    Args:
        workers: every worker of the placement.
        calls: how to call them (Ray or local threads).
        placement: recorded in every RequestRecord (e.g. ``disagg:1p1d``).
        policy: ``least_loaded`` (prefill by queued prompt tokens, decode and colocated by
            KV tokens, prompt + max_tokens, both counted from assignment) or
            ``round_robin`` (one rotation per pool).
        deadline_s: a request that hears nothing of itself for this long fails.
        poll_s: the longest the loop waits on the hub with nothing due (seconds); news,
            deadlines and wake-ups end the wait earlier.
        startup_timeout_s: how long each worker may take to answer its first call (it may
            still be loading its model).
        conditional: the local/remote prefill rule of a ``conditional:xPyD`` placement
            (default ``ConditionalConfig()``); ignored by other placements.
        on_worker_died: called on the loop thread as ``on_worker_died(name, cause)`` when a
            worker dies (it must not block); returns None when a replacement is on its way
            (``rejoin`` brings it), else why not. None: a dead worker stays dead.
        hub: the router's end of the workers' channels (``channel.sockets.SocketHub``
            across processes; default: a new ``channel.local.LocalHub``, for workers in this
            process); each worker gets ``open_channel(endpoint)`` once its ``info``
            answered. Its owner closes it.
        stop_worker: ``stop_worker(name, handle)`` (loop thread, must not block) kills an
            incarnation declared dead; again if it speaks afterwards. None: nobody does.

    Raises:
        ValueError: no workers for a role, or prefill and decode KV geometries differ.
        RuntimeError: a worker failed to start or did not answer within startup_timeout_s,
            or could not open its channel.
    """

    def __init__(self, workers: list[WorkerRef], calls: Calls, placement: str,
                 policy: str = "least_loaded", deadline_s: float = 60.0,
                 poll_s: float = 0.05, startup_timeout_s: float = 300.0,
                 conditional: ConditionalConfig | None = None,
                 on_worker_died: Callable[[str, str], str | None] | None = None,
                 hub: Hub | None = None,
                 stop_worker: Callable[[str, Any], None] | None = None) -> None:
        self.hub = LocalHub() if hub is None else hub
        self.workers = {w.name: w for w in workers}
        self.calls = calls
        self.placement = placement
        self.policy = policy
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        kind = Placement.parse(placement).kind
        kind = "colocated" if all(w.role == "colocated" for w in workers) else kind
        for role in ("colocated",) if kind == "colocated" else ("prefill", "decode"):
            if not any(w.role == role for w in workers):
                raise ValueError(f"placement {placement} has no {role} worker")
        infos = [self._first_info(w, startup_timeout_s) for w in workers]
        specs = {tuple(sorted(i["kv_spec"].items())) for i in infos}
        if len(specs) != 1:
            raise ValueError(f"workers disagree on the KV geometry: {infos}")
        self._kv_spec = specs.pop()  # a restarted worker must have it too
        self.on_worker_died = on_worker_died
        self.stop_worker = stop_worker
        # (name, incarnation) -> handle of an incarnation declared dead (stopped again if heard)
        self._dead_handles: dict[tuple[str, int], Any] = {}
        # name -> (incarnation, handle, its rejoin's future) of a replacement opening its channel
        self._joining: dict[str, tuple[int, Any, cf.Future]] = {}
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = min(i["vocab_size"] for i in infos)
        # decode load counts whole KV blocks: a request holds ceil(tokens / B) blocks
        self.kv_block_size = max(i.get("kv_block_size", 1) for i in infos)
        # what the smallest worker of each role can ever hold: a request past it is refused
        # before any prefill runs (validate), not failed by a worker afterwards
        blocks: dict[str, list[int]] = {}
        for w, i in zip(workers, infos):
            if "kv_capacity_tokens" in i:  # num_blocks * block_size
                blocks.setdefault(w.role, []).append(i["kv_capacity_tokens"] // self.kv_block_size)
        self.limits = {role: Limits(self.max_model_len, self.vocab_size,
                                    min(blocks[role]) if role in blocks else None,
                                    self.kv_block_size, f"a {role} worker's")
                       for role in dict.fromkeys(w.role for w in workers)}
        self.kv_capacity_tokens = {role: limits.kv_capacity_tokens
                                   for role, limits in self.limits.items() if limits.kv_blocks}
        self.assigner = Assigner([(w.name, w.role) for w in workers], kind, policy,
                                 self.kv_block_size, conditional)
        # prompts' block hashes feed the assigner's prefix index when it reads them and the
        # workers cache prefixes (with caching off every prefix match stays 0)
        self._hash_prompts = self.assigner.uses_prefixes and all(
            i.get("enable_prefix_caching", False) for i in infos)
        self._flights: dict[str, _Flight] = {}
        self._parked: dict[str, str] = {}  # request -> the role of the empty pool it waits for
        self._owner_checks: dict[str, Any] = {}  # request -> pending info() of its kv_owner
        self._sinks: dict[str, Callable[[StreamEvent], None]] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit"|"abort", ...)
        self._thread: threading.Thread | None = None
        self._driver: int | None = None  # ident of the thread driving the loop now
        self._stopping = threading.Event()
        self._closed = False  # the online loop has ended: submits are refused at once
        self._closed_lock = threading.Lock()
        self._due_s = float("inf")  # no flight's deadline is earlier (_wait_on, _check_deadlines)
        self.loop_errors = 0  # exceptions the online loop survived (each failed its flights)
        for worker in workers:
            try:
                self._open_channel(worker, startup_timeout_s)
            except Exception as err:
                raise RuntimeError(f"{worker.role} worker {worker.name} could not open its "
                                   f"channel: {describe_error(err)}") from err

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: waiting for prefill or for a pool (any thread; /metrics)."""
        return self._waiting_running()[0]

    @property
    def num_running(self) -> int:
        """Requests past their prefill, not yet finished (any thread; /metrics)."""
        return self._waiting_running()[1]

    def _waiting_running(self) -> tuple[int, int]:
        flights = list(self._flights.values())  # one snapshot: the loop may change it meanwhile
        waiting = sum(1 for f in flights  # a first token out: past its prefill, KV being put
                      if f.stage == POOL or (f.stage == PREFILL and not f.record.output_token_ids))
        return waiting, len(flights) - waiting

    @property
    def loads(self) -> dict[str, int]:
        """Worker name -> load in tokens (``router.assignment``: what it was charged for the
        requests it still serves)."""
        return self.assigner.loads

    def call_now(self, worker: WorkerRef, method: str, *args: Any,
                 timeout_s: float | None = None) -> Any:
        """Call one worker and wait for the answer (bounded by ``deadline_s``)."""
        timeout_s = self.deadline_s if timeout_s is None else timeout_s
        pending = self.calls.call(worker.handle, method, *args)
        if not self.calls.ready([pending], timeout_s):
            raise TimeoutError(f"worker {worker.name} did not answer {method} in {timeout_s} s")
        return self.calls.result(pending)

    def _open_channel(self, worker: WorkerRef, timeout_s: float) -> None:
        """Attach ``worker``'s current incarnation to the hub and have it open its port
        (commands sent meanwhile wait in the hub)."""
        endpoint = self.hub.attach(worker.name, worker.incarnation)
        self.call_now(worker, "open_channel", endpoint, timeout_s=timeout_s)

    def _first_info(self, worker: WorkerRef, timeout_s: float) -> dict:
        try:
            return self.call_now(worker, "info", timeout_s=timeout_s)
        except (WorkerDied, TimeoutError) as err:
            raise RuntimeError(f"{worker.role} worker {worker.name} failed to start: {err}") from err

    # ---- public ----------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ``engine.limits.LimitError`` (a ValueError naming the field at fault) when a
        worker the request needs could never serve it: each role's ``limits`` (the context,
        the vocabulary, the smallest worker's whole KV cache: prompt + 1 tokens on a prefill
        worker, the whole request on a decode or colocated one). Request and
        SamplingParams have checked their own fields already."""
        for role, limits in self.limits.items():
            limits.check(request.num_prompt_tokens, request.sampling.max_tokens,
                         request.prompt_token_ids, request.sampling.stop_token_ids,
                         prefill_only=role == "prefill")

    def submit(self, request: Request, sink: Callable[[StreamEvent], None] | None = None,
               arrived_s: float | None = None, tokens: bool = True) -> TokenStream | None:
        """Queue ``request`` (any thread); its events go to ``sink`` (called on the loop
        thread, must not block), or to the returned ``TokenStream`` when ``sink`` is None.

        ``arrived_s``: its arrival (``time.time()``; default now). ``tokens=False``: the
        sink hears only the ``finish`` event (a replay reads the finished records; a
        ``StreamEvent`` per token is work at GPU token rates). A request that cannot be
        served (invalid, its id already in flight, no live worker) still gets one
        ``finish`` event, with reason ``error`` and the reason why.
        """
        stream = None
        if sink is None:
            stream = TokenStream(request.request_id)
            sink = stream.put
        arrived_s = time.time() if arrived_s is None else arrived_s
        with self._closed_lock:
            closed = self._closed
            if not closed:
                self._inbox.put(("submit", request, arrived_s, sink, tokens))
        if closed:  # nobody drives the loop any more: answer now, on the caller's thread
            _safe_call(sink, self._refusal(request, arrived_s, "the router is stopped"))
        elif threading.get_ident() != self._driver:  # the driver drains its inbox next turn
            self._wake_up()
        return stream

    def abort(self, request_id: str) -> None:
        """End ``request_id`` if it is still in flight (any thread): its workers abort it
        and free its KV; its sink gets ``finish`` with reason ``abort``. Unknown or already
        finished ids are ignored."""
        self._inbox.put(("abort", request_id))
        self._wake_up()

    def rejoin(self, name: str, handle: Any, info: dict) -> cf.Future:
        """A replacement of dead worker ``name`` is ready (any thread): ``handle`` is called
        from now on and ``info`` is its ``info()`` answer. It must have the placement's KV
        geometry and at least the context and vocabulary the router checks requests
        against, and open its channel within ``deadline_s``.

        Returns:
            A future of None once it serves (routed to), else of why it was refused; a
            refused one is its caller's to stop, and ``name`` stays restarting until the
            caller rejoins another or calls ``worker_lost``; a ``NothingToReplace`` when
            ``name`` is live or another replacement of it is joining (no restart failed).
        """
        joined: cf.Future = cf.Future()
        with self._closed_lock:
            closed = self._closed
            if not closed:
                self._inbox.put(("rejoin", name, handle, info, joined))
        if closed:
            joined.set_result("the router is stopped")
        else:
            self._wake_up()
        return joined

    def worker_died(self, name: str, handle: Any, cause: str) -> None:
        """Worker ``name``'s process died (any thread; its deployment's watch, e.g. Ray's
        actor death): handled as a death the channel reported, unless ``handle`` is no
        longer that worker's (a replacement joined meanwhile)."""
        self._inbox.put(("died", name, handle, cause))
        self._wake_up()

    def worker_lost(self, name: str, reason: str) -> None:
        """No replacement of dead worker ``name`` will come (any thread): requests waiting
        for its pool fail at once if nothing else can serve them."""
        self._inbox.put(("lost", name, reason))
        self._wake_up()

    def start(self) -> None:
        """Run the loop on a background thread (the online front end).

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("the router loop is already running")
        self._stopping.clear()
        self._closed = False
        self._thread = threading.Thread(target=self._serve_forever, name="router-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the background loop: requests still in flight end with an error (their
        workers abort them), then the outstanding calls drain (bounded)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake_up()
        self._thread.join(timeout_s)
        self._thread = None

    def _serve_forever(self) -> None:
        precise_timers()
        self._driver = threading.get_ident()
        while not self._stopping.is_set():
            try:
                self._step(self.poll_s)
            except Exception as err:  # a bug must not leave every client waiting forever
                self.loop_errors += 1
                self._fail_all(f"router loop error: {describe_error(err)}")
        with self._closed_lock:  # from here on submit() refuses; what came before is served
            self._closed = True
        self._drain_inbox()
        for _, _, joined in self._joining.values():  # their callers stop them
            joined.set_result("the router stopped")
        self._joining.clear()
        self._fail_all("the router stopped")
        self._drain()
        self._driver = None

    def _fail_all(self, error: str) -> None:
        """End every flight with ``error``; a flight whose ending itself fails (its abort
        cannot be sent) is still answered and dropped, so the loop never dies here."""
        for flight in list(self._flights.values()):
            try:
                self._finish(flight, error=error)
            except Exception as err:
                self.loop_errors += 1
                self._flights.pop(flight.request.request_id, None)
                self._parked.pop(flight.request.request_id, None)
                self.assigner.release(flight.request.request_id)  # loads still return to 0
                self._emit(self._refusal(flight.request, flight.record.timeline.get(ARRIVED, 0.0),
                                         f"{error}; ending it failed too: {describe_error(err)}"))
                self._sinks.pop(flight.request.request_id, None)

    def run(self, workload: list[tuple[Request, float]],
            on_finish: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Serve ``workload`` (requests with arrival offsets in seconds from now) to the end:
        the replay front end, driving the loop in this thread.

        A closed-loop workload (one with ``follow(record, end_s)``, e.g.
        ``experiments.workload_spec.ClosedLoop``) is told of every request that ended (its
        record, seconds since the start) and returns the requests that follow it (with
        their offsets, not earlier than now): the next turn of a conversation.

        Returns:
            One RequestRecord per request (the followers too), in arrival order.

        Raises:
            ValueError: two requests share a request_id.
            RuntimeError: the online loop is running (one driver at a time).
        """
        if self._thread is not None:
            raise RuntimeError("run() needs the router to itself: stop() the online loop first")
        with self._closed_lock:  # this thread drives the loop now: submits are served again
            self._closed = False
        ids = [request.request_id for request, _ in workload]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id must be unique within a workload")
        arrivals = sorted(workload, key=lambda item: item[1])
        done: dict[str, RequestRecord] = {}
        follow = getattr(workload, "follow", None)

        def collect(event: StreamEvent) -> None:
            if event.kind == FINISH:
                done[event.request_id] = event.record
                if on_finish is not None:
                    on_finish(event.record)
                if follow is not None:
                    for item in follow(event.record, time.time() - start_s):
                        bisect.insort(arrivals, item, lo=next_index, key=lambda it: it[1])

        precise_timers()  # (this thread's): an arrival's wait ends within 1 us of it, not 50
        self._driver = threading.get_ident()
        start_s = time.time()
        self._flights, self._sinks, self._parked = {}, {}, {}
        next_index = 0
        while next_index < len(arrivals) or self._flights:
            while next_index < len(arrivals) and start_s + arrivals[next_index][1] <= time.time():
                # arrived = the scheduled time, however late we got here (no coordinated omission)
                self.submit(arrivals[next_index][0], collect, start_s + arrivals[next_index][1],
                            tokens=False)
                next_index += 1
            wait_s = self.poll_s
            if next_index < len(arrivals):
                due_s = start_s + arrivals[next_index][1] - time.time()
                if due_s < 0.001:  # the hub waits whole ms, never past the arrival: sleep the rest
                    # (not spun: on a host with a core per worker a spinning router takes one)
                    self._step(0.0)
                    time.sleep(max(0.0, start_s + arrivals[next_index][1] - time.time()))
                    continue
                wait_s = min(wait_s, math.floor(due_s * 1000) / 1000)
            self._step(wait_s)
        self._drain()
        self._driver = None
        return [done[request.request_id] for request, _ in arrivals]

    # ---- the loop -------------------------------------------------------------------------
    def _step(self, wait_s: float) -> None:
        """One turn of the loop: take queued submits and aborts, wait on the hub up to
        ``wait_s`` (less when a deadline falls due first; not at all after taking commands,
        so the next turn sees the inbox again at once) and handle what it brings, check
        deadlines."""
        if self._drain_inbox():
            wait_s = 0.0
        if self._flights:
            wait_s = min(wait_s, max(0.0, self._due_s - time.time()))
        for item in self.hub.receive(wait_s):
            if isinstance(item, Died):
                self._on_died(item)
            elif isinstance(item, Stale):
                self._on_stale(item)
            else:
                self._on_message(item)
        if self._owner_checks:
            self._collect_owner_checks()
        if time.time() >= self._due_s:
            self._check_deadlines()

    def _wake_up(self) -> None:
        self.hub.wake()

    def _drain_inbox(self) -> bool:
        """Apply the queued commands; whether there were any."""
        took = False
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return took
            took = True
            if command[0] == "abort":
                flight = self._flights.get(command[1])
                if flight is not None:
                    self._finish(flight, finish_reason="abort")
                continue
            if command[0] == "rejoin":
                self._rejoin(*command[1:])
                continue
            if command[0] == "opened":
                self._opened(*command[1:])
                continue
            if command[0] == "lost":
                self._lost(*command[1:])
                continue
            if command[0] == "died":
                _, name, handle, cause = command
                worker = self.workers.get(name)
                joining = self._joining.get(name)
                if joining is not None and joining[1] is handle:
                    self._replacement_died(name, cause)
                elif worker is not None and worker.alive and worker.handle is handle:
                    self._worker_died(name, WorkerDied(cause))
                continue
            _, request, arrived_s, sink, tokens = command
            if request.request_id in self._flights:  # refused; the one in flight goes on
                _safe_call(sink, self._refusal(
                    request, arrived_s, f"request_id {request.request_id} is already in flight"))
                continue
            self._sinks[request.request_id] = sink
            self._dispatch(request, arrived_s, tokens)

    # ---- dispatch ---------------------------------------------------------------------
    def _dispatch(self, request: Request, arrived_s: float | None = None,
                  tokens: bool = True) -> None:
        """``arrived_s``: the scheduled arrival (default: now); ``dispatched`` is stamped now;
        ``tokens``: its sink hears token events (``submit``)."""
        now = time.time()
        request = request.arrived_at(now if arrived_s is None else arrived_s)
        record = RequestRecord(request_id=request.request_id, placement=self.placement,
                               num_prompt_tokens=request.num_prompt_tokens)
        record.timeline[ARRIVED] = request.arrival_time_s
        record.timeline[DISPATCHED] = now
        flight = _Flight(request, record, stream_tokens=tokens)
        self._flights[request.request_id] = flight
        try:
            self.validate(request)
        except ValueError as err:
            self._finish(flight, error=str(err))
            return
        self._assign(flight)

    def _assign(self, flight: _Flight) -> None:
        """Give ``flight`` its workers and send it to the first; a pool without a live
        worker parks it (a worker of that pool restarting) or fails it (none)."""
        request, record = flight.request, flight.record
        hashes = (prompt_block_hashes(request, self.kv_block_size) if self._hash_prompts
                  else ())
        try:
            assignment = self.assigner.assign(request.request_id, request.num_prompt_tokens,
                                              request.sampling.max_tokens, hashes)
        except NoLiveWorker as err:
            if self._restarting(err.role):
                if request.request_id not in self._parked:
                    self._parked[request.request_id] = err.role
                    self._wait_on(flight, f"the {err.role} pool", POOL)
                return
            self._finish(flight, error=self._no_worker(err.role), unavailable=True)
            return
        except ValueError as err:
            self._finish(flight, error=str(err))
            return
        first, decode = assignment.first, assignment.decode
        record.prefill_worker, record.decode_worker = first, decode
        record.prefill_path = "remote" if assignment.remote else "local"
        self._wait_on(flight, first, PREFILL)
        flight.kv_token_start = assignment.kv_token_start
        args = ((request,) if first == decode else
                (request, self.workers[decode].rank, assignment.kv_token_start))
        self._send(first, "submit", request.request_id, *args)
        record.timeline[PREFILL_QUEUED] = time.time()

    def _wait_on(self, flight: _Flight, worker: str, stage: str) -> None:
        flight.worker, flight.stage = worker, stage
        flight.deadline_s = time.time() + self.deadline_s
        self._due_s = min(self._due_s, flight.deadline_s)

    def _send(self, worker: str, method: str, request_id: str | None, *args: Any) -> None:
        self.hub.send(worker, Command(method, request_id, args))

    # ---- events -----------------------------------------------------------------------
    def _on_message(self, message: Message) -> None:
        """One step's news of a worker (the hub delivers only its current incarnation's)."""
        worker = self.workers.get(message.worker)
        if worker is None or message.incarnation != worker.incarnation:
            return
        for event in message.body:
            if event.kind == ev.TOKENS:
                self._on_tokens(event)
            elif event.kind == ev.DIED:  # its last words: nothing follows
                self._worker_died(message.worker, WorkerDied(event.error))
                return
            else:
                self._on_event(event)

    def _on_died(self, died: Died) -> None:
        """The hub heard nothing of a worker incarnation for ``DEAD_AFTER_S``, or its port
        reported its own failure (``Died.cause``)."""
        worker = self.workers.get(died.worker)
        cause = died.cause or (f"its channel fell silent ({died.silent_s:.1f} s without a "
                               "heartbeat)")
        joining = self._joining.get(died.worker)
        if joining is not None and joining[0] == died.incarnation:
            self._replacement_died(died.worker, cause)
        elif worker is not None and died.incarnation == worker.incarnation:
            self._worker_died(died.worker, WorkerDied(cause))

    def _replacement_died(self, name: str, cause: str) -> None:
        """The replacement joining as ``name`` died before its channel opened: refused (its
        ``rejoin`` future says why); its ``opened`` news, if any comes, is then ignored."""
        _, _, joined = self._joining.pop(name)
        self.hub.detach(name)
        joined.set_result(f"its replacement died while it joined: {cause}")

    def _on_stale(self, stale: Stale) -> None:
        """An incarnation declared dead spoke: it runs, so it is stopped again."""
        handle = self._dead_handles.get((stale.worker, stale.incarnation))
        if handle is not None:
            self._stop_incarnation(stale.worker, handle)

    def _stop_incarnation(self, name: str, handle: Any) -> None:
        """Hand an incarnation declared dead to ``stop_worker`` (module docstring)."""
        if self.stop_worker is None:
            return
        try:
            self.stop_worker(name, handle)
        except Exception as err:  # it may run on: said where the worker's state is read
            worker = self.workers[name]
            worker.cause = f"{worker.cause}; stopping it failed: {describe_error(err)}"

    def _on_tokens(self, batch: ev.TokenBatch) -> None:
        """A step's plain tokens (``engine.events.TokenBatch``): ``_on_event``'s token path
        without what a plain token never carries (stamps, KV, finish, first-token fields)."""
        now = time.time()  # they leave the router now
        deadline_s = now + self.deadline_s
        worker, worker_s = batch.worker, batch.time_s
        flights, token_event = self._flights, StreamEvent.token
        for rid, token_id in zip(batch.request_ids, batch.token_ids):
            flight = flights.get(rid)
            if flight is None:
                continue  # late news of a request already ended (a plain token holds no KV)
            record = flight.record
            if self._news_of_the_dead(flight, worker) or self._stale(flight, worker):
                continue
            flight.deadline_s = deadline_s
            record.token_times_s.append(now)
            record.token_worker_times_s.append(worker_s)
            record.output_token_ids.append(token_id)
            if flight.stage == PREFILL:
                flight.stage = DECODE
            if flight.stream_tokens:
                self._emit(token_event(rid, now, token_id, len(record.output_token_ids) - 1))

    def _stale(self, flight: _Flight, worker: str) -> bool:
        """News of ``flight`` from a worker it left when that one died (another name)."""
        record = flight.record
        return worker not in (record.prefill_worker, record.decode_worker)

    def _news_of_the_dead(self, flight: _Flight, worker: str, incarnation: int | None = None,
                          error: str | None = None) -> bool:
        """If this news of ``flight`` (``error``: an error event's text) comes from the dead
        incarnation of ``worker`` it was moved off (``_move_decode``; default: the one now in
        place), end the flight and say True. That worker had fetched the KV (or failed to) and
        freed the handles, so the request ends as if the news had come before the death: with
        the error it reported, else as one decoding there; its handles are never released."""
        if flight.moved_from != worker:
            return False
        if incarnation is None:
            incarnation = self.workers[worker].incarnation
        if flight.moved_from_incarnation != incarnation:
            return False
        flight.kv_handles = ()
        self._finish(flight, error=flight.moved_from_death if error is None
                     else f"{worker}: {error}")
        return True

    def _on_event(self, event: ev.WorkerEvent) -> None:
        flight = self._flights.get(event.request_id)
        if flight is None:  # late news of a request already ended: free the KV it carries
            self._release_kv(event.worker, event.kv_handles)
            return
        record = flight.record
        reported = event.error if event.kind == ev.ERROR else None
        if self._news_of_the_dead(flight, event.worker, error=reported) or self._stale(
                flight, event.worker):
            return
        record.timeline.update(event.stamps)
        flight.deadline_s = time.time() + self.deadline_s  # its own news refreshes its deadline
        if event.kind == ev.ERROR:
            error = f"{event.worker}: {event.error}"
            if flight.moved_from is not None and flight.stage == TRANSFER:
                # the dead worker may have fetched (and freed) the KV before it died, its
                # kv_got never collected: the request died with it
                error = (f"{flight.moved_from_death} (after its KV was handed over); "
                         f"fetching it again failed: {error}")
            elif (event.kv_fetch_failed and flight.stage == TRANSFER
                  and event.worker == flight.worker and flight.kv_handles):
                self._fetch_failed(flight, error)
                return
            self._finish(flight, error=error)
        elif event.kind == ev.KV_GOT:
            if event.kv_bytes:  # its prompt's blocks are cached there now (0: it recomputes)
                self.assigner.kv_landed(record.request_id, event.worker)
            record.kv_get_s = event.kv_get_s
            record.kv_transfer_s = event.kv_transfer_s
            flight.stage, flight.kv_handles = DECODE, ()  # fetched: the decode worker freed them
            if record.kv_put_s is not None and event.kv_get_s is not None:
                record.kv_transfer_s = record.kv_put_s + event.kv_get_s  # full cost: put + get
        elif event.kind in (ev.TOKEN, ev.PREFILLED):
            if event.kind == ev.PREFILLED:
                record.kv_put_s = event.kv_put_s
                record.kv_bytes_saved = event.kv_bytes_saved
            if event.num_cached_prompt_tokens is not None:
                record.num_cached_prompt_tokens = event.num_cached_prompt_tokens
            record.num_preemptions += event.num_preemptions
            # a prefill worker's first token comes before its prefilled (which repeats it)
            kv_to_come = (event.kind == ev.TOKEN and event.finish_reason is None
                          and self.workers[event.worker].role == "prefill")
            if not (event.kind == ev.PREFILLED and flight.stage == PREFILL
                    and record.output_token_ids):
                self._token_out(flight, event)
            if flight.stage == PREFILL and not kv_to_come:
                flight.stage = DECODE
            if event.finish_reason is not None:
                self._finish(flight, finish_reason=event.finish_reason)
            elif event.kind == ev.PREFILLED:
                self._hand_over(flight, event)

    def _token_out(self, flight: _Flight, event: ev.WorkerEvent) -> None:
        """Record the token of ``event`` and stream it: it leaves the router now."""
        record = flight.record
        record.token_times_s.append(time.time())
        record.token_worker_times_s.append(event.time_s)  # the worker produced it then
        record.output_token_ids.append(event.token_id)
        if flight.stream_tokens:
            self._emit(StreamEvent(record.request_id, TOKEN, record.token_times_s[-1],
                                   token_id=event.token_id,
                                   index=len(record.output_token_ids) - 1,
                                   finish_reason=event.finish_reason, logprob=event.logprob,
                                   top_logprobs=event.top_logprobs))

    def _hand_over(self, flight: _Flight, event: ev.WorkerEvent) -> None:
        """The first token is out; the router holds the handles until ``admit`` takes them."""
        record = flight.record
        record.kv_bytes = event.kv_bytes
        self.assigner.prefilled(flight.request.request_id, flight.worker)
        flight.kv_owner, flight.kv_handles = event.worker, event.kv_handles
        flight.kv_owner_incarnation = self.workers[event.worker].incarnation
        self._admit(flight)

    def _admit(self, flight: _Flight) -> None:
        """Hand a prefilled request's KV handles to its decode worker; if that one died
        meanwhile, to another live one, else hold them while the decode pool restarts
        (parked, the handles in the router's hands) or give them back and fail."""
        request, record = flight.request, flight.record
        decode = record.decode_worker
        if not self.workers[decode].alive:
            try:
                decode = self.assigner.reassign_decode(
                    request.request_id, request.num_prompt_tokens, request.sampling.max_tokens)
            except NoLiveWorker:
                if self._restarting("decode"):
                    self._parked[request.request_id] = "decode"
                    self._wait_on(flight, "the decode pool", POOL)
                else:
                    self._finish(flight, error=self._no_worker("decode"), kv_back=True,
                                 unavailable=True)
                return
            record.decode_worker = decode
        self._wait_on(flight, decode, TRANSFER)
        self._send(decode, "admit", request.request_id, request, record.output_token_ids[0],
                   flight.kv_handles, flight.kv_token_start)

    def _fetch_failed(self, flight: _Flight, error: str) -> None:
        """The decode worker could not fetch the KV (it freed the handles): the request fails
        with ``error``, naming its producer's death first if that incarnation died; one that
        seems alive is asked (``info``), its death may not have reached the router yet."""
        flight.kv_handles, flight.fetch_error = (), error
        if self._owner_lives(flight):
            self._owner_checks[flight.request.request_id] = self.calls.call(
                self.workers[flight.kv_owner].handle, "info")
        else:
            self._finish(flight, error=self._died_holding(flight, error))

    def _owner_lives(self, flight: _Flight) -> bool:
        owner = self.workers[flight.kv_owner]
        return owner.alive and owner.incarnation == flight.kv_owner_incarnation

    def _died_holding(self, flight: _Flight, error: str) -> str:
        owner = self.workers[flight.kv_owner]
        return (f"{owner.role} worker {owner.name} died holding the KV of "
                f"{flight.request.request_id}: {error}")

    def _collect_owner_checks(self) -> None:
        """End the requests whose KV producer answered (the fetch error stands) or died."""
        rids = {pending: rid for rid, pending in self._owner_checks.items()}
        for done in self.calls.ready(list(rids), 0.0):
            flight = self._flights.get(rids[done])
            if flight is None or flight.request.request_id not in self._owner_checks:
                continue  # ended meanwhile (a death that _worker_died handled)
            try:
                self.calls.result(done)
            except WorkerDied as err:
                if self._owner_lives(flight):
                    self._worker_died(flight.kv_owner, err)  # ends the flight too
                    continue
            except Exception:  # it answered: alive
                pass
            self._finish(flight, error=flight.fetch_error if self._owner_lives(flight)
                         else self._died_holding(flight, flight.fetch_error))

    def _refusal(self, request: Request, arrived_s: float, error: str) -> StreamEvent:
        """The one ``finish`` event of a request that is not (or no longer) served."""
        now = time.time()
        record = RequestRecord(request.request_id, self.placement,
                               num_prompt_tokens=request.num_prompt_tokens,
                               finish_reason="error", error=error,
                               timeline={ARRIVED: arrived_s, ERROR: now, FINISHED: now})
        return StreamEvent(request.request_id, FINISH, now, finish_reason="error", error=error,
                           record=record)

    def _emit(self, event: StreamEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is None:
            return
        try:
            sink(event)
        except Exception:  # a front end gone (its event loop closed): it hears no more,
            self._sinks.pop(event.request_id, None)  # and the loop never dies of it

    def _release_kv(self, owner: str | None, handles: tuple[Any, ...],
                    incarnation: int | None = None) -> None:
        """Give KV handles the router cannot pass on back to their producer to free (the
        incarnation that put them: a dead one's KV went with it)."""
        if handles and owner is not None and self.workers[owner].alive and (
                incarnation is None or incarnation == self.workers[owner].incarnation):
            self._send(owner, "release", None, tuple(handles))

    def _finish(self, flight: _Flight, finish_reason: str | None = None,
                error: str | None = None, kv_back: bool = False,
                unavailable: bool = False) -> None:
        """End ``flight``; ``kv_back``: its KV in transit never reached a live decode worker
        (``admit`` failed, or the decode worker died), so it goes back to its producer;
        ``unavailable``: it failed for want of a live worker (``StreamEvent.unavailable``)."""
        record = flight.record
        self._owner_checks.pop(record.request_id, None)
        holding = self._parked.pop(record.request_id, None) is not None and bool(flight.kv_handles)
        if kv_back or holding:  # held while parked: nobody else will free them
            self._release_kv(flight.kv_owner, flight.kv_handles, flight.kv_owner_incarnation)
        now = time.time()
        record.timeline[FINISHED] = now
        if error is not None:
            record.timeline[ERROR] = now
            record.error, record.finish_reason = error, "error"
        else:
            record.finish_reason = finish_reason
        if error is not None or finish_reason == "abort":
            for name in {record.prefill_worker, record.decode_worker} - {None}:
                if self.workers[name].alive:  # free whatever it holds there
                    self._send(name, "abort", record.request_id, record.request_id)
        self.assigner.release(record.request_id)
        del self._flights[record.request_id]
        self._emit(StreamEvent(record.request_id, FINISH, now, finish_reason=record.finish_reason,
                               error=record.error, record=record, unavailable=unavailable))
        self._sinks.pop(record.request_id, None)

    # ---- failures ---------------------------------------------------------------------
    def _worker_died(self, name: str, err: Exception) -> None:
        """Mark ``name`` dead and ask its owner for a replacement (``on_worker_died``), then
        end every request that still needs it, naming the cause (or move it: ``_movable``)."""
        worker = self.workers[name]
        if not worker.alive:
            return
        worker.alive = False
        worker.cause = f"died: {describe_error(err)}"
        self.hub.detach(name)  # nothing more goes to it; its late news is stale
        self._dead_handles[(name, worker.incarnation)] = worker.handle
        self._stop_incarnation(name, worker.handle)
        self.assigner.mark_dead(name)
        if self.on_worker_died is not None:  # first: a moved request may wait for it
            try:
                why_not = self.on_worker_died(name, worker.cause)
            except Exception as hook_err:  # no restart then; the router goes on
                why_not = f"its restart could not start: {describe_error(hook_err)}"
            worker.restarting = why_not is None
            if why_not is not None:
                worker.cause += f"; not restarted: {why_not}"
        for rid in self.assigner.requests_needing(name):
            flight = self._flights.get(rid)
            if flight is None:
                continue
            if flight.fetch_error:  # already failed: its KV producer's answer decides how
                continue
            death = f"{worker.role} worker {name} died: {err}"
            if self._movable(flight, name):
                self._move_decode(flight, name, death)
                continue
            self._finish(flight, error=death, kv_back=flight.worker == name)
        for rid in list(self._parked) + list(self._owner_checks):  # KV it put went with it
            flight = self._flights[rid]
            if flight.kv_owner == name and (flight.kv_handles or flight.fetch_error):
                self._finish(flight, error=self._died_holding(
                    flight, flight.fetch_error or str(err)))
        self._fail_unservable()

    def _movable(self, flight: _Flight, dead: str) -> bool:
        """``dead`` is the decode worker of a remote request that has not started decoding
        there: still prefilling elsewhere, or its KV handed over but not yet fetched (the
        router still holds the handles and their producer lives). Another decode worker can
        take it."""
        record = flight.record
        if record.prefill_path != "remote" or record.decode_worker != dead:
            return False
        if flight.stage == PREFILL:
            return flight.worker != dead
        owner = self.workers.get(flight.kv_owner or "")
        return (flight.stage == TRANSFER and bool(flight.kv_handles) and owner is not None
                and owner.alive and owner.incarnation == flight.kv_owner_incarnation)

    def _move_decode(self, flight: _Flight, dead: str, death: str) -> None:
        """Give a ``_movable`` request another decode worker (module docstring, restarts);
        ``death``: the error of a request that was decoding on ``dead``."""
        if flight.stage == TRANSFER:
            flight.moved_from, flight.moved_from_death = dead, death
            flight.moved_from_incarnation = self.workers[dead].incarnation
            self._admit(flight)  # to a live one, or held while the pool restarts
            return
        request = flight.request
        try:
            flight.record.decode_worker = self.assigner.reassign_decode(
                request.request_id, request.num_prompt_tokens, request.sampling.max_tokens)
        except NoLiveWorker:
            pass  # decided at its hand-over (``_admit``): wait for the pool, or fail

    def _rejoin(self, name: str, handle: Any, info: dict, joined: cf.Future) -> None:
        """Check a replacement (``rejoin``), attach it as the next incarnation and have it
        open its channel on a thread of its own (``_await_channel``); ``_opened`` ends it."""
        worker = self.workers[name]
        if worker.alive or name in self._joining:
            joined.set_result(NothingToReplace(
                f"worker {name} is {worker.state if worker.alive else 'joining'}: nothing to "
                "replace"))
            return
        spec = tuple(sorted(info["kv_spec"].items()))
        problem = ("a different KV geometry" if spec != self._kv_spec else
                   "a shorter context" if info["max_model_len"] < self.max_model_len else
                   "a smaller vocabulary" if info["vocab_size"] < self.vocab_size else None)
        if problem is not None:
            joined.set_result(f"its replacement has {problem} than the placement: {info}")
            return
        worker.incarnation += 1
        endpoint = self.hub.attach(name, worker.incarnation)
        self._joining[name] = (worker.incarnation, handle, joined)
        try:
            pending = self.calls.call(handle, "open_channel", endpoint)
        except Exception as err:  # the call could not even start: refused like a failed one
            self._opened(name, worker.incarnation, describe_error(err))
            return
        threading.Thread(target=self._await_channel, args=(name, worker.incarnation, pending),
                         name=f"open-channel-{name}", daemon=True).start()

    def _await_channel(self, name: str, incarnation: int, pending: Any) -> None:
        """Off the loop: wait for ``open_channel`` (``deadline_s``), post ``opened``."""
        error = None
        try:
            if not self.calls.ready([pending], self.deadline_s):
                raise TimeoutError(f"no answer to open_channel within {self.deadline_s} s")
            self.calls.result(pending)
        except Exception as err:
            error = describe_error(err)
        self._inbox.put(("opened", name, incarnation, error))
        self._wake_up()

    def _opened(self, name: str, incarnation: int, error: str | None) -> None:
        """A replacement's channel opened (``error`` None): it serves; else it is refused."""
        joining = self._joining.get(name)
        if joining is None or joining[0] != incarnation:
            return
        del self._joining[name]
        _, handle, joined = joining
        if error is not None:
            self.hub.detach(name)
            joined.set_result(f"its replacement could not open its channel: {error}")
            return
        worker = self.workers[name]
        worker.handle = handle
        worker.alive, worker.restarting, worker.cause = True, False, None
        worker.restarts += 1
        self.assigner.mark_live(name)
        joined.set_result(None)
        for rid in list(self._parked):  # in arrival order; one may park again (another pool)
            del self._parked[rid]
            flight = self._flights.get(rid)
            if flight is None:
                continue
            if flight.kv_handles:  # prefilled, waiting for a decode worker
                self._admit(flight)
            else:
                self._assign(flight)

    def _lost(self, name: str, reason: str) -> None:
        worker = self.workers[name]
        if not worker.alive:
            worker.restarting, worker.cause = False, reason
            self._fail_unservable()

    def _restarting(self, role: str) -> bool:
        return any(w.restarting for w in self.workers.values() if w.role == role)

    def _no_worker(self, role: str) -> str:
        why = "; ".join(f"{w.role} worker {w.name} {w.cause}" for w in self.workers.values()
                        if w.role == role)
        return f"no live {role} worker: {why}"

    def _fail_unservable(self) -> None:
        """Parked requests whose pool has no worker alive or restarting fail now."""
        for rid, role in list(self._parked.items()):
            if not self._restarting(role) and not any(
                    w.alive for w in self.workers.values() if w.role == role):
                self._finish(self._flights[rid], error=self._no_worker(role), unavailable=True)
                # (held KV handles go back to their producer in _finish)

    def _check_deadlines(self) -> None:
        now = time.time()
        for flight in list(self._flights.values()):
            if now > flight.deadline_s and flight.stage == POOL:
                restarting = [w.name for w in self.workers.values()
                              if w.restarting and flight.worker == f"the {w.role} pool"]
                self._finish(flight, unavailable=True, error=(
                    f"no live worker in {flight.worker} within {self.deadline_s} s "
                    f"({', '.join(restarting) or 'none'} restarting)"))
            elif now > flight.deadline_s:
                self._finish(flight, error=flight.fetch_error or (  # its producer never answered
                    f"deadline: no news of the request for {self.deadline_s} s while waiting "
                    f"for {flight.stage} on {flight.worker}"))
        self._due_s = min((f.deadline_s for f in self._flights.values()), default=float("inf"))

    def _drain(self) -> None:
        """One last turn on the hub: commands waiting for a port leave, and news already
        there is handled (a late ``prefilled`` event's KV goes back to its producer)."""
        for item in self.hub.receive(0.0):
            if isinstance(item, Message):
                self._on_message(item)
