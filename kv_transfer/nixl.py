"""``NixlTransport`` (``nixl``): KV through NIXL one-sided READs, as vLLM's ``NixlConnector``,
NVIDIA Dynamo and SGLang move it; NIXL's UCX backend picks the path (CMA, RDMA or TCP,
GPUDirect; no GPU needed). Without ``pdlab[nixl]``, ``NixlTransport()`` raises ``ImportError``
(``MISSING``).

- One agent per process, without NIXL's progress thread (it spins a core): a producer's poller
  drives progress every ``PROGRESS_INTERVAL_S`` while it holds transfers; a consumer drives its READ.
- ``put``: reclaim extents whose freed word a consumer set, place the bytes at the lowest free
  extent (none until ``alloc_timeout_s``: ``TransferFailed``), then write the stamp (generation)
  and a freed word of 0 after them.
- ``get``: one READ into the landing buffer (or a one-off buffer when full), polled until done or
  ``TransferTimeout``. A dead producer, or a stamp other than the handle's generation, is
  ``TransferFailed``. On CPU the KV is a leased view of the landing extent; on CUDA a copy.
- ``free``: the producer releases the extent; any other process WRITEs the generation into the
  freed word (a NIXL notification would stall the next READ). Double and stale frees are harmless.

All NIXL calls share one lock (the agent has no thread synchronisation); on CUDA: ``VRAM``."""

from __future__ import annotations

import importlib
import itertools
import os
import secrets
import socket
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch

from engine.kv_cache import KVSpec
from kv_transfer.extents import first_fit, round_up
from kv_transfer.payload import WHOLE, Frame, RankPart, pack_tensor
from kv_transfer.shm import node_id, pid_alive
from kv_transfer.transport import KVHandle, TransferFailed, TransferTimeout, Transport

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
MISSING = ("transport 'nixl' needs NIXL, which is not installed: pip install 'pdlab[nixl]' "
           "(the nixl-cu12 wheel)")
DEFAULT_CAPACITY = 1 << 30  # bytes; CPU pages are committed only as transfers touch them
ALIGN = 4096
STAMP_BYTES = 8  # the stamp (generation), read with the bytes
TAIL_BYTES = 16  # stamp + freed word after each extent's bytes
_FREE_WAIT_S = 5.0  # how long a free's WRITE may take before it is given up
_QUICK_POLLS = 64     # check_xfer_state calls before the poll loop starts sleeping
_MAX_POLL_SLEEP_S = 1e-3
PROGRESS_INTERVAL_S = 2e-3  # a producer's poller, while its arena holds transfers
_IDLE_WAIT_S = 1.0          # the poller's sleep while nothing is held (woken by a put)


def import_nixl():
    """``nixl``, else ``nixl_cu12``, else ``nixl_cu13``.

    Raises:
        ImportError: none is installed (message ``MISSING``, naming the extra)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines on every agent
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError(MISSING)


def nixl_available() -> bool:
    try:
        import_nixl()
    except ImportError:
        return False
    return True


class NixlKey(NamedTuple):
    """Where a NIXL transfer's bytes are and how to reach them: plain values, picklable."""

    agent: str        # the producer's NIXL agent name
    metadata: bytes   # its agent metadata (nixl_agent.get_agent_metadata)
    node: str         # kv_transfer.shm.node_id() of the producer
    owner_pid: int
    mem: str          # "DRAM" or "VRAM"
    device_id: int
    addr: int         # address of the extent's first byte in the producer
    nbytes: int       # tensor bytes; the stamp follows them
    gen: int          # the put's generation, also the extent's id
    header: bytes


class _Region:
    """A registered uint8 buffer and the extents placed in it (first fit)."""

    def __init__(self, agent, capacity: int, device: torch.device):
        # a normal tensor even when the first put runs inside the forward's inference mode
        with torch.inference_mode(False):
            self.data = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.capacity = capacity
        self.mem = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        self.addr = self.data.data_ptr()
        self.descs = agent.register_memory(self.data)  # once: every transfer reuses it
        self.array = None if device.type == "cuda" else self.data.numpy()
        self.extents: dict[int, tuple[int, int, int]] = {}  # id -> (start, end, nbytes)

    def place(self, need: int) -> int | None:
        return first_fit(((s, e) for s, e, _ in self.extents.values()), need, self.capacity)


def _stamp(gen: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(gen.to_bytes(STAMP_BYTES, "little")), dtype=torch.uint8)


def _tail(gen: int) -> torch.Tensor:
    """Stamp ``gen`` and a freed word of 0, the 16 bytes after an extent's data."""
    return torch.cat([_stamp(gen), _stamp(0)])


class NixlTransport(Transport):
    """KV through NIXL READs from a per-producer registered arena (module docstring).
    ``capacity_bytes``: what this process's puts hold at once; ``landing_bytes``: what its gets
    hold at once; ``device``: where both live (``cpu`` or ``cuda[:N]``).

    Raises:
        ImportError: NIXL is not installed (``MISSING``).
        ValueError: a capacity below one extent."""

    name = "nixl"

    def __init__(self, checksum: bool = True, capacity_bytes: int = DEFAULT_CAPACITY,
                 landing_bytes: int = DEFAULT_CAPACITY, alloc_timeout_s: float = 10.0,
                 device: str = "cpu", backends: tuple[str, ...] = ("UCX",)):
        super().__init__(checksum)
        if min(capacity_bytes, landing_bytes) < ALIGN:
            raise ValueError(f"capacity_bytes and landing_bytes must be >= {ALIGN}, got "
                             f"{capacity_bytes} and {landing_bytes}")
        nixl = import_nixl()
        self.capacity = round_up(capacity_bytes, ALIGN)
        self.landing_capacity = round_up(landing_bytes, ALIGN)
        self.alloc_timeout_s = alloc_timeout_s
        self.device = torch.device("cpu" if device.startswith("cpu") else device)
        self.node = node_id()
        self.agent_name = f"pdlab-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                        backends=list(backends))
        self._agent = nixl.nixl_agent(self.agent_name, config)
        self._lock = threading.RLock()
        self._arena: _Region | None = None
        self._landing: _Region | None = None
        self._outbox: _Region | None = None
        self._metadata: bytes | None = None
        self._remotes: set[str] = set()  # producers whose metadata is loaded
        self._gens = itertools.count(1)
        self._land_ids = itertools.count()  # landing extents' ids
        self._leases = 0  # landing extents still viewed by tensors handed out
        self._wake = threading.Event()  # a put woke the poller
        self._closed = threading.Event()
        self._poller: threading.Thread | None = None

    def _own_arena(self) -> _Region:
        if self._arena is None:
            try:
                self._arena = _Region(self._agent, self.capacity, self.device)
                self._metadata = self._agent.get_agent_metadata()  # includes the arena
            except Exception as err:
                self._arena = None
                raise TransferFailed(f"cannot register a {self.capacity}-byte NIXL arena: "
                                     f"{type(err).__name__}: {err}") from err
        return self._arena

    def _start_poller(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=_poll, args=(weakref.ref(self),),
                                            name=f"{self.agent_name}-progress", daemon=True)
            self._poller.start()

    def _poll_once(self) -> bool:
        """One poller round: reclaim (progress) if the arena holds transfers; whether it did."""
        with self._lock:
            busy = self._arena is not None and bool(self._arena.extents)
            if busy:
                self._reclaim()
            return busy

    def _reclaim(self) -> None:
        """Release every extent whose freed word holds its generation (and progress the agent)."""
        try:
            self._agent.get_new_notifs()
        except Exception:  # a peer's failure shows up here too; nothing to apply
            pass
        arena = self._arena
        if arena is None or not arena.extents:
            return
        gens = list(arena.extents)
        words = torch.tensor([start + nbytes + STAMP_BYTES
                              for start, _, nbytes in arena.extents.values()])
        index = (words[:, None] + torch.arange(STAMP_BYTES)).reshape(-1).to(arena.data.device)
        freed = arena.data[index].cpu().view(torch.int64).tolist()
        for gen, word in zip(gens, freed):
            if word == gen:
                self._release(gen)

    def _release(self, gen: int) -> None:
        arena = self._arena
        extent = None if arena is None else arena.extents.pop(gen, None)
        if extent is not None:  # wipe the stamp: a late READ sees the extent is gone
            start, _, nbytes = extent
            arena.data[start + nbytes:start + nbytes + TAIL_BYTES].zero_()

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int, part: RankPart = WHOLE) -> list[Frame]:
        if self.device.type != "cuda":
            return super()._pack(request_id, spec, kv, token_start, layer_start, part)
        header, kv_u8 = pack_tensor(request_id, spec, kv.to(self.device), token_start,
                                    layer_start, self.checksum, part)
        return [header, kv_u8]  # stays on the device: copied device to device on put

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None
                    ) -> NixlKey:
        header, src = bytes(frames[0]), _as_u8(frames[1])
        nbytes = src.numel()
        need = round_up(nbytes + TAIL_BYTES, ALIGN)
        deadline_s = time.monotonic() + self.alloc_timeout_s
        while True:
            with self._lock:
                arena = self._own_arena()
                if need > arena.capacity:
                    raise TransferFailed(f"KV of request {request_id} ({nbytes} bytes) exceeds "
                                         f"the NIXL arena ({arena.capacity} bytes)")
                self._reclaim()
                offset = arena.place(need)
                if offset is not None:
                    gen = next(self._gens)
                    arena.data[offset:offset + nbytes].copy_(src)
                    arena.data[offset + nbytes:offset + nbytes + TAIL_BYTES].copy_(_tail(gen))
                    arena.extents[gen] = (offset, offset + need, nbytes)
                    self._start_poller()
                    self._wake.set()
                    return NixlKey(self.agent_name, self._metadata, self.node, os.getpid(),
                                   arena.mem, arena.device_id, arena.addr + offset, nbytes, gen,
                                   header)
                held = len(arena.extents)
            if time.monotonic() >= deadline_s:
                raise TransferFailed(
                    f"NIXL arena full for request {request_id}: {held} transfers hold it, "
                    f"none freed within {self.alloc_timeout_s} s ({nbytes} bytes needed of "
                    f"{self.capacity})")
            time.sleep(0.001)

    def has_room(self, num_bytes: int) -> bool:
        """True when a put of ``num_bytes`` would find an extent now (after a reclaim).

        Raises:
            TransferFailed: ``num_bytes`` exceeds the whole arena."""
        need = round_up(num_bytes + TAIL_BYTES, ALIGN)
        with self._lock:
            arena = self._own_arena()
            if need > arena.capacity:
                raise TransferFailed(f"KV of {num_bytes} bytes exceeds the NIXL arena "
                                     f"({arena.capacity} bytes)")
            self._reclaim()
            return arena.place(need) is not None

    def _remote(self, key: NixlKey) -> str:
        """The producer's agent name, its metadata loaded once (under the lock)."""
        if key.agent != self.agent_name and key.agent not in self._remotes:
            self._agent.add_remote_agent(key.metadata)
            self._remotes.add(key.agent)
        return key.agent

    def _forget(self, agent: str) -> None:
        if agent in self._remotes:
            self._remotes.discard(agent)
            try:
                self._agent.remove_remote_agent(agent)
            except Exception:
                pass

    def _outbox_region(self) -> _Region:
        """The registered source of free WRITEs (under the lock; one WRITE at a time)."""
        if self._outbox is None:
            self._outbox = _Region(self._agent, ALIGN, self.device)
        return self._outbox

    def _landing_region(self) -> _Region:
        if self._landing is None:
            self._landing = _Region(self._agent, self.landing_capacity, self.device)
        return self._landing

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        key: NixlKey = handle.key
        rid = handle.request_id
        deadline_s = time.monotonic() + timeout_s
        if key.node == self.node and key.owner_pid != os.getpid() and not pid_alive(key.owner_pid):
            raise TransferFailed(f"KV of request {rid} is lost: its owner (pid {key.owner_pid}) "
                                 "died")
        length = key.nbytes + STAMP_BYTES
        need = round_up(length, ALIGN)
        scratch = None
        with self._lock:
            land = next(self._land_ids)  # local: two producers' generations may be equal
            try:
                landing = self._landing_region()
                offset = landing.place(need)
                if offset is None:  # no room: one buffer registered for this READ only
                    scratch = _Scratch(self._agent, length, self.device)
                    local_addr = scratch.addr
                else:
                    landing.extents[land] = (offset, offset + need, key.nbytes)
                    local_addr = landing.addr + offset
                mem, dev = (landing.mem, landing.device_id)
                remote = self._remote(key)
                xfer = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs([(local_addr, length, dev)], mem),
                    self._agent.get_xfer_descs([(key.addr, length, key.device_id)], key.mem),
                    remote)
                state = self._agent.transfer(xfer)
            except Exception as err:
                self._drop_landing(land, scratch)
                self._failed(key, err)
                raise TransferFailed(f"KV of request {rid} cannot be read from {key.agent}: "
                                     f"{type(err).__name__}: {err}") from err
        try:
            self._wait(xfer, state, deadline_s, rid, timeout_s)
        except BaseException as err:
            with self._lock:
                self._release_xfer(xfer)
                self._drop_landing(land, scratch)
                if not isinstance(err, TransferTimeout):
                    self._failed(key, err)
            raise
        with self._lock:
            self._release_xfer(xfer)
            region_data = scratch.data if scratch is not None else landing.data
            base = 0 if scratch is not None else offset
            stamp = region_data[base + key.nbytes:base + length].cpu()
            if not torch.equal(stamp, _stamp(key.gen)):
                self._drop_landing(land, scratch)
                raise TransferFailed(f"no KV for request {rid} at {key.agent}: already freed")
            if scratch is not None:
                return [key.header, scratch.take(key.nbytes)]
            if self.device.type == "cuda":  # a device copy; the extent goes back at once
                out = landing.data[offset:offset + key.nbytes].clone()
                landing.extents.pop(land, None)
                return [key.header, out]
            view = landing.array[offset:offset + key.nbytes]
            self._leases += 1
        weakref.finalize(view, self._view_gone, land)
        return [key.header, torch.from_numpy(view)]

    def _wait(self, xfer, state: str, deadline_s: float, rid: str, timeout_s: float) -> None:
        """Poll the READ until it is done (no progress thread: this thread drives it)."""
        polls = 0
        while state == "PROC":
            if time.monotonic() >= deadline_s:
                raise TransferTimeout(f"KV for request {rid} not read within {timeout_s} s")
            polls += 1
            if polls > _QUICK_POLLS:
                time.sleep(min(_MAX_POLL_SLEEP_S, 1e-5 * 2 ** min(polls - _QUICK_POLLS, 7)))
            with self._lock:
                state = self._agent.check_xfer_state(xfer)
        if state != "DONE":
            raise TransferFailed(f"the NIXL READ of request {rid}'s KV failed ({state})")

    def _release_xfer(self, xfer) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception:  # an aborted READ may refuse; the agent keeps it for its exit
            pass

    def _failed(self, key: NixlKey, err: BaseException) -> None:
        """A READ failed: a disconnected producer's metadata is dropped."""
        if "Disconnect" in type(err).__name__ or not pid_alive_on(key, self.node):
            self._forget(key.agent)

    def _drop_landing(self, land: int, scratch) -> None:
        if scratch is not None:
            scratch.close()
        elif self._landing is not None:
            self._landing.extents.pop(land, None)

    def _view_gone(self, land: int) -> None:
        with self._lock:
            if self._landing is not None and self._landing.extents.pop(land, None) is not None:
                self._leases -= 1

    def _free(self, handle: KVHandle) -> None:
        key: NixlKey = handle.key
        with self._lock:
            if key.agent == self.agent_name:
                self._release(key.gen)
                return
            if key.node == self.node and not pid_alive(key.owner_pid):
                return  # the producer is gone: it holds nothing any more
            try:
                outbox = self._outbox_region()
                outbox.data[:STAMP_BYTES].copy_(_stamp(key.gen))
                xfer = self._agent.initialize_xfer(
                    "WRITE", self._agent.get_xfer_descs(
                        [(outbox.addr, STAMP_BYTES, outbox.device_id)], outbox.mem),
                    self._agent.get_xfer_descs(
                        [(key.addr + key.nbytes + STAMP_BYTES, STAMP_BYTES, key.device_id)],
                        key.mem), self._remote(key))
                state = self._agent.transfer(xfer)
                deadline_s = time.monotonic() + _FREE_WAIT_S
                while state == "PROC" and time.monotonic() < deadline_s:  # TCP: short waits
                    state = self._agent.check_xfer_state(xfer)
                self._release_xfer(xfer)
            except Exception:  # the producer is gone: it holds nothing any more
                self._forget(key.agent)

    def num_held(self) -> int:
        with self._lock:
            self._reclaim()
            return (0 if self._arena is None else len(self._arena.extents)) + self._leases

    def close(self) -> None:
        """Stop the poller and deregister the buffers; handles given out can no longer be read."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            for region in (self._arena, self._landing, self._outbox):
                if region is not None:
                    try:
                        self._agent.deregister_memory(region.descs)
                    except Exception:
                        pass
            self._arena = self._landing = self._outbox = None


def _poll(ref: weakref.ref) -> None:
    """The producer's poller (module docstring, step 1); ends with its transport."""
    while True:
        transport = ref()
        if transport is None or transport._closed.is_set():
            return
        wake, closed = transport._wake, transport._closed
        wake.clear()  # before looking: a put from now on wakes the wait below
        busy = transport._poll_once()
        del transport  # hold no reference while asleep: the transport may be collected
        if closed.is_set():
            return
        if busy:
            time.sleep(PROGRESS_INTERVAL_S)
        else:
            wake.wait(_IDLE_WAIT_S)


class _Scratch:
    """A buffer registered for one READ (the landing buffer was full)."""

    def __init__(self, agent, length: int, device: torch.device):
        self.agent = agent
        self.data = torch.empty(length, dtype=torch.uint8, device=device)
        self.addr = self.data.data_ptr()
        self.descs = agent.register_memory(self.data)

    def take(self, nbytes: int) -> torch.Tensor:
        self.close()
        return self.data[:nbytes]

    def close(self) -> None:
        if self.descs is not None:
            try:
                self.agent.deregister_memory(self.descs)
            except Exception:
                pass
            self.descs = None


def pid_alive_on(key: NixlKey, node: str) -> bool:
    """False when ``key``'s producer is on ``node`` (this one) and its pid is gone."""
    return key.node != node or pid_alive(key.owner_pid)


def _as_u8(frame: Frame) -> torch.Tensor:
    """Frame 1 as a flat uint8 tensor without copying (it is only read)."""
    if isinstance(frame, torch.Tensor):
        return frame.detach().reshape(-1)
    view = memoryview(frame).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = np.frombuffer(view, dtype=np.uint8)
    return torch.from_numpy(array.copy() if view.readonly else array)


