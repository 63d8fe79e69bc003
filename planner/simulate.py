"""A discrete-event simulator of one placement serving one workload (no torch, no threads).

It runs pdlab's own scheduling code on a simulated clock (a real ``engine.scheduler.Scheduler``
per instance, ``router.assignment.Assigner``); only the forward and the KV bytes are replaced by
fitted durations (``latency``): a step lasts the step model at its batch's features; a prefill
worker's first token leaves at its step's end, its put then holds the loop before the hand-over;
a decode instance fetches once ``schedule()`` reserves the blocks. Output: ``RequestRecord``s,
step and transfer records shaped like a real run's (simulated seconds from 0). Same inputs, same
records.

Fast-forward (default): pure-decode steps that would repeat unchanged until the next event (an
arrival, hand-over, KV landing or stop) advance in one go with the same floats; never a step that
preempted or needs more blocks than are free. Records equal step-by-step's exactly."""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import (DEFAULT_CPU_KV_CACHE_GB,  # noqa: F401 (test_plan_identity reads it here)
                           ConditionalConfig, EngineConfig, kv_budget_bytes_for,
                           kv_num_blocks_for, placement_engine_overrides)
from engine.limits import LimitError, Limits
from engine.placement import Placement
from engine.metrics import (ARRIVED, DECODE_ADMITTED, DISPATCHED, FINISHED, KV_GOT, KV_PUT,
                            PREFILL_FINISHED, PREFILL_QUEUED, PREFILL_STARTED, RequestRecord,
                            StepRecord)
from engine.kv_blocks import prompt_block_hashes
from engine.request import Request, RequestState, RequestStatus
from engine.scheduler import ScheduledBatch, Scheduler
from planner.latency import TransferModel
from router.assignment import Assigner
from router.policy import pick

FAKE_TOKEN = 0  # output token ids are not simulated; lengths are (ignore_eos workloads)
_STEP_END, _START, _HANDOVER, _FETCHED = range(4)  # heap event kinds (arrivals: a sorted list)
# At one instant the step starts run last: a step sees every arrival of its start time.
_EARLY, _LATE = 0, 1
_PREFILLED, _FINISHED_STOPPED = RequestStatus.PREFILLED, RequestStatus.FINISHED_STOPPED


@dataclass
class SimResult:
    """One simulated run (seconds from 0).

    ``steps``: rows as a real run's (empty unless ``collect_steps``); ``transfers``: per KV
    transfer ``request_id, num_bytes, put_s, get_s, transport``; ``batches``: per step ``(worker,
    [(request_id, num_new_tokens), ...])`` with ``collect_batches``."""

    records: list[RequestRecord]
    steps: list[dict] = field(default_factory=list)
    transfers: list[dict] = field(default_factory=list)
    duration_s: float = 0.0
    batches: list[tuple[str, list[tuple[str, int]]]] = field(default_factory=list)
    num_fast_forwarded_steps: int = 0


def num_kv_blocks(config: EngineConfig, kv_bytes_per_token: int,
                  budget_bytes: int | None = None) -> int | None:
    """KV blocks an engine of ``config`` gets (``engine.config.kv_num_blocks_for``) on
    ``budget_bytes`` (None: the CPU rule); None without a KV geometry."""
    if kv_bytes_per_token <= 0 or not hasattr(config, "block_size"):
        return None
    if budget_bytes is None:
        budget_bytes = kv_budget_bytes_for(config, "cpu")
    return kv_num_blocks_for(config, kv_bytes_per_token, budget_bytes)


@dataclass(frozen=True)
class InstanceModel:
    """What the simulator knows of one role's instances: ``step_s`` as ``Simulator``'s, the KV
    bytes a token takes on the instance's fullest device (its KV heads and layers) and that
    device's KV budget (bytes; None: the CPU rule)."""

    step_s: Callable[[int, int, int, int], float]
    kv_bytes_per_token: int
    kv_budget_bytes: int | None = None


class _Instance:

    __slots__ = ("name", "role", "scheduler", "busy", "step_s")

    def __init__(self, name: str, role: str, config: EngineConfig,
                 blocks: int | None = None, step_s=None) -> None:
        self.name, self.role, self.step_s = name, role, step_s
        self.scheduler = Scheduler(config, ()) if blocks is None else Scheduler(config, (), blocks)
        self.busy = False


class _Flight:
    """One request in the simulation; ``finalize`` writes its record's token times and ids."""

    __slots__ = ("request", "record", "first", "decode", "remote", "put_s", "times",
                 "kv_token_start")

    def __init__(self, request: Request, record: RequestRecord) -> None:
        self.request, self.record = request, record
        self.first = self.decode = None
        self.remote = False
        self.kv_token_start = 0  # the KV sent starts here (Assignment.kv_token_start)
        self.put_s = 0.0
        self.times = record.token_worker_times_s

    def finalize(self) -> None:
        """Tokens leave when produced (a prefilled request's first before its put)."""
        record = self.record
        record.token_times_s = list(self.times)
        record.output_token_ids = [FAKE_TOKEN] * len(self.times)


def worker_names(placement: str) -> list[tuple[str, str]]:
    """``(name, role)`` per worker, as ``deployment.placement.worker_layout`` names them."""
    return [(i.name, i.role) for i in Placement.parse(placement).instances]


class Simulator:
    """Simulates ``placement`` (``colocated:N``, ``colocated-nochunk:N``, ``disagg:xPyD``,
    ``conditional:xPyD``) on a simulated clock.

    ``step_s``: step seconds of ``(prefill_tokens, prefill_attention, batch_size, sum_context)``
    (``DeviceProfile.step_time()``); ``transfer``: the KV transfer model, required with prefill
    workers; ``fast_forward`` False runs every step through the Scheduler (same records);
    ``speed_trace``: ``(worker, step start s) -> factor`` on modelled step times
    (``drift.SpeedTrace``); ``kv_budget_bytes``: each instance's KV budget (bytes; None: the CPU
    rule). ``instance_models``: per role (``colocated``, ``prefill``, ``decode``), its
    ``InstanceModel``, in place of ``step_s``, ``kv_bytes_per_token`` (the KV per device) and
    ``kv_budget_bytes`` (a placement with TP/PP sizes needs them); ``kv_bytes_per_token`` stays
    what a transfer moves. ``transfer_share``: the share of a request's KV bytes one decode rank
    receives (its KV heads, ``engine.kv_heads.bytes_per_decode_rank``): the ranks fetch in
    parallel, so a transfer lasts ``transfer.seconds(share * bytes)``.

    Raises:
        ValueError: a bad placement or policy, a placement with TP/PP sizes without
            ``instance_models`` for its roles, or a disaggregated placement without
            ``transfer``."""

    def __init__(self, placement: str, engine: EngineConfig,
                 step_s: Callable[[int, int, int, int], float], transfer: TransferModel | None = None,
                 kv_bytes_per_token: int = 0, policy: str = "least_loaded",
                 conditional: ConditionalConfig | None = None, transport: str = "simulated",
                 fast_forward: bool = True,
                 speed_trace: Callable[[str, float], float] | None = None,
                 kv_budget_bytes: int | None = None,
                 instance_models: dict[str, InstanceModel] | None = None,
                 transfer_share: float = 1.0) -> None:
        parsed = Placement.parse(placement)
        models = dict(instance_models or {})
        missing = [r for r in parsed.roles if r not in models]
        if parsed.is_parallel and missing:  # a TP/PP instance's step time needs its own profile
            raise ValueError(f"placement {placement} spans several devices per instance: the "
                             f"simulator needs the {', '.join(missing)} instances' own step "
                             "model (a profile of their TP/PP size)")
        for role in missing:
            models[role] = InstanceModel(step_s, kv_bytes_per_token, kv_budget_bytes)
        self.instance_models = models
        if not 0 < transfer_share <= 1:
            raise ValueError(f"transfer_share must be in (0, 1], got {transfer_share!r}")
        self.transfer_share = transfer_share
        self.kind = parsed.kind
        if self.kind != "colocated" and transfer is None:
            raise ValueError(f"placement {placement} moves KV: a transfer model is needed")
        pick(policy, ["w"], {}, 0)  # refuses an unknown policy now (Assigner does it per run)
        self.placement = placement
        self.engine = placement_engine_overrides(placement, engine)
        self.step_s = step_s
        self.transfer = transfer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.policy = policy
        self.conditional = (conditional or ConditionalConfig()) if self.kind == "conditional" else None
        self.transport = transport
        self.fast_forward = fast_forward
        self.speed_trace = speed_trace
        self.kv_budget_bytes = kv_budget_bytes

    def run(self, workload: Sequence[tuple[Request, float]], collect_steps: bool = False,
            collect_batches: bool = False) -> SimResult:
        """Serve ``workload`` (requests with arrival offsets, s) to the end; a ``SimResult`` with
        one record per request (followers too) in arrival order. A closed-loop workload (with
        ``follow(record, end_s, output_token_ids)``, as ``Router.run`` takes) is told of each
        finish and returns its followers; it runs without fast-forward.

        Raises:
            ValueError: two requests share a request_id."""
        ids = [r.request_id for r, _ in workload]
        if len(set(ids)) != len(ids):
            raise ValueError("request_id must be unique within a workload")
        engine = self.engine
        role_blocks = {role: num_kv_blocks(engine, model.kv_bytes_per_token, model.kv_budget_bytes)
                       for role, model in self.instance_models.items()}
        known = [b for b in role_blocks.values() if b is not None]
        blocks = min(known) if known else None  # a request must fit each instance it visits
        self._limits = Limits(engine.max_model_len, None,
                              engine.max_kv_blocks if blocks is None else blocks,
                              engine.block_size, "an instance's",
                              None if engine.enable_chunked_prefill else engine.max_num_batched_tokens)
        self._instances = {name: _Instance(name, role, self.engine, role_blocks[role],
                                           self.instance_models[role].step_s)
                           for name, role in worker_names(self.placement)}
        self._assigner = Assigner(worker_names(self.placement), self.kind, self.policy,
                                  self.engine.block_size, self.conditional)
        # the router's prefix index sees the prompts' block hashes (as Router._assign sends)
        self._hash_prompts = self._assigner.uses_prefixes and engine.enable_prefix_caching
        self._follow = getattr(workload, "follow", None)
        self._skip_ahead = self.fast_forward and self._follow is None
        self._flights: dict[str, _Flight] = {}
        self._heap: list = []
        self._seq = itertools.count()
        self._steps: list[dict] | None = [] if collect_steps else None
        self._batches: list | None = [] if collect_batches else None
        self._transfers: list[dict] = []
        self._num_fast_forwarded = 0
        arrivals = self._arrivals = sorted(workload, key=lambda item: item[1])  # stable
        # Arrivals wait in a sorted list beside the heap, so the horizon scans few events.
        self._arrival_s = [float(offset) for _, offset in arrivals] + [math.inf]
        self._next_arrival = 0  # index of the next arrival not yet run
        end_s = 0.0
        handlers = (self._step_end, self._start, self._hand_over, self._fetched)
        heap, pop, arrival_s = self._heap, heapq.heappop, self._arrival_s
        gc_was_enabled = gc.isenabled()
        gc.disable()  # millions of short-lived objects, no cycles: collection only costs time
        try:
            while True:
                t_arrival = arrival_s[self._next_arrival]
                if heap and heap[0][0] < t_arrival:
                    t, _, _, kind, payload = pop(heap)
                    end_s = t
                    handlers[kind](t, payload)
                elif t_arrival < math.inf:
                    request = arrivals[self._next_arrival][0]
                    self._next_arrival += 1
                    end_s = t_arrival
                    self._arrive(t_arrival, request)
                else:
                    break
        finally:
            if gc_was_enabled:
                gc.enable()
        for flight in self._flights.values():
            flight.finalize()
            if FINISHED not in flight.record.timeline:  # nothing left to run it: it never finishes
                flight.record.error = "simulation ended with the request unfinished (no KV room)"
                flight.record.finish_reason = "error"
                flight.record.timeline[FINISHED] = end_s
        records = [self._flights[r.request_id].record for r, _ in arrivals]
        if self._steps:
            self._steps.sort(key=lambda step: step["start_s"])  # stable: per worker in order
        return SimResult(records, self._steps or [], self._transfers, end_s, self._batches or [],
                         self._num_fast_forwarded)

    def _push(self, t: float, kind: int, payload, order: int = _EARLY) -> None:
        heapq.heappush(self._heap, (t, order, next(self._seq), kind, payload))

    def _arrive(self, t: float, request: Request) -> None:
        record = RequestRecord(request_id=request.request_id, placement=self.placement,
                               num_prompt_tokens=request.num_prompt_tokens)
        record.timeline[ARRIVED] = record.timeline[DISPATCHED] = t
        flight = _Flight(request, record)
        self._flights[request.request_id] = flight
        error = self._refusal(request)
        if error is not None:
            record.error, record.finish_reason = error, "error"
            record.timeline[FINISHED] = t
            return
        assignment = self._assigner.assign(
            request.request_id, request.num_prompt_tokens, request.sampling.max_tokens,
            prompt_block_hashes(request, self.engine.block_size) if self._hash_prompts else ())
        first, decode = flight.first, flight.decode = assignment.first, assignment.decode
        flight.remote = assignment.remote
        flight.kv_token_start = assignment.kv_token_start
        record.prefill_worker, record.decode_worker = first, decode
        record.prefill_path = "remote" if flight.remote else "local"
        record.timeline[PREFILL_QUEUED] = t
        instance = self._instances[first]
        instance.scheduler.add(RequestState(request, prefill_only=flight.remote))
        self._wake(instance, t)

    def _refusal(self, request: Request) -> str | None:
        """What the engine would refuse the request for (as ``Engine.validate``); None: it runs."""
        try:
            self._limits.check(request.num_prompt_tokens, request.sampling.max_tokens,
                               prefill_only=False, subject=f"request {request.request_id}: ")
        except LimitError as err:
            return str(err)
        return None

    def _finish(self, flight: _Flight, t: float) -> None:
        flight.record.timeline[FINISHED] = t
        flight.record.finish_reason = "length"
        self._assigner.release(flight.request.request_id)
        if self._follow is not None:  # a closed loop: the next turn joins the arrivals
            for request, offset in self._follow(flight.record, t,
                                                [FAKE_TOKEN] * len(flight.times)):
                i = bisect.bisect_right(self._arrival_s, float(offset), lo=self._next_arrival)
                self._arrival_s.insert(i, float(offset))
                self._arrivals.insert(i, (request, offset))

    def _hand_over(self, t: float, flight: _Flight) -> None:
        """The prefilled event reached the router: discharge prefill, admit on decode."""
        self._assigner.prefilled(flight.request.request_id, flight.first)
        request = flight.request
        state = RequestState(request)  # as Engine.add_remote builds it
        state.token_ids.append(FAKE_TOKEN)
        state.num_computed_tokens = request.num_prompt_tokens
        state.first_output_index = 1
        state.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        state.kv_token_start = flight.kv_token_start
        instance = self._instances[flight.decode]
        instance.scheduler.add(state)
        self._wake(instance, t)

    def _wake(self, instance: _Instance, t: float) -> None:
        """An idle instance steps at ``t``, once the other events of ``t`` have run."""
        if not instance.busy:
            self._start_at(instance, t)

    def _start_at(self, instance: _Instance, t: float) -> None:
        heap = self._heap
        if (heap and heap[0][0] <= t) or self._arrival_s[self._next_arrival] <= t:
            instance.busy = True
            self._push(t, _START, instance, _LATE)
        else:
            self._start_step(instance, t)

    def _start(self, t: float, instance: _Instance) -> None:
        instance.busy = False
        self._start_step(instance, t)

    def _start_step(self, instance: _Instance, t: float) -> None:
        scheduler = instance.scheduler
        if not scheduler.has_work():
            return
        batch = scheduler.schedule()
        features = batch.step_features()  # the emulated runner times its steps from these too
        n_pre, q_pre = features.prefill_tokens, features.prefill_attention
        num_decode, sum_ctx = features.batch_size, features.sum_context
        flights, counts, completing = self._flights, batch.num_new_tokens, []
        for i, state in enumerate(batch.requests):
            if state.num_computed_tokens + counts[i] == len(state.token_ids):  # batch.completes(i): a token is sampled
                completing.append(i)  # (counters stay put until the step's end)
            if state.first_scheduled_time_s is None:
                state.first_scheduled_time_s = t
                timeline = flights[state.request.request_id].record.timeline
                timeline[PREFILL_STARTED if state.first_output_index == 0 else DECODE_ADMITTED] = t
        duration = instance.step_s(n_pre, q_pre, num_decode, sum_ctx) if batch.requests else 0.0
        if self.speed_trace is not None and duration:
            duration *= self.speed_trace(instance.name, t)
        fetch_start = t + duration
        for state in batch.kv_reserved:  # the worker starts the fetch once this step ended
            flight = flights[state.request.request_id]
            get_s = self._transfer_s(flight) * (1.0 - self.transfer.put_share)
            self._push(fetch_start + get_s, _FETCHED, (instance, state, get_s))
        if not batch.requests:
            return  # nothing could run (no capacity): the next event wakes it
        instance.busy = True
        self._record_step(instance, batch, t, duration, n_pre, num_decode)
        end_s = t + duration
        if (self._skip_ahead and n_pre == 0 and not batch.kv_reserved
                and not batch.newly_admitted and not batch.preempted):
            end_s = self._fast_forward(instance, batch, end_s, sum_ctx)
        self._push(end_s, _STEP_END, (instance, batch, dict.fromkeys(completing, FAKE_TOKEN)))

    def _record_step(self, instance: _Instance, batch: ScheduledBatch, t: float,
                     duration: float, n_pre: int, num_decode: int, steps_ahead: int = 0) -> None:
        """A step record like ``StepRecord.to_row``; ``steps_ahead``: a fast-forwarded step."""
        if self._steps is not None:
            self._steps.append(StepRecord(t, duration, len(batch.requests), n_pre, num_decode,
                                          batch.entries(steps_ahead)).to_row()
                               | {"worker": instance.name})
        if self._batches is not None:
            self._batches.append((instance.name, [(s.request_id, n) for s, n in
                                                  zip(batch.requests, batch.num_new_tokens)]))

    def _fast_forward(self, instance: _Instance, batch: ScheduledBatch, end_s: float,
                      sum_ctx: int) -> float:
        """Complete the pure-decode ``batch`` (ending at ``end_s``) and its unchanged repeats that
        end before the horizon and before the first request stops. Returns the end of the step
        left to run as usual; durations summed in step order, equal to step-by-step's bitwise."""
        horizon_s = self._horizon(instance)
        if end_s >= horizon_s:
            return end_s
        requests = batch.requests
        eos = instance.scheduler.eos_token_ids
        steps_left = math.inf  # steps until the first request stops, its stopping step included
        for state in requests:
            params = state.request.sampling
            if (state.prefill_only or FAKE_TOKEN in params.stop_token_ids
                    or (not params.ignore_eos and FAKE_TOKEN in eos)):
                return end_s  # it stops on this token: leave it to Scheduler.update
            left = params.max_tokens - (len(state.token_ids) - state.num_prompt_tokens)
            if left < steps_left:
                steps_left = left
        scheduler = instance.scheduler
        if steps_left != math.inf:  # blocks on demand: never past a step that would preempt
            steps_left = 1 + scheduler.decode_steps_available(requests, int(steps_left) - 1)
        ends = []  # end of each step completed here: its tokens leave then
        num_decode, step_s, add_end = len(requests), instance.step_s, ends.append
        record = self._steps is not None or self._batches is not None
        trace, name = self.speed_trace, instance.name
        while len(ends) < steps_left - 1 and end_s < horizon_s:
            add_end(end_s)  # this step completes; the same batch starts at its end
            sum_ctx += num_decode
            duration = step_s(0, 0, num_decode, sum_ctx)
            if trace is not None:  # the factor at this step's own start, as step by step
                duration *= trace(name, end_s)
            if record:
                self._record_step(instance, batch, end_s, duration, 0, num_decode, len(ends))
            end_s = end_s + duration
        if ends:
            self._num_fast_forwarded += len(ends)
            fakes = [FAKE_TOKEN] * len(ends)
            flights = self._flights
            for state in requests:  # what Scheduler.update does to each, len(ends) times
                state.num_computed_tokens += len(ends)
                state.token_ids.extend(fakes)
                flight = flights[state.request.request_id]
                if not flight.times:
                    flight.record.timeline[PREFILL_FINISHED] = ends[0]
                flight.times.extend(ends)
            scheduler.catch_up_decodes(requests, len(ends))
        return end_s

    def _horizon(self, instance: _Instance) -> float:
        """The earliest time an event may change ``instance``'s Scheduler: a hand-over or KV
        fetch queued for it, a prefill worker's step or put end, and the next arrival unless it
        cannot reach it first (disaggregated, while every prefill worker is busy)."""
        horizon_s = math.inf
        instances = self._instances.values()
        if self.kind != "disagg" or any(i.role == "prefill" and not i.busy for i in instances):
            horizon_s = self._arrival_s[self._next_arrival]
        for t, _, _, kind, payload in self._heap:
            if t >= horizon_s:
                continue
            if kind == _STEP_END:
                touches = payload[0].role == "prefill" or payload[0] is instance
            elif kind == _START:
                touches = payload.role == "prefill" or payload is instance
            elif kind == _HANDOVER:
                touches = payload.decode == instance.name
            else:  # _FETCHED
                touches = payload[0] is instance
            if touches:
                horizon_s = t
        return horizon_s

    def _transfer_s(self, flight: _Flight) -> float:
        """The whole transfer's seconds: the KV of prompt tokens from ``kv_token_start`` on, one
        decode rank's share of it on each rank's link at once."""
        return self.transfer.seconds(self._kv_bytes(flight) * self.transfer_share)

    def _kv_bytes(self, flight: _Flight) -> int:
        return self.kv_bytes_per_token * (flight.request.num_prompt_tokens - flight.kv_token_start)

    def _step_end(self, t: float, payload: tuple[_Instance, ScheduledBatch, dict[int, int]]) -> None:
        instance, batch, sampled = payload
        produced = instance.scheduler.update(batch, sampled)
        busy_until = t
        flights = self._flights
        for state in produced:
            flight = flights[state.request.request_id]
            times = flight.times
            if not times:
                flight.record.timeline[PREFILL_FINISHED] = t
                flight.record.num_cached_prompt_tokens = state.num_cached_tokens or 0
            times.append(t)
            status = state.status
            if status == _PREFILLED or status >= _FINISHED_STOPPED:  # its last token here
                flight.record.num_preemptions += state.num_preemptions
            if status == _PREFILLED:  # its first token is out (at t); the KV put follows
                instance.scheduler.release(state)
                put_s = self._transfer_s(flight) * self.transfer.put_share
                busy_until += put_s
                flight.put_s = put_s
                record = flight.record
                record.timeline[KV_PUT] = busy_until
                record.kv_bytes = self._kv_bytes(flight)
                record.kv_bytes_saved = self.kv_bytes_per_token * flight.kv_token_start
                record.kv_put_s = put_s
                self._push(busy_until, _HANDOVER, flight)
                continue
            if status >= _FINISHED_STOPPED:  # status.is_finished
                self._finish(flight, t)
        if busy_until > t:  # the puts hold the loop
            instance.busy = True
            self._push(busy_until, _START, instance, _LATE)
        else:
            instance.busy = False
            self._start_at(instance, t)

    def _fetched(self, t: float, payload) -> None:
        instance, state, get_s = payload
        flight = self._flights[state.request.request_id]
        record = flight.record
        record.timeline[KV_GOT] = t
        record.kv_get_s = get_s
        record.kv_transfer_s = flight.put_s + get_s
        self._transfers.append({"request_id": state.request.request_id,
                                "num_bytes": record.kv_bytes, "put_s": flight.put_s,
                                "get_s": get_s, "transport": self.transport})
        instance.scheduler.kv_arrived(state)
        self._assigner.kv_landed(state.request.request_id, instance.name)  # the router hears kv_got
        self._wake(instance, t)
