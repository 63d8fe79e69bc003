"""Run an Engine on a background thread: commands in, ``WorkerEvent``s out.

The loop thread is the only one that touches the engine. Each turn it runs the queued
commands, then, if the engine has work, one step: ``engine.start_step()``, whose ``StepOutput``
becomes events (failed requests become errors, the rest goes to ``on_step``: subclasses hand KV
over or fetch it, with ``after_step`` for work that must follow the step's end), then
``engine.finish_step`` (on an emulated device the step's hold, during which arriving commands
are applied); its events leave once the next step has begun (at once when none follows), never
before its end; with no work it sleeps until the next command. An emulated step's hold is left
just before its end to prepare the next step, which begins then; its ``after_step`` work (a
prefill worker's put, a decode worker's fetch) runs after that launch, during the new step.

Over the message plane (``open_channel(endpoint)``): commands come in through the worker's port
in the order sent, and each turn with news leaves as one message (a tuple of its events). A
command the port cancelled (an ``abort`` overtook it) or one that raised goes to
``on_cancelled``, which frees what it carries; one that raised is also an ``error`` event. A
loop that dies sends its last words (a ``died`` event naming the cause) and closes its port.

Events leave only through the channel (until it is open they wait); after the loop died
``call`` raises ``EngineLoopDied``. A worker (prefill, decode, colocated) is this loop plus
what it does with tokens, a plain class.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import torch

from channel.contract import ABORT, ADMIT, RELEASE, SUBMIT, Command, Endpoint, Port, Taken
from channel.ports import open_port
from engine.clock import freeze_heap, precise_timers
from engine.config import EngineConfig, ModelConfig
from engine.device import bind_device, gpu_identity, use_on_this_thread
from engine.engine import Engine, StepOutput
from engine.events import DIED, ERROR, TOKEN, TokenBatch, WorkerEvent
from engine.metrics import PREFILL_FINISHED, PREFILL_STARTED
from engine.emulated import Emulation
from engine.model import load_geometry, load_model
from engine.parallel import start_instance
from engine.request import Request, TokenOutput
from engine.scheduler import ScheduledBatch


CHANNEL_COMMANDS = (SUBMIT, ADMIT, ABORT, RELEASE)  # what a port may ask of a worker

# The lead on an emulated step's end: the recent launches' mean plus a margin. A command
# arriving within it joins the step after, so it is short; a longer launch starts late
LEAD_MARGIN_S = 20e-6
LEAD_MAX_S = 1e-3
LEAD_GAIN = 0.1  # the mean's weight of the latest launch


class EngineLoopDied(RuntimeError):
    """The worker's engine loop stopped on an exception; the worker serves nothing more."""


class EngineLoop:
    """An engine on a thread. A colocated instance is exactly this.

    Args:
        name: worker name used in events and records (e.g. ``colocated-0``).
        model_config, engine_config: what to load and how to schedule.
        device: ``cpu:i``, ``cpu:a-b`` or ``cuda:i``; the process pins itself to it.
        inside_ray: the process is a Ray actor (changes how a CUDA device is named).
        bind: pin the process to ``device`` (off when several workers share one process:
            a CUDA worker still runs on its own GPU, ``engine.device.bind_device``).
        step_delay_s: sleep this long after every step: a straggler, for failure tests.
        emulation: an emulated device (``engine.emulated``; device ``emu:i``): the model
            is ``model_config.model``'s geometry in the profile's dtype, no weights.
        rank_devices: the devices of ranks 1.. of a tensor-parallel instance (TP = 1 +
            their count; ``engine.parallel.start_instance``: each rank a process bound to its
            device, this one rank 0 on ``device``; with ``bind`` off they are not pinned);
            () is a one-device instance. Inside Ray, CUDA rank ``r`` is ``cuda:r``.

    Raises:
        ValueError: ``rank_devices`` with an emulated device, or a TP the model's heads do
            not allow (``engine.parallel.shard_model``).
    """

    role = "colocated"

    def __init__(self, name: str, model_config: ModelConfig, engine_config: EngineConfig,
                 device: str = "cpu:0", inside_ray: bool = False, bind: bool = True,
                 step_delay_s: float = 0.0, emulation: Emulation | None = None,
                 rank_devices: tuple[str, ...] = ()) -> None:
        self.name = name
        self.rank_devices = tuple(rank_devices)
        self.step_delay_s = step_delay_s
        self.device = device
        self.torch_device = bind_device(device, inside_ray, pin=bind)
        if self.rank_devices and inside_ray and self.torch_device.startswith("cuda"):
            self.rank_devices = tuple(f"cuda:{r}" for r in range(1, 1 + len(self.rank_devices)))
        engine_config = dataclasses.replace(engine_config, device=self.torch_device)
        if self.rank_devices:
            engine_config = dataclasses.replace(engine_config, tp=1 + len(self.rank_devices))
        if emulation is None:
            loaded = load_model(model_config, self.torch_device)
        else:  # the emulated GPU's KV dtype is the profile's
            loaded = load_geometry(dataclasses.replace(model_config,
                                                       dtype=emulation.device.dtype))
        self._instance = None  # a TP instance's other ranks (engine.parallel)
        if self.rank_devices:
            if emulation is not None:
                raise ValueError(f"worker {name}: an emulated instance spans one device, "
                                 f"got rank devices {self.rank_devices}")
            tp = 1 + len(self.rank_devices)
            self._instance = start_instance(
                loaded, model_config, engine_config, tp,
                devices=(device, *self.rank_devices) if bind else None,
                on_layer_done=self.layer_listener())
            self.engine = self._instance.engine
        else:
            self.engine = Engine(loaded, engine_config, on_layer_done=self.layer_listener(),
                                 emulation=emulation)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._events: list[WorkerEvent | TokenBatch] = []
        self._held: list | None = None  # the loop's events while its step runs, else None
        self._after_step: list[Callable[[], None]] = []  # ``after_step``'s, for this step
        self._ending = False  # a step left early: its held events and after_step work wait
        self._left_at = 0.0  # perf_counter() when the loop left that step's hold early
        self._prep_s = 0.0  # a step's launch after the loop left the last one's hold (mean)
        self._events_ready = threading.Condition()
        self._stopped = threading.Event()
        self._died: str | None = None  # why the loop stopped on an exception
        self._port: Port | None = None  # the message plane, once open_channel ran
        freeze_heap()  # the model and the imports: no full collection stops the loop on them
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._thread.start()

    # ---- called from other threads (or as Ray actor methods) -------------------------
    def info(self) -> dict:
        """What the router needs to validate requests and check compatibility, plus the
        process's torch thread counts, the physical GPU used (``gpu``: index as this process
        sees it, name, UUID, CUDA_VISIBLE_DEVICES; None on CPU) and its kernels
        (``kernels``: the backend's ``describe()``, engine/ops.py: CPU model and ISA, the
        GEMM chosen per shape class and row range, the decode-attention layout), recorded
        with every result. ``device`` is the device asked for, ``torch_device`` the one used."""
        engine = self.engine
        return {"name": self.name, "role": self.role, "device": self.device,
                "tp": engine.config.tp, "pp": engine.config.pp,
                "rank_devices": list(self.rank_devices),
                "torch_device": self.torch_device, "gpu": gpu_identity(self.torch_device),
                "torch_num_threads": torch.get_num_threads(),
                "torch_num_interop_threads": torch.get_num_interop_threads(),
                "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                "kv_spec": engine.kv_spec.to_dict(),
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "enable_chunked_prefill": engine.config.enable_chunked_prefill,
                "kv_capacity_tokens": engine.kv_capacity_tokens,
                "kv_block_size": engine.config.block_size,
                "kv_num_blocks": engine.kv_store.num_blocks,
                "enable_prefix_caching": engine.config.enable_prefix_caching,
                "kv_reservation": engine.config.kv_reservation,
                "kernels": engine.runner.ops.describe()}

    def kv_cache_stats(self) -> dict:
        """The prefix cache's lookups and hits in tokens (``engine.kv_blocks.
        PrefixCacheStats`` fields), preemptions, and blocks used / cached / in all."""
        def read() -> dict:
            scheduler = self.engine.scheduler
            blocks = scheduler.capacity
            return {**dataclasses.asdict(scheduler.prefix_cache_stats),
                    "num_preemptions": scheduler.num_preemptions,
                    "num_used_blocks": blocks.num_used_blocks,
                    "num_cached_blocks": blocks.num_cached_blocks,
                    "num_blocks": blocks.num_blocks}
        return self.call(read)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's unheld blocks (``BlockAllocator.reset_cache``), on the
        loop thread, so the next run starts cold; returns how many."""
        return self.call(self.engine.scheduler.capacity.reset_cache)

    def submit(self, request: Request) -> None:
        """Queue a request; an invalid one comes back as an ``error`` event."""
        self._queue(lambda: self._add(request))

    def abort(self, request_id: str) -> None:
        self._queue(lambda: self.engine.abort(request_id))

    def open_channel(self, endpoint: Endpoint) -> None:
        """Take commands from the channel port of ``endpoint`` and send each loop turn's
        events through it from now on (module docstring); a port opened before is closed.

        Raises:
            KeyError: a local endpoint whose hub is not in this process.
        """
        port = open_port(endpoint)
        old, self._port = self._port, port
        if old is not None:
            old.close()
        self._wake_loop()  # a loop waiting on its own queue waits on the port from now on
        if self._died is not None:  # a dead loop says so once, then sends no heartbeat
            self._last_words()

    def _queue(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the loop thread at its next turn (any thread; from another
        thread it wakes a loop waiting on its port)."""
        self._commands.put(command)
        if threading.current_thread() is not self._thread:
            port = self._port
            if port is not None:
                port.wake()

    def _wake_loop(self) -> None:
        self._queue(_nothing)

    def _check_alive(self) -> None:
        if self._died is not None:
            raise EngineLoopDied(f"{self.role} worker {self.name}: engine loop died: {self._died}")

    def _take_events(self, request_id: str) -> list[WorkerEvent]:
        """Remove the not yet collected events of ``request_id`` (an abort makes them moot)."""
        def mine(e) -> bool:  # (a TokenBatch has no request_id)
            return getattr(e, "request_id", None) == request_id

        with self._events_ready:
            taken = [e for e in self._events if mine(e)]
            self._events = [e for e in self._events if not mine(e)]
        if self._held and threading.current_thread() is self._thread:  # a step running
            taken += [e for e in self._held if mine(e)]
            self._held[:] = [e for e in self._held if not mine(e)]
        return taken

    def status(self) -> dict:
        """Leak check: is the engine empty (no queue, no KV held)?"""
        return {"name": self.name, "engine_empty": self.call(self.engine.is_empty)}

    def step_records(self) -> list[dict]:
        """Every step this worker ran, one flat row each (``StepRecord.to_row``: its batch as
        JSON text) with ``worker``: this worker's name."""
        return [{"worker": self.name, **r.to_row()} for r in list(self.engine.step_records)]

    def call(self, fn: Callable, timeout_s: float = 30.0):
        """Run ``fn()`` on the loop thread and return its result (for consistent reads).

        Raises:
            EngineLoopDied: the loop is dead, or dies before it runs ``fn`` (checked every
                0.1 s, so a caller never waits out ``timeout_s`` on a dead loop).
            Exception: whatever ``fn`` raised, re-raised here.
            queue.Empty: no answer within ``timeout_s`` seconds.
        """
        self._check_alive()
        done: queue.Queue = queue.Queue(maxsize=1)

        def run() -> None:
            try:
                done.put((True, fn()))
            except Exception as err:  # the caller gets it; the loop carries on
                done.put((False, err))

        self._queue(run)
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                ok, value = done.get(timeout=max(0.0, min(0.1, deadline_s - time.monotonic())))
                break
            except queue.Empty:
                self._check_alive()
                if time.monotonic() >= deadline_s:
                    raise
        if not ok:
            raise value
        return value

    def shutdown(self) -> None:
        self._stopped.set()
        self._queue(_nothing)
        self._thread.join(timeout=10)
        if self._instance is not None:  # after the loop: no collective of rank 0 in flight
            self._instance.close()
        self._close_port()

    def _close_port(self) -> None:
        port = self._port
        if port is not None:
            port.close()

    def _last_words(self) -> None:
        """A dead loop's port: the events its last steps left (a ``prefilled`` one carries KV
        handles only the router frees), the ``died`` event (its cause), then silence."""
        port = self._port
        if port is not None:
            self._send_events()
            port.send((WorkerEvent(DIED, "", self.name, time.time(), error=(
                f"{self.role} worker {self.name}: engine loop died: {self._died}")),))
            port.close()

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            use_on_this_thread(self.torch_device)  # the CUDA current device is per thread
            precise_timers()  # an emulated step's nap and a command's wait end on time
            self._loop()
        except BaseException as err:  # nothing may escape silently: the worker is dead now
            with self._events_ready:
                self._died = f"{type(err).__name__}: {err}"
                self._events_ready.notify_all()
            if self._ending:  # its step ran: its events still go, at its end
                held, self._held = self._held or [], None
                self.engine.wait_step_end()
                self._emit_all(held)
            self._last_words()  # then its heartbeat stops: the hub sees the death either way

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._check_ranks()
            ending = self._ending
            self._drain_commands(block=not ending and not self.engine.has_unfinished(),
                                 timeout_s=self.idle_wait_s())
            self.on_tick()
            if not self.engine.has_unfinished():
                if ending:
                    self._end_step(send=True)
                else:
                    self._send_events()
                continue
            launched = self.engine.launch_step(on_launch=self._send_events)
            if ending:  # this step begins as the one before ends: that one's news now (no
                self._prepared(time.perf_counter() - self._left_at)  # command meanwhile:
                self._end_step(send=True, drain=False)  # it might touch the launched batch)
            output = self.engine.complete_step(launched)
            self._send_events()  # when no step began
            self._held = []
            self._step_news(output)
            self._drain_commands(block=False)
            # the device's step (an emulated hold) runs out, commands applying as they come;
            # while on_step runs during it, all but the next step's host work
            lead_s = min(LEAD_MAX_S, LEAD_MARGIN_S + self._prep_s)
            output = self.engine.finish_step(output, self._drain_for, lead_s)
            if output.failed:  # a failed forward may be a rank's death: the instance's
                self._check_ranks()
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            self._ending = True
            if self.engine.device_busy:  # it ends once the next step is prepared
                self._left_at = time.perf_counter()
                continue
            self._end_step(send=output.record is None)
            if output.record is None and not ending:  # no forward could run (at most
                # reservations): wait a bit, unless the step that just ended freed room
                self._drain_commands(block=True, timeout_s=0.01)
        if self._ending:
            self._end_step(send=False)
        self._send_events()  # stopped: the last step's events, held for a step that never comes

    def _end_step(self, send: bool, drain: bool = True) -> None:
        """Wait for the ending step's end; its held events and ``after_step`` work go, then
        (``drain``) commands; its events leave now if ``send`` or no work is left."""
        self._ending = False
        self.engine.wait_step_end(self._drain_for if drain else None)
        held, self._held = self._held, None
        self._emit_all(held)
        after, self._after_step = self._after_step, []
        for work in after:
            work()
        # commands that came during the step first: an abort still frees the KV of a
        # prefilled event that has not left (nobody else would)
        if drain:
            self._drain_commands(block=False)
        if send or not self.engine.has_unfinished():
            self._send_events()

    def _prepared(self, took_s: float) -> None:
        """Launching a step took ``took_s`` after the loop left the last one's hold."""
        self._prep_s += LEAD_GAIN * (took_s - self._prep_s)

    def _check_ranks(self) -> None:
        """A TP instance with a dead rank is a dead worker: raise (the loop dies)."""
        dead = self._instance and self._instance.dead_rank()
        if dead:
            raise RuntimeError(f"{self.role} worker {self.name}: {dead}: the TP "
                               f"{self.engine.config.tp} instance cannot run without it")

    def _step_news(self, output: StepOutput) -> None:
        for request_id, error in output.failed:
            self.emit(WorkerEvent(ERROR, request_id, self.name, time.time(), error=error))
        self.on_step(output)
        self.on_tick()

    def after_step(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the step in flight has ended on its device (an emulated step's
        hold run out); at once when none is. Call it on the loop thread (``on_step``, a
        command). For what a real device's step lets start only after it: there the loop is
        back from ``start_step`` only once the forward ran (``engine.runner``), so an emulated
        device must not start it sooner."""
        if self._held is None:
            work()
        else:
            self._after_step.append(work)

    def _drain_for(self, timeout_s: float) -> None:
        self._drain_commands(block=True, timeout_s=timeout_s)

    def _send_events(self) -> None:
        """Over the channel: this turn's events as one message (none: nothing is sent)."""
        port = self._port
        if port is None or not self._events:
            return
        with self._events_ready:
            events, self._events = self._events, []
        port.send(tuple(events))

    def _apply(self, taken: Taken) -> None:
        """Apply the commands that reached the port (each queues its work behind the
        commands already queued); hand the cancelled ones to ``on_cancelled``."""
        for command in taken.cancelled:
            try:
                self.on_cancelled(command)
            except Exception as err:  # frees what it can; never kills the loop
                self.emit(WorkerEvent(ERROR, command.request_id or "", self.name, time.time(),
                                      error=f"cancelling {command.kind}: {err!r}"))
        for command in taken.commands:
            try:
                if command.kind not in CHANNEL_COMMANDS:
                    raise ValueError(f"unknown command {command.kind!r} (have: "
                                     f"{', '.join(CHANNEL_COMMANDS)})")
                getattr(self, command.kind)(*command.args)
            except Exception as err:  # its request fails, the worker goes on
                try:
                    self.on_cancelled(command)  # never applied: free what it carries
                except Exception:
                    pass
                self.emit(WorkerEvent(ERROR, command.request_id or "", self.name, time.time(),
                                      error=f"{command.kind} failed: {type(err).__name__}: {err}"))

    def on_cancelled(self, command: Command) -> None:
        """A command an ``abort`` cancelled before it was applied (channel contract): free
        what it carries. A ``submit`` carries nothing."""

    def _drain_commands(self, block: bool, timeout_s: float = 0.1) -> None:
        """Run what came: the port's commands, then the loop's own queue. ``block``: wait up
        to ``timeout_s`` seconds for the first, on the port while it is open (``_queue``
        wakes it), else on the queue."""
        port = self._port
        if port is not None and port.open:
            self._apply(port.take(timeout_s if block and self._commands.empty() else 0.0))
            block = False
        try:
            command = self._commands.get(timeout=timeout_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception as err:  # a bad command never kills the loop
                self.emit(WorkerEvent(ERROR, "", self.name, time.time(), error=repr(err)))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: Request, **kwargs) -> None:
        try:
            self.engine.add_request(request, **kwargs)
        except ValueError as err:
            self.emit(WorkerEvent(ERROR, request.request_id, self.name, time.time(),
                                  error=str(err)))

    def emit(self, event: WorkerEvent | TokenBatch) -> None:
        """Queue ``event`` to leave; from the loop thread while a step runs, at its end."""
        self._emit_all([event])
        if self._port is not None and threading.current_thread() is not self._thread:
            self._wake_loop()  # the loop sends it at its next turn

    def emit_tokens(self, outputs, first_scheduled_as: str | None = None) -> None:
        """A step's tokens: the plain ones (``is_plain``) as one ``TokenBatch``, each other
        one as its own ``token_event`` (stamped ``first_scheduled_as`` = its
        ``first_scheduled_s`` where it has one), all under one lock."""
        events, plain = [], []
        for out in outputs:
            if is_plain(out):
                plain.append(out)
                continue
            stamps = ({first_scheduled_as: out.first_scheduled_s}
                      if first_scheduled_as and out.first_scheduled_s else {})
            events.append(token_event(self.name, out, **stamps))
        if plain:
            events.append(TokenBatch(self.name, plain[0].time_s,
                                     tuple(o.request_id for o in plain),
                                     tuple(o.token_id for o in plain),
                                     tuple(o.index for o in plain)))
        self._emit_all(events)

    def _emit_all(self, events: list) -> None:
        if not events:
            return
        if self._held is not None and threading.current_thread() is self._thread:
            self._held.extend(events)
            return
        with self._events_ready:
            self._events.extend(events)
            self._events_ready.notify_all()

    def on_tick(self) -> None:
        """Once per loop iteration, on the loop thread: subclasses retry deferred KV puts
        here."""

    def idle_wait_s(self) -> float:
        """How long an idle loop waits for a command before ticking again (seconds)."""
        return 0.1

    def layer_listener(self) -> Callable[[int, ScheduledBatch], None] | None:
        """The engine's layer listener (``Engine(on_layer_done=...)``), asked once when the
        engine is built; None (the default) streams nothing while a step computes."""
        return None

    def on_step(self, output: StepOutput) -> None:
        """After every step's host work, on the loop thread, with what it did (its failed
        requests are already reported; ``record`` is None: the device's step still runs, and
        so do commands, its events held to its end).
        Colocated: every token goes straight out."""
        self.emit_tokens(output.tokens)


def _nothing() -> None:
    """A command that only wakes the loop (a port's command arrived)."""


def is_plain(out: TokenOutput) -> bool:
    """A token that says nothing but itself (``TokenBatch``): not a request's first token
    here (stamps, prefix-cache hit) nor its last (finish reason, preemptions), no
    logprobs."""
    return (out.index > 0 and out.first_scheduled_s is None and out.finish_reason is None
            and out.logprob is None and not out.top_logprobs and out.num_cached_tokens is None)


def token_event(worker: str, out: TokenOutput, **stamps: float) -> WorkerEvent:
    """A ``token`` event; the first token of a request carries its prefill stamps and its
    prefix-cache hit, the last one its preemptions here."""
    if out.first_scheduled_s is not None and out.index == 0:
        stamps = {PREFILL_STARTED: out.first_scheduled_s, PREFILL_FINISHED: out.time_s, **stamps}
    return WorkerEvent(TOKEN, out.request_id, worker, out.time_s, token_id=out.token_id,
                       index=out.index,
                       finish_reason=out.finish_reason.value if out.finish_reason else None,
                       stamps=stamps, logprob=out.logprob, top_logprobs=out.top_logprobs,
                       num_cached_prompt_tokens=out.num_cached_tokens if out.index == 0 else None,
                       num_preemptions=out.num_preemptions if out.finished else 0)
