"""PrefillWorker: an engine that stops each request after its first token and hands the
prompt's KV to the transport.

A request's life here (DESIGN §3, step 2):

1. ``submit(request, dst_rank)`` queues it (prefill-only); it is batched with other prompts
   under the token budget, chunked if the engine chunks.
2. The step that computes its last prompt token samples the **first token**.
   Layer-wise granularity: during that step each range of ``layers_per_chunk`` layers is
   put into the transport as soon as the runner has written it, while the next layers
   compute. Whole-request granularity: the prompt's KV ``[L, 2, H_kv, T, D]`` is put after
   the step.
3. The local KV is freed (the transport owns the bytes now) and a ``prefilled`` event
   carries the first token and the handles. If the first token already ends the request
   (EOS, stop token, ``max_tokens == 1``) no KV is sent.
"""

from __future__ import annotations

import time

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.events import ERROR, PREFILLED, WorkerEvent
from engine.metrics import KV_PUT
from engine.request import Request, TokenOutput
from engine.scheduler import ScheduledBatch
from engine.serving import EngineLoop, token_event
from kv_transfer.factory import make_transport
from kv_transfer.transport import KVHandle, Transport


class PrefillWorker(EngineLoop):
    """See the module docstring. ``transport`` overrides the one ``transfer_config`` names
    (in-process placements share one); ``faults`` wraps it in fault injection;
    ``rank``/``world_size``/``init_method`` set up torch.distributed transports."""

    role = "prefill"

    def __init__(self, name: str, model_config: ModelConfig, engine_config: EngineConfig,
                 transfer_config: TransferConfig, device: str = "cpu:0",
                 transport: Transport | None = None, faults: dict | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 init_method: str | None = None, inside_ray: bool = False,
                 bind: bool = True, step_delay_s: float = 0.0) -> None:
        self.transfer = transfer_config
        self._dst_rank: dict[str, int | None] = {}
        self._layer_handles: dict[str, list[KVHandle]] = {}
        self._put_errors: dict[str, Exception] = {}  # layer-wise puts that failed mid-step
        # In-process KV outlives a "dead" worker object, so it is dropped on shutdown (as a
        # dead Ray owner's objects are). Never kept for Ray: a held ObjectRef pins the object.
        self._sent: list[KVHandle] = []
        super().__init__(name, model_config, engine_config, device, inside_ray, bind, step_delay_s)
        # After binding: inside a Ray actor its GPU is cuda:0, whatever the device set says.
        self.transport = transport or make_transport(transfer_config, faults, rank, world_size,
                                                     init_method, self.engine.config.device)
        if transfer_config.granularity == "layer":
            self.engine.on_layer_done = self._put_layers

    def submit(self, request: Request, dst_rank: int | None = None) -> None:
        """Queue ``request`` for prefill; ``dst_rank`` is the decode worker's rank (only
        point-to-point transports use it)."""
        def add() -> None:
            self._dst_rank[request.request_id] = dst_rank
            self._add(request, prefill_only=True)
        self._commands.put(add)

    def status(self) -> dict:
        return {**super().status(), "transport_held": self.call(self.transport.num_held)}

    def shutdown(self) -> None:
        """Stop; like a dead Ray owner, drop every KV put here (freeing twice is harmless)."""
        super().shutdown()
        for handle in self._sent:
            self.transport.free(handle)

    def transfer_records(self) -> list[dict]:
        return [r.__dict__ for r in self.transport.records]

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            dst_rank = self._dst_rank.pop(rid, None)
            if out.finish_reason is not None:  # ended with its first token: no KV to send
                for handle in self._layer_handles.pop(rid, []):
                    self.transport.free(handle)
                self.emit(token_event(self.name, out))
                continue
            try:
                handles = self._layer_handles.pop(rid, None)
                if rid in self._put_errors:
                    for handle in handles or []:
                        self.transport.free(handle)
                    raise self._put_errors.pop(rid)
                if handles is None:  # whole request
                    kv, _ = self.engine.export_kv(rid)
                    handles = [self.transport.put(rid, self.engine.kv_spec, kv, dst_rank=dst_rank)]
                else:
                    self.engine.finish_prefilled(rid)
            except Exception as err:  # the transport refused: this request fails, not the worker
                self.engine.abort(rid, str(err))
                self.emit(WorkerEvent(ERROR, rid, self.name, time.time(),
                                      error=f"KV put failed: {type(err).__name__}: {err}"))
                continue
            if self.transport.name == "inprocess":
                self._sent.extend(handles)
            first = token_event(self.name, out, **{KV_PUT: time.time()})
            self.emit(WorkerEvent(PREFILLED, rid, self.name, out.time_s, token_id=out.token_id,
                                  index=0, kv_handles=tuple(handles),
                                  kv_bytes=sum(h.num_bytes for h in handles),
                                  kv_put_s=sum(h.put_s for h in handles),
                                  stamps=first.stamps))

    def _put_layers(self, layer: int, batch: ScheduledBatch) -> None:
        """After ``layer``: put the finished layer range of every prompt completing now."""
        per_chunk = self.transfer.layers_per_chunk
        num_layers = self.engine.kv_spec.num_layers
        if (layer + 1) % per_chunk and layer + 1 != num_layers:
            return
        start = layer + 1 - ((layer % per_chunk) + 1)
        for i, state in enumerate(batch.requests):
            if not (state.prefill_only and state.is_prefilling and batch.completes(i)):
                continue
            rid = state.request_id
            if rid in self._put_errors:
                continue
            kv = self.engine.read_kv_layers(rid, slice(start, layer + 1))
            try:
                handle = self.transport.put(rid, self.engine.kv_spec, kv, layer_start=start,
                                            dst_rank=self._dst_rank.get(rid))
            except Exception as err:  # fail this request after the step, not the whole batch
                self._put_errors[rid] = err
                continue
            self._layer_handles.setdefault(rid, []).append(handle)
