"""DecodeWorker: admits requests whose KV arrives through the transport, then decodes them
together with all its other running requests, one forward per step.

A request's life here (DESIGN §3, steps 3-5):

1. ``admit(request, first_token, kv_handles)`` returns at once; a fetch thread gets the KV
   (every layer range) within the transfer deadline, so a slow transfer never stalls the
   decode steps of other requests.
2. Each payload's header is checked against this worker's own KVSpec (model, layers, KV
   heads, head dim, dtype) and its token count against the prompt length; a mismatch, a
   corrupted payload (checksum) or a timeout turns into an ``error`` event naming the cause,
   the handles are freed, and the worker goes on.
3. The checked KV ``[L, 2, H_kv, T, D]`` is imported into the engine (``num_computed_tokens``
   = prompt length): the request waits for a KV slot like any other, then joins the next
   decode step. A ``kv_got`` event reports bytes and seconds.
4. Every token leaves as a ``token`` event; the request's KV is freed when it finishes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.events import ERROR, KV_GOT, WorkerEvent
from engine.metrics import DECODE_ADMITTED
from engine.request import Request, TokenOutput
from engine.serving import EngineLoop, token_event
from kv_transfer.factory import make_transport
from kv_transfer.transport import KVHandle, Transport


class DecodeWorker(EngineLoop):
    """See the module docstring; constructor arguments as ``PrefillWorker``'s."""

    role = "decode"

    def __init__(self, name: str, model_config: ModelConfig, engine_config: EngineConfig,
                 transfer_config: TransferConfig, device: str = "cpu:1",
                 transport: Transport | None = None, faults: dict | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 init_method: str | None = None, inside_ray: bool = False,
                 bind: bool = True, step_delay_s: float = 0.0) -> None:
        self.transfer = transfer_config
        # One fetch thread: transfers arrive in order and never block the decode loop.
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-kv")
        super().__init__(name, model_config, engine_config, device, inside_ray, bind, step_delay_s)
        # After binding: inside a Ray actor its GPU is cuda:0, whatever the device set says.
        self.transport = transport or make_transport(transfer_config, faults, rank, world_size,
                                                     init_method, self.engine.config.device)

    def admit(self, request: Request, first_token: int, kv_handles: tuple[KVHandle, ...]) -> None:
        """Fetch the KV of ``request`` in the background, then decode it from its second token."""
        self._fetcher.submit(self._fetch_and_import, request, first_token, tuple(kv_handles))

    def status(self) -> dict:
        return {**super().status(), "transport_held": self.call(self.transport.num_held)}

    def transfer_records(self) -> list[dict]:
        return [r.__dict__ for r in self.transport.records]

    def shutdown(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    def _fetch_and_import(self, request: Request, first_token: int,
                          handles: tuple[KVHandle, ...]) -> None:
        rid = request.request_id
        start_s = time.time()
        try:
            kv, error = self._fetch(request, handles), None
        except Exception as err:  # timeout, lost bytes, header mismatch, corruption
            kv, error = None, f"KV transfer failed: {type(err).__name__}: {err}"
        for handle in handles:  # freed before anyone hears of the outcome
            self.transport.free(handle)
        if error is not None:
            self.emit(WorkerEvent(ERROR, rid, self.name, time.time(), error=error))
            return
        got_s = time.time()
        self.emit(WorkerEvent(KV_GOT, rid, self.name, got_s, kv_bytes=kv.numel() * kv.element_size(),
                              kv_transfer_s=got_s - start_s, kv_get_s=got_s - start_s,
                              stamps={KV_GOT: got_s}))
        self._commands.put(lambda: self._import(request, first_token, kv))

    def _fetch(self, request: Request, handles: tuple[KVHandle, ...]) -> torch.Tensor:
        """All layer ranges of the request's KV, checked and in layer order: ``[L, 2, H_kv, T, D]``."""
        spec = self.engine.kv_spec
        deadline_s = time.monotonic() + self.transfer.timeout_s
        parts = []
        for handle in handles:
            header, kv = self.transport.get(handle, spec, max(deadline_s - time.monotonic(), 1e-3))
            num_tokens = header.token_end - header.token_start
            if num_tokens != request.num_prompt_tokens:
                raise ValueError(f"KV header mismatch for request {request.request_id}: tokens "
                                 f"expected {request.num_prompt_tokens}, got {num_tokens}")
            parts.append((header.layer_start, kv))
        parts.sort(key=lambda part: part[0])
        layers = [start for start, _ in parts]
        expected = list(range(0, spec.num_layers, parts[0][1].shape[0])) if parts else []
        if not parts or sum(kv.shape[0] for _, kv in parts) != spec.num_layers or layers != expected:
            raise ValueError(f"KV for request {request.request_id} covers layers starting at "
                             f"{layers}, expected all {spec.num_layers} layers")
        return parts[0][1] if len(parts) == 1 else torch.cat([kv for _, kv in parts])

    def _import(self, request: Request, first_token: int, kv: torch.Tensor) -> None:
        try:
            self.engine.import_kv(request, first_token, kv)
        except ValueError as err:
            self.emit(WorkerEvent(ERROR, request.request_id, self.name, time.time(), error=str(err)))

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            stamps = {DECODE_ADMITTED: out.first_scheduled_s} if out.first_scheduled_s else {}
            self.emit(token_event(self.name, out, **stamps))
