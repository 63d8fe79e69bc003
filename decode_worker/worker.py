"""DecodeWorker: admits requests whose KV arrives through the transport, then decodes them
with all its other running requests, one forward per step. A request's life across the
workers is told once, in docs/architecture.md ("A request's life"); this module's contract:

- ``admit(request, first_token, kv_handles)`` returns at once; the request waits in the engine
  as ``WAITING_FOR_REMOTE_KVS`` while this worker holds its handles. Its fetch starts only
  once the scheduler reserved its KV blocks and that step ended (``EngineLoop.after_step``),
  on a pool of fetch threads (one for a transport read in order, NCCL), so no fetched tensor
  waits outside the KV capacity; the transfer deadline counts from the fetch's start.
- Each payload's header is checked against this worker's KVSpec (model, layers, KV heads, head
  dim, dtype), request id and token count; a mismatch, a checksum failure or a timeout becomes
  an ``error`` event naming expected and got, and the reserved slot is released. The loop
  thread copies the checked KV ``[L, 2, H_kv, T, D]`` into the slot, frees the handles and
  reports ``kv_got`` (bytes, seconds).
- Cancellation wins every race: ``abort`` frees the slot and unfetched handles at once; a fetch
  in flight has its handles freed and its KV dropped when it returns (never decoded).
- With ``kv_token_start`` > 0 only the prompt's KV from that token on arrives. If the cached
  prefix was evicted before the reservation, or a running request is preempted, it recomputes
  here with no second transfer (``kv_got`` reports 0 bytes).
- Between TP sizes each layer range arrives as exactly ``engine.kv_heads.transfer_map``'s
  slices (one message per prefill rank, decode rank pair), else the request fails. Where
  each rank gets its own (``kv_transfer.rank_kv``) it happens on the loop thread.
- Under ``conditional:xPyD`` the router also ``submit``s whole requests here: they prefill and
  decode in this engine like a colocated instance's.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from channel.contract import ADMIT, Command
from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.engine import StepOutput
from engine.events import ERROR, KV_GOT, WorkerEvent
from engine.metrics import DECODE_ADMITTED
from engine.request import Request
from engine.emulated import Emulation
from engine.serving import EngineLoop
from kv_transfer.factory import make_transport
from kv_transfer.payload import WHOLE
from kv_transfer.rank_kv import (check_layers, check_slices, check_tokens, get_on_ranks,
                                  num_held, rank_factory)
from kv_transfer.transport import KVHandle, Transport

MAX_FETCH_THREADS = 8  # concurrent KV fetches per decode worker (bounded by its slots too)


@dataclass
class _Transfer:
    """A remote request this worker holds the KV handles of, until it frees them."""

    request: Request
    handles: tuple[KVHandle, ...]
    state: object  # the engine's RequestState: identifies this admission (ids may be reused)
    fetching: bool = False
    kv_token_start: int = 0  # the KV covers prompt tokens [kv_token_start, T)


class DecodeWorker(EngineLoop):
    """See the module docstring; constructor arguments as ``PrefillWorker``'s."""

    role = "decode"

    def __init__(self, name: str, model_config: ModelConfig, engine_config: EngineConfig,
                 transfer_config: TransferConfig, device: str = "cpu:1",
                 transport: Transport | None = None, faults: dict | list[dict] | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 init_method: str | None = None, inside_ray: bool = False,
                 bind: bool = True, step_delay_s: float = 0.0,
                 emulation: Emulation | None = None, rank_devices: tuple[str, ...] = ()) -> None:
        self.transfer = transfer_config
        self._transfers: dict[str, _Transfer] = {}  # loop thread only
        super().__init__(name, model_config, engine_config, device, inside_ray, bind, step_delay_s,
                         emulation, rank_devices)
        # After binding: inside a Ray actor its GPU is cuda:0, whatever the device set says.
        self.transport = transport or make_transport(transfer_config, faults, rank, world_size,
                                                     init_method, self.engine.config.device)
        # At most one fetch per slot can be in flight: reservations come first.
        num_threads = 1 if self.transport.ordered_gets else max(1, min(
            self.engine.config.max_num_seqs, MAX_FETCH_THREADS))
        self._fetcher = ThreadPoolExecutor(max_workers=num_threads,
                                           thread_name_prefix=f"{name}-kv")
        self._rank_factory = rank_factory(self.transport, 1 + len(self.rank_devices))

    def admit(self, request: Request, first_token: int, kv_handles: tuple[KVHandle, ...],
              kv_token_start: int = 0) -> None:
        """Queue ``request`` for a KV slot; its KV (prompt tokens from ``kv_token_start``
        on, the prefix before it cached here) is fetched once the slot is reserved."""
        self._queue(lambda: self._admit(request, first_token, tuple(kv_handles),
                                               kv_token_start))

    def abort(self, request_id: str) -> None:
        self._queue(lambda: self._abort(request_id))

    def on_cancelled(self, command: Command) -> None:
        """An ``admit`` an abort overtook on the channel: nobody will fetch its KV, so its
        handles are freed here, as after a fetch."""
        if command.kind == ADMIT:
            self._free(tuple(command.args[2]))

    def status(self) -> dict:
        return {**super().status(), "transport_held": self.call(
            lambda: num_held(self.engine.kv_store, self.transport, self._rank_factory)),
                "transfers_held": self.call(lambda: len(self._transfers))}

    def transfer_records(self) -> list[dict]:
        return [r.__dict__ for r in self.transport.records]

    def set_link_peak(self, gbps: float) -> None:
        """Set ``Transport.peak_gbps`` (GB/s) of this worker's transport: a restarted worker
        gets the peak its deployment measured at start (the link is the same one), so its
        transfer records keep their efficiency."""
        self.transport.peak_gbps = gbps

    def shutdown(self) -> None:
        """Stop the loop, then the fetch pool (in the other order the loop's last step can
        start a fetch on a shut pool, and the loop dies of it)."""
        super().shutdown()
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    # ---- the loop thread ---------------------------------------------------------------
    def _admit(self, request: Request, first_token: int, handles: tuple[KVHandle, ...],
               kv_token_start: int = 0) -> None:
        rid = request.request_id
        try:
            self.engine.add_remote(request, first_token, kv_token_start)
        except ValueError as err:
            self._free(handles)
            self.emit(WorkerEvent(ERROR, rid, self.name, time.time(), error=str(err)))
            return
        self._transfers[rid] = _Transfer(request, handles, self.engine.states[rid],
                                         kv_token_start=kv_token_start)

    def _abort(self, request_id: str) -> None:
        transfer = self._transfers.get(request_id)
        where = ("while its KV was in flight" if transfer and transfer.fetching else
                 "while waiting for a KV slot" if transfer else "while decoding")
        known = request_id in self.engine.states
        self.engine.abort(request_id)
        if transfer is not None and not transfer.fetching:  # a fetch in flight frees on return
            del self._transfers[request_id]
            self._free(transfer.handles)
        if known:  # whoever did not abort it (the router, if it did not) learns it ended here
            self.emit(WorkerEvent(ERROR, request_id, self.name, time.time(),
                                  error=f"aborted on {self.name} {where}"))

    def on_step(self, output: StepOutput) -> None:
        """Every token goes out; the handles of requests that recompute here instead of
        receiving their KV are freed; then the fetch of every request whose slot this step
        reserved starts once the step has ended (also after a step that did nothing else)."""
        self.emit_tokens(output.tokens, first_scheduled_as=DECODE_ADMITTED)
        for rid in output.kv_dropped:
            transfer = self._transfers.pop(rid, None)
            if transfer is None:
                continue
            self._free(transfer.handles)
            now = time.time()  # nothing fetched: the router stops holding the handles
            self.emit(WorkerEvent(KV_GOT, rid, self.name, now, kv_bytes=0, kv_transfer_s=0.0,
                                  kv_get_s=0.0, stamps={KV_GOT: now}))
        for rid in output.kv_reserved:
            transfer = self._transfers.get(rid)
            if transfer is None or not self.engine.is_waiting_for_kv(rid):
                continue  # no handles held here (added to the engine directly)
            self.after_step(functools.partial(self._start_fetch, transfer))

    def _start_fetch(self, transfer: _Transfer) -> None:
        """Fetch ``transfer``'s KV into its reserved slot, once the step that reserved it has
        ended (``after_step``); an abort meanwhile already freed its handles."""
        rid = transfer.request.request_id
        if self._transfers.get(rid) is not transfer:
            return
        if not self.engine.is_waiting_for_kv(rid):  # it ended some other way: nobody fetches
            del self._transfers[rid]
            self._free(transfer.handles)
            return
        transfer.fetching = True
        if self._rank_factory is None:
            self._fetcher.submit(self._fetch_thread, transfer)
        else:
            self._fetch_on_ranks(transfer)

    def _fetch_on_ranks(self, transfer: _Transfer) -> None:
        """Each rank gets its own slices and writes them (``kv_transfer.rank_kv``), now."""
        rid, start_s = transfer.request.request_id, time.time()
        try:
            block_ids, skip = self.engine.remote_kv_target(rid)
            get_on_ranks(self.engine.kv_store, self.transport, self._rank_factory, rid,
                         self.engine.kv_spec, transfer.handles, block_ids, skip,
                         transfer.kv_token_start, transfer.request.num_prompt_tokens,
                         1 + len(self.rank_devices), self.name, self.transfer.timeout_s)
            error = None
        except Exception as err:  # a rank's get, check or write: this request fails alone
            error = f"KV transfer failed: {type(err).__name__}: {err}"
        self._arrived(transfer, None, error, start_s, time.time(), written=True)

    def _arrived(self, transfer: _Transfer, kv: torch.Tensor | None, error: str | None,
                 start_s: float, got_s: float, written: bool = False) -> None:
        """A fetch returned: place the KV in the reserved slot (``written``: the ranks did),
        or fail, or drop it."""
        rid = transfer.request.request_id
        fetch_failed = error is not None  # the KV never came (not a placement failure)
        if self._transfers.get(rid) is transfer:
            del self._transfers[rid]
        current = self.engine.states.get(rid) is transfer.state
        if current and error is None:
            try:
                if written:
                    self.engine.remote_kv_written(rid)
                else:
                    self.engine.finish_remote(rid, kv)
            except (KeyError, ValueError) as err:
                error = str(err)
            except Exception as err:  # e.g. a device copy failing: this request fails alone
                error = f"KV placement failed: {type(err).__name__}: {err}"
        del kv  # this frame's reference to a zero-copy view (shm's lease tracks the others)
        self._free(transfer.handles)  # freed before anyone hears of the outcome
        if not current:
            return  # aborted while in flight: cancellation wins, it never decodes
        if error is not None:
            self.engine.abort(rid, error)
            self.emit(WorkerEvent(ERROR, rid, self.name, time.time(), error=error,
                                  kv_fetch_failed=fetch_failed))
            return
        num_bytes = self.engine.kv_spec.kv_bytes(transfer.request.num_prompt_tokens
                                                 - transfer.kv_token_start)
        self.emit(WorkerEvent(KV_GOT, rid, self.name, got_s, kv_bytes=num_bytes,
                              kv_transfer_s=got_s - start_s, kv_get_s=got_s - start_s,
                              stamps={KV_GOT: got_s}))

    def _free(self, handles: tuple[KVHandle, ...]) -> None:
        for handle in handles:
            try:
                self.transport.free(handle)
            except Exception:  # freeing is best effort: a dead peer holds nothing
                pass

    def _join_heads(self, rid: str, messages: list, spec) -> torch.Tensor:
        """One layer range's ``[L', 2, H_kv, T, D]`` from exactly ``transfer_map``'s slices."""
        check_slices(rid, [(h, kv.shape[2]) for h, kv in messages], spec.num_kv_heads,
                     1 + len(self.rank_devices), self.name)
        kv = messages[0][1]
        whole = kv.new_empty(kv.shape[:2] + (spec.num_kv_heads,) + kv.shape[3:])
        for h, part in messages:  # a head the decode instance replicates arrives once per copy
            whole[:, :, h.head_start:h.head_start + part.shape[2]] = part
        return whole

    # ---- fetch threads -----------------------------------------------------------------
    def _fetch_thread(self, transfer: _Transfer) -> None:
        start_s = time.time()
        try:
            kv, error = self._fetch(transfer.request, transfer.handles,
                                    transfer.kv_token_start), None
        except Exception as err:  # timeout, lost bytes, header mismatch, corruption
            kv, error = None, f"KV transfer failed: {type(err).__name__}: {err}"
        got_s = time.time()
        self._queue(lambda: self._arrived(transfer, kv, error, start_s, got_s))

    def _fetch(self, request: Request, handles: tuple[KVHandle, ...],
               token_start: int = 0) -> torch.Tensor:
        """All layer ranges of the request's KV, checked and in layer order:
        ``[L, 2, H_kv, T - token_start, D]``."""
        spec = self.engine.kv_spec
        deadline_s = time.monotonic() + self.transfer.timeout_s
        parts = []
        slices: dict[int, list] = {}  # layer_start -> [(header, kv)] of a TP pair's messages
        rid = request.request_id
        for handle in handles:
            header, kv = self.transport.get(handle, spec, max(deadline_s - time.monotonic(), 1e-3))
            check_tokens(header, rid, token_start, request.num_prompt_tokens)
            if header.part == WHOLE and kv.shape[2] == spec.num_kv_heads:
                parts.append((header.layer_start, kv))
            else:
                slices.setdefault(header.layer_start, []).append((header, kv))
        parts += [(start, self._join_heads(rid, got, spec)) for start, got in slices.items()]
        parts.sort(key=lambda part: part[0])
        check_layers(rid, [(start, kv.shape[0]) for start, kv in parts], spec.num_layers)
        return parts[0][1] if len(parts) == 1 else torch.cat([kv for _, kv in parts])
