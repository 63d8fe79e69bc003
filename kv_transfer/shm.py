"""``SharedMemoryTransport`` (``shm``): KV between processes of one node through a preallocated
shared-memory arena: one copy on put, none on get. Each producer owns one segment, a sparse
``/dev/shm`` file unlinked at once, so the kernel frees it when the last holder exits (a SIGKILLed
worker leaks nothing); consumers open ``/proc/<owner pid>/fd/<fd>`` and check its random token.
Layout: a 64-byte control block (magic ``PDLABKV1``, capacity, slots, offsets, token), a state
byte per slot (0 FREE, 1 READY), a u64 generation per slot, then page-aligned data.

- ``put``: reclaim FREE slots, take a slot and the first free extent that fits (retried each ms
  up to ``alloc_timeout_s``, then ``TransferFailed``), reserve pages with ``posix_fallocate`` (a
  full ``/dev/shm`` is ``TransferFailed``, never SIGBUS), copy the caller's tensor (any strides:
  the one copy), checksum the slot's bytes, bump the generation, store READY.
- ``get``: another node, a dead owner, or a slot not READY at the handle's generation is
  ``TransferFailed``. Returns a view (checksum verified in place) leasing the slot;
  ``zero_copy=False`` copies out.
- ``free``: READY -> FREE once ``free`` was called and this process's views are gone, so a caller
  may free right after ``get``. Repeats, or a reused slot, do nothing.
- A dead producer's segment (pid gone or reused) is dropped at the consumer's next call.

No cross-process lock: each transition has one writer (producer: READY, the handle's holder:
FREE), and x86-64 never makes a store visible before earlier loads."""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kv_transfer.extents import first_fit
from kv_transfer.extents import round_up as _round_up
from engine.kv_cache import KVSpec
from kv_transfer.payload import (DEFAULT_CHECKSUM_KIND, Frame, RankPart, checksum_of,
                                 encode_header, make_header)
from kv_transfer.transport import KVHandle, Transport, TransferFailed

MAGIC = b"PDLABKV1"
FREE, READY = 0, 1
PAGE = mmap.PAGESIZE
DEFAULT_CAPACITY = 1 << 30  # sparse: tmpfs commits only the pages that transfers touch
DEFAULT_SLOTS = 4096
_CONTROL = 64
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14; best effort


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def node_id() -> str:
    """This node's identity: host name plus kernel boot id (two nodes never share both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this node exists (``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmKey(NamedTuple):
    """Where a shared-memory transfer's bytes are: plain values, picklable."""

    path: str  # the segment's name: /proc/<owner pid>/fd/<fd>
    token: str
    node: str
    owner_pid: int
    slot: int
    gen: int
    offset: int
    nbytes: int
    header: bytes


class _Segment:
    """One mapped segment: the data area as a uint8 tensor plus the slot table."""

    def __init__(self, fd: int, path: str, create: bool, capacity: int = 0, num_slots: int = 0,
                 owner_pid: int | None = None):
        self.fd, self.path = fd, path
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        self.inode = os.fstat(fd).st_ino
        if create:
            gen_offset = _round_up(_CONTROL + num_slots, 8)
            data_offset = _round_up(gen_offset + 8 * num_slots, PAGE)
            os.ftruncate(fd, data_offset + capacity)
            os.posix_fallocate(fd, 0, data_offset)  # the control block and slot table
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        control = np.frombuffer(self.mm, dtype=np.uint64, count=5, offset=8)
        if create:
            control[:] = (capacity, num_slots, gen_offset, data_offset,
                          int.from_bytes(secrets.token_bytes(8), "little"))
            self.mm[:8] = MAGIC
        elif self.mm[:8] != MAGIC:
            raise TransferFailed(f"{path} is not a pdlab KV segment")
        self.capacity, self.num_slots, gen_offset, self.data_offset, token = (
            int(v) for v in control)
        self.token = f"{token:016x}"
        self.state = np.frombuffer(self.mm, dtype=np.uint8, count=self.num_slots, offset=_CONTROL)
        self.gen = np.frombuffer(self.mm, dtype=np.uint64, count=self.num_slots, offset=gen_offset)
        # a normal tensor even in the forward's inference mode (later puts write it)
        with torch.inference_mode(False):
            self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.data_offset,
                                         count=self.capacity)
        self.populated = 0  # data bytes from 0 already mapped into this process

    def populate(self, end: int, write: bool) -> None:
        """Map data pages up to ``end`` in one go (best effort: Linux >= 5.14)."""
        if end <= self.populated:
            return
        start = self.populated
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ,
                            self.data_offset + start, end - start)
        except (OSError, ValueError):
            pass
        self.populated = end

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A numpy view of data bytes ``[offset, offset + nbytes)`` (shares the mapping)."""
        return np.frombuffer(self.mm, dtype=np.uint8, count=nbytes,
                             offset=self.data_offset + offset)

    def release(self, slot: int, gen: int) -> None:
        """READY -> FREE if the slot still holds generation ``gen``."""
        if self.state[slot] == READY and int(self.gen[slot]) == gen:
            self.state[slot] = FREE

    def close(self) -> None:
        """Close the descriptor (once); the mapping lives while views of it do."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def owner_gone(self) -> bool:
        """The owner died, or its descriptor no longer names this file (pid reused)."""
        if not pid_alive(self.owner_pid):
            return True
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return True

    def unmap(self) -> None:
        """Close and drop this object's views; unmap unless a ``get`` tensor still views it."""
        self.close()
        self.state = self.gen = self.data = None
        try:
            self.mm.close()
        except BufferError:  # exported views remain: the mmap goes with the last of them
            pass


@dataclass
class _Lease:
    """This process's gets of one transfer: live views and whether ``free`` was called."""

    views: int = 0
    freed: bool = False


class SharedMemoryTransport(Transport):
    """KV through a per-producer shared-memory arena on one node (module docstring).
    ``capacity_bytes``: data bytes of this process's segment (sparse until used); ``num_slots``:
    transfers outstanding at once; ``zero_copy``: ``get`` returns a view, else a private copy."""

    name = "shm"
    copies_on_put = True  # ``_put_kv``

    def __init__(self, checksum: bool = True, capacity_bytes: int = DEFAULT_CAPACITY,
                 num_slots: int = DEFAULT_SLOTS, alloc_timeout_s: float = 10.0,
                 zero_copy: bool = True, directory: str | None = None):
        super().__init__(checksum)
        if capacity_bytes < PAGE or num_slots < 1:
            raise ValueError(f"capacity_bytes must be >= {PAGE} and num_slots >= 1, got "
                             f"{capacity_bytes} and {num_slots}")
        self.capacity = _round_up(capacity_bytes, PAGE)
        self.num_slots = num_slots
        self.alloc_timeout_s = alloc_timeout_s
        self.zero_copy = zero_copy
        self.directory = directory or _shm_dir()
        self.node = node_id()
        self._lock = threading.RLock()
        self._own: _Segment | None = None       # the segment this process puts into
        self._reserved = 0                       # data bytes of it backed by posix_fallocate
        self._allocated: dict[int, tuple[int, int, int]] = {}  # slot -> (offset, end, gen)
        self._mapped: dict[str, _Segment] = {}  # mapped segments (own included), by token
        self._leases: dict[tuple[str, int, int], _Lease] = {}  # (token, slot, gen)

    def rank_factory(self):
        """Its settings: each TP rank puts into its own segment, which any process opens."""
        return functools.partial(SharedMemoryTransport, checksum=self.checksum,
                                 capacity_bytes=self.capacity, num_slots=self.num_slots,
                                 alloc_timeout_s=self.alloc_timeout_s, zero_copy=self.zero_copy,
                                 directory=self.directory)

    @property
    def segment_name(self) -> str | None:
        """Name other processes open this process's segment by (None before the first put)."""
        return None if self._own is None else self._own.path

    def _segment(self) -> _Segment:
        if self._own is None:
            path = os.path.join(self.directory, f"pdlab-kv-{os.getpid()}-{secrets.token_hex(4)}")
            fd = -1
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.unlink(path)  # nameless from now on: freed with its last user
                self._own = _Segment(fd, f"/proc/{os.getpid()}/fd/{fd}", True, self.capacity,
                                     self.num_slots)
            except OSError as err:
                if fd >= 0:
                    os.close(fd)
                raise TransferFailed(f"cannot create a shared-memory segment in "
                                     f"{self.directory}: {err}") from err
            self._mapped[self._own.token] = self._own
        return self._own

    def _reclaim(self) -> None:
        seg = self._own
        if seg is None or not self._allocated:
            return
        slots = np.fromiter(self._allocated, dtype=np.int64, count=len(self._allocated))
        for slot in slots[seg.state[slots] == FREE].tolist():
            del self._allocated[slot]

    def _find_room(self, nbytes: int) -> tuple[int, int] | None:
        """(slot, offset) of a free slot and the lowest free extent of ``nbytes``, or None."""
        seg = self._own
        if len(self._allocated) >= seg.num_slots:
            return None
        offset = first_fit(((start, end) for start, end, _ in self._allocated.values()),
                           _round_up(max(nbytes, 1), PAGE), seg.capacity)
        if offset is None:
            return None
        # after a reclaim every slot handed out is READY, so any FREE slot is unallocated
        slot = int(np.argmin(seg.state))
        return (slot, offset) if seg.state[slot] == FREE else None

    def _reserve(self, end: int) -> None:
        """Back data bytes up to ``end`` with tmpfs pages (once) and map them here."""
        seg = self._own
        if end > self._reserved:
            try:
                os.posix_fallocate(seg.fd, seg.data_offset + self._reserved, end - self._reserved)
            except OSError as err:
                raise TransferFailed(f"no room in {self.directory} for {end} bytes of KV "
                                     f"arena ({err})") from err
            self._reserved = end
        seg.populate(end, write=True)

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> ShmKey:
        header, src = bytes(frames[0]), _as_u8(frames[1])
        nbytes = src.numel()
        with self._lock:
            seg, slot, offset, end = self._claim(request_id, nbytes)
            if nbytes:
                seg.data[offset:offset + nbytes].copy_(src)
            return self._commit(seg, slot, offset, end, nbytes, header)

    def _put_kv(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
                layer_start: int, dst_rank: int | None, part: RankPart) -> tuple[ShmKey, int]:
        """One copy of ``kv`` (any strides, any device) into its slot, then the checksum over
        the slot's bytes; a ``kv`` that does not match ``spec`` takes no slot."""
        header = make_header(request_id, spec, kv, token_start, layer_start, part=part)
        nbytes = header.num_bytes
        with self._lock:
            seg, slot, offset, end = self._claim(request_id, nbytes)
            dst = seg.data[offset:offset + nbytes]
            if nbytes:
                dst.view(kv.dtype).view(kv.shape).copy_(kv.detach())
            if self.checksum:
                header = dataclasses.replace(header, checksum=checksum_of(dst),
                                             checksum_kind=DEFAULT_CHECKSUM_KIND)
            return self._commit(seg, slot, offset, end, nbytes, encode_header(header)), nbytes

    def _claim(self, request_id: str, nbytes: int) -> tuple[_Segment, int, int, int]:
        """``(segment, slot, offset, end)`` of room for ``nbytes``, its pages reserved: waits up
        to ``alloc_timeout_s`` for a free slot and extent. Under ``_lock``; the slot stays FREE
        (nobody's) until ``_commit``.

        Raises:
            TransferFailed: larger than the arena, no room in time, or no pages for it."""
        self._drop_dead_peers()
        seg = self._segment()
        if nbytes > seg.capacity:
            raise TransferFailed(f"KV of request {request_id} ({nbytes} bytes) exceeds the "
                                 f"shared-memory arena ({seg.capacity} bytes)")
        deadline_s = time.monotonic() + self.alloc_timeout_s
        while True:
            self._reclaim()
            room = self._find_room(nbytes)
            if room is not None or time.monotonic() >= deadline_s:
                break
            time.sleep(0.001)
        if room is None:
            raise TransferFailed(
                f"shared-memory arena full for request {request_id}: {len(self._allocated)} "
                f"transfers hold it, none freed within {self.alloc_timeout_s} s "
                f"({nbytes} bytes needed of {seg.capacity})")
        slot, offset = room
        end = offset + _round_up(max(nbytes, 1), PAGE)
        self._reserve(end)
        return seg, slot, offset, end

    def _commit(self, seg: _Segment, slot: int, offset: int, end: int, nbytes: int,
                header: bytes) -> ShmKey:
        """Publish a claimed slot whose bytes are written: READY at a new generation."""
        gen = int(seg.gen[slot]) + 1
        seg.gen[slot] = gen
        seg.state[slot] = READY  # last: the slot is now the handle holder's
        self._allocated[slot] = (offset, end, gen)
        return ShmKey(seg.path, seg.token, self.node, os.getpid(), slot, gen, offset, nbytes,
                      header)

    def has_room(self, num_bytes: int) -> bool:
        """True when a put of ``num_bytes`` would find a slot and an extent now (after a reclaim).

        Raises:
            TransferFailed: ``num_bytes`` exceeds the whole arena."""
        with self._lock:
            seg = self._segment()
            if num_bytes > seg.capacity:
                raise TransferFailed(f"KV of {num_bytes} bytes exceeds the shared-memory arena "
                                     f"({seg.capacity} bytes)")
            self._reclaim()
            return self._find_room(num_bytes) is not None

    def _map(self, key: ShmKey, request_id: str) -> _Segment:
        if key.node != self.node:
            raise TransferFailed(f"KV of request {request_id} is in shared memory on node "
                                 f"{key.node}, this is {self.node}: use transport 'ray' to "
                                 "cross nodes")
        self._drop_dead_peers()
        seg = self._mapped.get(key.token)
        if key.owner_pid != os.getpid() and not pid_alive(key.owner_pid):
            raise TransferFailed(f"KV of request {request_id} is lost: its owner (pid "
                                 f"{key.owner_pid}) died")
        if seg is None:
            try:
                fd = os.open(key.path, os.O_RDWR)
            except OSError as err:
                raise TransferFailed(f"KV of request {request_id} is lost: segment {key.path} "
                                     f"cannot be opened ({err})") from None
            try:
                seg = _Segment(fd, key.path, create=False, owner_pid=key.owner_pid)
            except BaseException:
                os.close(fd)
                raise
            if seg.token != key.token:
                seg.close()
                raise TransferFailed(f"KV of request {request_id} is lost: {key.path} is no "
                                     "longer its owner's segment")
            self._mapped[key.token] = seg
        return seg

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        key: ShmKey = handle.key
        with self._lock:
            seg = self._map(key, handle.request_id)
            if seg.state[key.slot] != READY or int(seg.gen[key.slot]) != key.gen:
                raise TransferFailed(f"no KV for request {handle.request_id} in slot {key.slot} "
                                     f"of {key.path}: already freed")
            if seg is not self._own:
                seg.populate(key.offset + key.nbytes, write=False)
            array = seg.view(key.offset, key.nbytes)
            if not self.zero_copy:
                return [key.header, torch.from_numpy(array).clone()]
            lease_key = (key.token, key.slot, key.gen)
            lease = self._leases.setdefault(lease_key, _Lease())
            lease.views += 1
        weakref.finalize(array, self._view_gone, lease_key)
        return [key.header, torch.from_numpy(array)]

    def _view_gone(self, lease_key: tuple[str, int, int]) -> None:
        with self._lock:
            lease = self._leases.get(lease_key)
            if lease is None:
                return
            lease.views -= 1
            if lease.views == 0 and (lease.freed or lease_key[0] not in self._mapped):
                self._release(lease_key)  # a dead owner's segment: just forget the lease

    def _drop_dead_peers(self) -> int:
        dead = [token for token, seg in self._mapped.items()
                if seg is not self._own and seg.owner_gone()]
        for token in dead:
            for lease_key in [k for k, lease in self._leases.items()
                              if k[0] == token and lease.views == 0]:
                del self._leases[lease_key]
            self._mapped.pop(token).unmap()
        return len(dead)

    def release_dead_peers(self) -> int:
        """Drop dead producers' segments; returns how many. Runs at every put, get, free, num_held."""
        with self._lock:
            return self._drop_dead_peers()

    def _release(self, lease_key: tuple[str, int, int]) -> None:
        token, slot, gen = lease_key
        self._leases.pop(lease_key, None)
        seg = self._mapped.get(token)
        if seg is not None:
            seg.release(slot, gen)

    def _free(self, handle: KVHandle) -> None:
        key: ShmKey = handle.key
        lease_key = (key.token, key.slot, key.gen)
        with self._lock:
            lease = self._leases.get(lease_key)
            if lease is not None and lease.views > 0:
                lease.freed = True  # the last view's finalizer releases the slot
                return
            self._drop_dead_peers()
            if key.token not in self._mapped:
                try:
                    self._map(key, handle.request_id)
                except TransferFailed:
                    return  # owner or segment gone: nothing left to release
            self._release(lease_key)

    def num_held(self) -> int:
        with self._lock:
            self._drop_dead_peers()
            self._reclaim()
            own = None if self._own is None else self._own.token
            return len(self._allocated) + sum(1 for token, _, _ in self._leases if token != own)

    def close(self) -> None:
        """Close this process's descriptors (mappings stay until unused); no further puts."""
        with self._lock:
            for seg in self._mapped.values():
                seg.close()


def _as_u8(frame: Frame) -> torch.Tensor:
    """Frame 1 as a flat uint8 CPU tensor without copying (a read-only buffer is read in place)."""
    if isinstance(frame, torch.Tensor):
        return frame.detach().reshape(-1).cpu()
    view = memoryview(frame).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    array = np.frombuffer(view, dtype=np.uint8)
    if view.readonly:  # torch.from_numpy would warn; copy_ only reads it anyway
        array = array.copy()
    return torch.from_numpy(array)
