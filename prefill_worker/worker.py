"""PrefillWorker: an engine that stops each request after its first token and puts the
prompt's KV ``[L, 2, H_kv, T, D]`` into the transport. A request's life across the workers is
told once, in docs/architecture.md ("A request's life"); this module's contract:

- Only prompt tokens from ``kv_token_start`` on are sent (its decode worker caches the prefix).
  Layer-wise granularity puts each range of ``layers_per_chunk`` layers once the runner wrote
  it, while the next layers compute; whole-request granularity puts once the step has ended (an
  emulated device's next step already launched). A first token that ends its request sends no KV.
- A first token leaves as a ``token`` event, on the channel's socket before its whole-request
  put starts; then a ``prefilled`` event repeats it with the handles and ``kv_put`` stamp.
- Past its last prompt chunk a request is never preempted (PREFILLED), so its KV cannot vanish
  before the put; after it the local KV is freed (full blocks stay in the prefix cache).
- The handles belong to whoever collected that event (the router, then the decode worker).
  Handles nobody will fetch come back through ``release``; an ``abort`` before the event was
  collected frees them here.
- Back-pressure: the loop never blocks on a full transport buffer. Without
  ``transport.has_room`` the request stays PREFILLED, its KV in its own blocks (counting
  against this worker's capacity) in a FIFO of deferred puts, retried oldest first every loop
  iteration and then put whole: the wait shows in the KV transfer, not in TTFT (the first
  token has left). A layer-wise put that meets a full buffer frees the ranges it put and is
  deferred whole. Requests that finish here never wait behind the FIFO.
- Between TP sizes (``decode_tp``: the decode instances') a put is one message per
  ``engine.kv_heads.transfer_map`` slice (``RankPart``), put by each rank from its own KV
  store where the transport allows (``kv_transfer.rank_kv``), else all by rank 0.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.engine import StepOutput
from engine.events import ERROR, PREFILLED, WorkerEvent
from engine.metrics import KV_PUT
from engine.request import Request, RequestStatus, TokenOutput
from engine.scheduler import ScheduledBatch
from engine.emulated import Emulation
from engine.serving import EngineLoop, token_event
from engine.kv_heads import sends_of, transfer_map
from kv_transfer.factory import make_transport
from kv_transfer.payload import RankPart
from kv_transfer.rank_kv import num_held, put_on_ranks, rank_factory
from kv_transfer.transport import KVHandle, Transport


class PrefillWorker(EngineLoop):
    """See the module docstring. ``transport`` overrides the one ``transfer_config`` names
    (in-process placements share one); ``faults`` wraps it in fault injection;
    ``rank``/``world_size``/``init_method`` set up torch.distributed transports;
    ``rank_devices`` makes it a tensor-parallel instance (``engine.serving.EngineLoop``);
    ``decode_tp``: the TP of the decode instances it sends to (1 for emulated ones, whose KV
    is one store)."""

    role = "prefill"

    def __init__(self, name: str, model_config: ModelConfig, engine_config: EngineConfig,
                 transfer_config: TransferConfig, device: str = "cpu:0",
                 transport: Transport | None = None, faults: dict | list[dict] | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 init_method: str | None = None, inside_ray: bool = False,
                 bind: bool = True, step_delay_s: float = 0.0,
                 emulation: Emulation | None = None, rank_devices: tuple[str, ...] = (),
                 decode_tp: int = 1) -> None:
        self.transfer = transfer_config
        self._dst_rank: dict[str, int | None] = {}
        self._kv_start: dict[str, int] = {}  # first prompt token to send (the rest is cached there)
        self._layer_handles: dict[str, list[KVHandle]] = {}
        self._put_errors: dict[str, Exception] = {}  # layer-wise puts that failed mid-step
        self._no_room: set[str] = set()  # layer-wise requests that met a full buffer this step
        self._deferred: collections.OrderedDict[str, TokenOutput] = collections.OrderedDict()
        self.num_deferred_puts = 0  # requests that had to wait for buffer room (tests, stats)
        # In-process KV outlives a "dead" worker object, so it is dropped on shutdown (as a
        # dead Ray owner's objects are). Never kept for Ray: a held ObjectRef pins the object.
        self._sent: list[KVHandle] = []
        super().__init__(name, model_config, engine_config, device, inside_ray, bind, step_delay_s,
                         emulation, rank_devices)
        # After binding: inside a Ray actor its GPU is cuda:0, whatever the device set says.
        self.transport = transport or make_transport(transfer_config, faults, rank, world_size,
                                                     init_method, self.engine.config.device)
        prefill_tp = 1 + len(self.rank_devices)
        self._slices = transfer_map(self.engine.kv_spec.num_kv_heads, prefill_tp, decode_tp)
        self._tps = (prefill_tp, decode_tp)
        self._rank_factory = rank_factory(self.transport, prefill_tp)

    def layer_listener(self) -> Callable[[int, ScheduledBatch], None] | None:
        """Layer-wise granularity: ``_put_layers`` hears of every layer as it is written."""
        return self._put_layers if self.transfer.granularity == "layer" else None

    def submit(self, request: Request, dst_rank: int | None = None,
               kv_token_start: int = 0) -> None:
        """Queue ``request`` for prefill; ``dst_rank`` is the decode worker's rank (only
        point-to-point transports use it). ``kv_token_start``: send the prompt's KV from
        this token on (a multiple of the block size below the prompt length: the prefix
        its decode worker caches, so only the missing blocks travel)."""
        def add() -> None:
            rid = request.request_id
            block_size = self.engine.config.block_size
            if kv_token_start % block_size or not 0 <= kv_token_start < request.num_prompt_tokens:
                self.emit(WorkerEvent(ERROR, rid, self.name, time.time(), error=(
                    f"request {rid}: kv_token_start must be a multiple of {block_size} in "
                    f"[0, {request.num_prompt_tokens}), got {kv_token_start}")))
                return
            self._dst_rank[rid] = dst_rank
            self._kv_start[rid] = kv_token_start
            self._add(request, prefill_only=True)
        self._queue(add)

    def release(self, handles: tuple[KVHandle, ...]) -> None:
        """Free KV handles this worker put that nobody will fetch (the request ended first,
        its decode worker died, or ``admit`` refused them). Freeing twice is harmless."""
        self._queue(lambda: self._free(handles))

    def _free(self, handles) -> None:
        """Free each handle; best effort, so one failing free (a dead peer's segment) never
        skips the others nor escapes into the engine loop."""
        for handle in handles:
            try:
                self.transport.free(handle)
            except Exception:  # nothing is left to free where freeing fails
                pass

    def status(self) -> dict:
        return {**super().status(), "transport_held": self.call(
            lambda: num_held(self.engine.kv_store, self.transport, self._rank_factory))}

    def shutdown(self) -> None:
        """Stop; like a dead Ray owner, drop every KV put here (freeing twice is harmless)."""
        super().shutdown()
        self._free(self._sent)

    def transfer_records(self) -> list[dict]:
        return [r.__dict__ for r in self.transport.records]

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` wherever it is here: queued, computing, deferred, or put but
        with its ``prefilled`` event not yet collected (no one else will free that KV)."""
        self._queue(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._deferred.pop(request_id, None)
        self._dst_rank.pop(request_id, None)
        self._kv_start.pop(request_id, None)
        self._put_errors.pop(request_id, None)
        self._no_room.discard(request_id)
        self._free(self._layer_handles.pop(request_id, []))
        for event in self._take_events(request_id):
            self._free(event.kv_handles)

    def idle_wait_s(self) -> float:
        return 0.002 if self._deferred else super().idle_wait_s()

    def on_tick(self) -> None:
        """Retry deferred puts once no step is in flight (``after_step``: after a running
        step's first tokens left)."""
        if self._deferred:
            self.after_step(self._retry_deferred)

    def _retry_deferred(self) -> None:
        """Put deferred requests, oldest first, while the buffer has room."""
        while self._deferred:
            rid, out = next(iter(self._deferred.items()))
            state = self.engine.states.get(rid)
            if state is None:  # ended some other way: nothing left to put
                del self._deferred[rid]
                continue
            try:
                if not self.transport.has_room(self._put_bytes(state)):
                    return
            except Exception as err:  # can never fit: this request fails, not the worker
                del self._deferred[rid]
                self._fail(rid, err)
                continue
            del self._deferred[rid]
            self._put_whole(out)

    def on_step(self, output: StepOutput) -> None:
        going_on = []
        for out in output.tokens:
            self.emit(token_event(self.name, out))
            if out.finish_reason is None:
                going_on.append(out)
                continue
            rid = out.request_id  # ended with its first token: no KV to send
            self._dst_rank.pop(rid, None)
            self._kv_start.pop(rid, None)
            self._put_errors.pop(rid, None)  # a layer put that failed no longer matters
            self._no_room.discard(rid)
            self._free(self._layer_handles.pop(rid, []))
        if going_on:  # its KV leaves once its step has ended (KV_PUT stamped after that)
            self.after_step(lambda: self._hand_over(going_on))

    def _hand_over(self, outs: list[TokenOutput]) -> None:
        """At the end of the step that prefilled ``outs``: their first tokens go on the wire,
        then each one's KV is put (or deferred, or its request fails). One aborted while its
        step ran is no longer PREFILLED here and is skipped."""
        self._send_events()  # on the wire before any put starts: TTFT ends there
        for out in outs:
            rid = out.request_id
            state = self.engine.states.get(rid)
            if state is None or state.status != RequestStatus.PREFILLED:
                continue
            handles = self._layer_handles.pop(rid, None)
            if rid in self._put_errors:
                self._free(handles or [])
                self._fail(rid, self._put_errors.pop(rid))
            elif rid in self._no_room or (handles is None and not self._fits_now(rid)):
                self._no_room.discard(rid)  # its layer handles were freed when it met no room
                self._deferred[rid] = out
                self.num_deferred_puts += 1
            elif handles is None:  # whole request
                self._put_whole(out)
            else:
                self.engine.finish_prefilled(rid)
                self._prefilled(out, handles)

    def _fits_now(self, rid: str) -> bool:
        """No deferred put is ahead of ``rid`` and the buffer has room for its whole KV."""
        if self._deferred:
            return False
        try:
            return self.transport.has_room(self._put_bytes(self.engine.states[rid]))
        except Exception:
            return True  # let the put itself fail with the transport's reason

    def _put_bytes(self, state, num_layers: int | None = None) -> int:
        """Bytes of ``state``'s KV this worker sends over ``num_layers`` (default all; prompt
        tokens from its start on; a KV head a decode instance replicates goes to each of its
        ranks). Rank to rank, the largest one rank puts: rank 0's room stands for each rank's."""
        start = self._kv_start.get(state.request_id, 0)
        heads = (sum(len(s.heads) for s in self._slices) if self._rank_factory is None else
                 max(sum(len(s.heads) for s in sends_of(r, self._slices))
                     for r in range(self._tps[0])))
        num_kv_heads = self.engine.kv_spec.num_kv_heads
        return (self.engine.kv_spec.kv_bytes(state.num_prompt_tokens - start, num_layers)
                * heads // num_kv_heads)

    def _put(self, rid: str, token_start: int, layers: slice | None = None) -> list[KVHandle]:
        """Put the prompt KV ``[L', 2, H_kv, T, D]`` from ``token_start`` on of a prefilled
        request (``layers``: those layers of one still computing) as one message per rank
        slice (whole between TP-1 instances), each rank its own where the transport allows
        (``kv_transfer.rank_kv``); a failed put frees the ones before it, then raises."""
        layer_start = 0 if layers is None else layers.start
        if self._rank_factory is not None:
            block_ids, num_tokens = self.engine.prompt_kv_blocks(rid, token_start)
            return put_on_ranks(self.engine.kv_store, self.transport, self._rank_factory, rid,
                                self.engine.kv_spec, block_ids, num_tokens,
                                slice(None) if layers is None else layers, token_start,
                                layer_start, self._slices,
                                self._tps, self._dst_rank.get(rid))
        may_view = self.transport.copies_on_put
        kv = (self.engine.prefilled_kv(rid, token_start, may_view=may_view) if layers is None
              else self.engine.read_kv_layers(rid, layers, token_start, may_view=may_view))
        if self._tps == (1, 1):
            return [self.transport.put(rid, self.engine.kv_spec, kv, token_start=token_start,
                                       layer_start=layer_start, dst_rank=self._dst_rank.get(rid))]
        handles: list[KVHandle] = []
        try:
            for s in self._slices:
                part = RankPart(s.heads.start, s.prefill_rank, s.decode_rank, *self._tps)
                handles.append(self.transport.put(
                    rid, self.engine.kv_spec, kv[:, :, s.heads.start:s.heads.stop].contiguous(),
                    token_start=token_start, layer_start=layer_start,
                    dst_rank=self._dst_rank.get(rid), part=part))
        except Exception:
            self._free(handles)
            raise
        return handles

    def _put_whole(self, out: TokenOutput) -> None:
        rid = out.request_id
        start = self._kv_start.get(rid, 0)
        try:
            handles = self._put(rid, start)
        except Exception as err:  # the transport refused: this request fails, not the worker
            self._fail(rid, err)
            return
        self.engine.finish_prefilled(rid)  # after the put: ``kv`` may view these blocks
        self._prefilled(out, handles)

    def _fail(self, rid: str, err: Exception) -> None:
        self._dst_rank.pop(rid, None)
        self._kv_start.pop(rid, None)
        self.engine.abort(rid, str(err))
        self.emit(WorkerEvent(ERROR, rid, self.name, time.time(),
                              error=f"KV put failed: {type(err).__name__}: {err}"))

    def _prefilled(self, out: TokenOutput, handles: list[KVHandle]) -> None:
        rid = out.request_id
        self._dst_rank.pop(rid, None)
        start = self._kv_start.pop(rid, 0)
        if self.transport.name == "inprocess":
            self._sent.extend(handles)
        handles = [self.transport.portable(h) for h in handles]  # they cross the channel
        first = token_event(self.name, out, **{KV_PUT: time.time()})
        self.emit(WorkerEvent(PREFILLED, rid, self.name, out.time_s, token_id=out.token_id,
                              index=0, kv_handles=tuple(handles),
                              kv_bytes=sum(h.num_bytes for h in handles),
                              kv_put_s=sum(h.put_s for h in handles),
                              stamps=first.stamps, logprob=out.logprob,
                              top_logprobs=out.top_logprobs,
                              num_cached_prompt_tokens=out.num_cached_tokens,
                              num_preemptions=out.num_preemptions,
                              kv_bytes_saved=self.engine.kv_spec.kv_bytes(start)))

    def _put_layers(self, layer: int, batch: ScheduledBatch) -> None:
        """After ``layer``: put the finished layer range of every prompt completing now
        (unless the buffer is full or deferred puts wait: then it is deferred whole)."""
        per_chunk = self.transfer.layers_per_chunk
        num_layers = self.engine.kv_spec.num_layers
        if (layer + 1) % per_chunk and layer + 1 != num_layers:
            return
        start = layer + 1 - ((layer % per_chunk) + 1)
        for i, state in enumerate(batch.requests):
            if not (state.prefill_only and state.is_prefilling and batch.completes(i)):
                continue
            rid = state.request_id
            if rid in self._put_errors or rid in self._no_room:
                continue
            token_start = self._kv_start.get(rid, 0)
            try:
                room = not self._deferred and self.transport.has_room(
                    self._put_bytes(state, layer + 1 - start))
                if not room:  # free what it holds of the buffer: nothing half-sent waits
                    self._no_room.add(rid)
                    self._free(self._layer_handles.pop(rid, []))
                    continue
                handles = self._put(rid, token_start, slice(start, layer + 1))
            except Exception as err:  # fail this request after the step, not the whole batch
                self._put_errors[rid] = err
                continue
            self._layer_handles.setdefault(rid, []).extend(handles)
