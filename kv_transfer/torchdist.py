"""``TorchDistributedTransport``: KV point-to-point over ``torch.distributed`` (gloo or NCCL).
Every worker that moves KV is a rank of one group; ``open_rendezvous`` binds a ``TCPStore`` to a
port the kernel picks and returns ``store://host:port`` for every rank (no port chosen then bound).

- ``put(..., dst_rank=r)`` posts two non-blocking sends (header, bytes) tagged ``2*seq`` and
  ``2*seq+1``, ``seq`` counting per (sender, receiver); key ``P2PKey(src_rank, seq, header_nbytes,
  tensor_nbytes)``. The send uses ``kv``'s own memory: do not modify it after ``put``.
- ``get`` posts the matching receives and waits until the deadline (``TransferTimeout``). NCCL
  ignores tags and matches in posting order, so receives from a rank are posted in ``seq`` order.
- A daemon thread per send releases its buffers once the host knows it completed.
- Nothing can cancel a posted send or receive: ``free`` on a receiver drains an unreceived handle
  into scratch; a failed or timed-out transfer marks the pair broken (later gets raise
  ``TransferFailed``); ``free`` on the sender breaks an NCCL pair (a small NCCL send completes
  before any receive is posted, NVIDIA/nccl#544), a gloo send stays posted until drained.

gloo moves host tensors; NCCL keeps the bytes on the GPU. Tests pass a fake out-of-order ``p2p``."""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from engine.kv_cache import KVSpec
from kv_transfer.payload import WHOLE, Frame, RankPart, pack_tensor
from kv_transfer.transport import (KVHandle, Transport, TransferError, TransferFailed,
                                   TransferTimeout)


STORE_SCHEME = "store://"


def open_rendezvous(host: str = "127.0.0.1", timeout_s: float = 60.0) -> tuple[dist.TCPStore, str]:
    """A rendezvous store on ``host`` at a kernel-picked port, and ``store://host:port`` for every
    rank's ``init_method``; keep the store alive until the group has formed.

    Raises:
        RuntimeError (``torch.distributed.DistNetworkError``): ``host`` cannot be bound."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{STORE_SCHEME}{host}:{store.port}"


def _init_group(backend: str, init_method: str, rank: int, world_size: int,
                timeout_s: float) -> None:
    """``init_process_group``; ``store://host:port`` joins an ``open_rendezvous`` store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if not init_method.startswith(STORE_SCHEME):
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    host, _, port = init_method[len(STORE_SCHEME):].rpartition(":")
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


class P2PKey(NamedTuple):
    """Source, place in the pair's sequence, both messages' sizes, destination (-1: not said)."""

    src_rank: int
    seq: int
    header_nbytes: int
    tensor_nbytes: int
    dst_rank: int = -1


NCCL_POLL_MAX_S = 0.01  # longest sleep between two polls of an NCCL work's completion


@dataclass
class _Receive:
    """The receives of one handle (a ``get`` or a drain), posted in the pair's order."""

    key: P2PKey
    request_id: str
    drain: bool
    posted: threading.Event = field(default_factory=threading.Event)
    buffers: list[torch.Tensor] = field(default_factory=list)  # header, tensor bytes
    works: list = field(default_factory=list)
    error: TransferError | None = None  # set instead of works when it cannot be posted


class TorchDistributedTransport(Transport):
    """Point-to-point KV transfer between ranks of one process group.

    ``init_method``: ``store://host:port`` (``open_rendezvous``) or torch's own; None: the group
    exists. ``device``: where received tensors land (``cpu`` for gloo, ``cuda:i`` for NCCL).
    ``checksum`` with NCCL costs a device-to-host copy per side. ``init_timeout_s``: deadline for
    forming the group (and for a drain). ``p2p``: ``isend`` / ``irecv`` returning works with
    ``wait(timeout=None)`` and ``is_completed()`` (default ``torch.distributed``).

    Raises:
        ValueError: an unknown backend."""

    name = "torchdist"

    def __init__(self, rank: int, world_size: int, backend: str = "gloo",
                 init_method: str | None = None, device: str = "cpu",
                 dst_rank: int | None = None, checksum: bool = True,
                 init_timeout_s: float = 60.0, p2p: Any = None):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(checksum)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self.dst_rank = dst_rank
        self._p2p = dist if p2p is None else p2p
        if init_method is not None and p2p is None and not dist.is_initialized():
            _init_group(backend, init_method, rank, world_size, init_timeout_s)
        self._lock = threading.Lock()  # the state below
        self._send_lock = threading.Lock()  # a pair's sends are posted in seq order
        self._post_lock = threading.Lock()  # receives are posted in one place (in order)
        self._next_send: dict[int, int] = {}  # dst rank -> seq of the next put to it
        self._sends: set[tuple[int, int]] = set()  # (dst, seq) of sends not completed
        self._orphans: set[tuple[int, int]] = set()  # of those, freed here before completing
        self._next_post: dict[int, int] = {}  # src rank -> seq whose receive is posted next
        self._parked: dict[int, dict[int, _Receive]] = {}  # src -> seq -> waiting its turn
        self._done: set[tuple[int, int]] = set()  # gloo: (src, seq) posted here (any order)
        self._broken: dict[int, str] = {}  # peer rank -> why the pair with it is unusable
        self._stranded: list[torch.Tensor] = []  # buffers of receives that may still land
        self.drain_timeout_s = init_timeout_s

    @property
    def ordered_gets(self) -> bool:
        return self.backend == "nccl"  # NCCL matches messages in order, ignoring tags

    def num_held(self) -> int:
        """Sends not yet seen complete, less those freed here (``num_orphaned_sends``)."""
        with self._lock:
            return len(self._sends) - len(self._orphans)

    def num_orphaned_sends(self) -> int:
        """Sends freed on this (sending) side before they completed."""
        with self._lock:
            return len(self._orphans)

    def broken_peers(self) -> dict[int, str]:
        """Peer rank -> why transfers with it fail (see the module docstring)."""
        with self._lock:
            return dict(self._broken)

    def _check_pair(self, peer: int, request_id: str) -> None:
        reason = self._broken.get(peer)
        if reason is not None:
            raise TransferFailed(f"KV of request {request_id}: the torch.distributed pair "
                                 f"{self.rank}<->{peer} is broken ({reason}); restart the "
                                 "placement to use it again")

    def _mark_broken(self, peer: int, reason: str) -> None:
        """Record why the pair is unusable (first reason) and fail its waiting receives."""
        with self._lock:
            self._broken.setdefault(peer, reason)
            parked = list(self._parked.pop(peer, {}).values())
        for receive in parked:
            receive.error = TransferFailed(f"KV of request {receive.request_id}: the "
                                           f"torch.distributed pair {self.rank}<->{peer} "
                                           f"broke while it waited ({reason})")
            receive.posted.set()

    def close(self) -> None:
        """Destroy the process group (call once per process, after the last transfer)."""
        if self._p2p is dist and dist.is_initialized():
            dist.destroy_process_group()

    def _wait_host(self, work, deadline_s: float | None = None) -> None:
        """Return once the host knows ``work`` completed. gloo: ``work.wait`` blocks. NCCL:
        ``wait`` only orders the current stream, so ``is_completed()`` is polled (sleeps doubling
        from 0.1 ms to ``NCCL_POLL_MAX_S``), then ``wait`` surfaces an error.

        Raises:
            RuntimeError: the work failed, or ``deadline_s`` (``time.monotonic``) passed."""
        if self.backend != "nccl":
            if deadline_s is None:
                work.wait()
            else:
                left_s = max(deadline_s - time.monotonic(), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left_s))
            return
        sleep_s = 1e-4
        while not work.is_completed():
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise RuntimeError("NCCL work timed out")
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, NCCL_POLL_MAX_S)
        work.wait()

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int, part: RankPart = WHOLE) -> list[Frame]:
        header, tensor_bytes = pack_tensor(request_id, spec, kv.to(self.device), token_start,
                                           layer_start, self.checksum, part)
        return [header, tensor_bytes]

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> P2PKey:
        dst = self.dst_rank if dst_rank is None else dst_rank
        if dst is None or dst == self.rank or not 0 <= dst < self.world_size:
            raise TransferFailed(f"put of request {request_id} needs a dst_rank in "
                                 f"[0, {self.world_size}) other than {self.rank}, got {dst}")
        header = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).to(self.device)
        tensor_bytes = frames[1]
        with self._send_lock:  # seq order is posting order: NCCL matches in that order
            with self._lock:
                self._check_pair(dst, request_id)
                seq = self._next_send.get(dst, 0)
                self._next_send[dst] = seq + 1
            try:
                works = [self._p2p.isend(header, dst, tag=2 * seq)]
                if tensor_bytes.numel():
                    works.append(self._p2p.isend(tensor_bytes, dst, tag=2 * seq + 1))
            except RuntimeError as err:  # seq is spent: the receiver would wait for it
                reason = f"the send of request {request_id} to rank {dst} failed: " \
                         f"{str(err).splitlines()[0]}"
                self._mark_broken(dst, reason)
                raise TransferFailed(f"KV of request {request_id}: {reason}") from err
            with self._lock:
                self._sends.add((dst, seq))
        threading.Thread(target=self._wait_sent,
                         args=(seq, dst, request_id, works, [header, tensor_bytes]),
                         daemon=True, name=f"kv-send-{dst}-{seq}").start()
        return P2PKey(self.rank, seq, header.numel(), tensor_bytes.numel(), dst)

    def _wait_sent(self, seq: int, dst: int, request_id: str, works: list,
                   buffers: list[torch.Tensor]) -> None:
        try:
            for work in works:
                self._wait_host(work)
        except RuntimeError as err:  # peer gone or pair closed: later puts fail clearly
            self._mark_broken(dst, f"the send of request {request_id} to rank {dst} failed: "
                                   f"{str(err).splitlines()[0]}")
        with self._lock:
            self._sends.discard((dst, seq))
            self._orphans.discard((dst, seq))

    def _free_sent(self, key: P2PKey, handle: KVHandle, dst: int) -> None:
        """``free`` on the sender: its producer got the handle back, so no receiver took it."""
        if self.backend == "nccl":  # see the module docstring: never posted = misaligned
            with self._lock:
                if (dst, key.seq) in self._sends:
                    self._orphans.add((dst, key.seq))
            self._mark_broken(dst, f"the send of request {handle.request_id} to rank {dst} "
                                   "was freed before it was received; NCCL matches in order")
            return
        with self._lock:  # gloo: tagged, other transfers stay unaffected
            if (dst, key.seq) in self._sends:
                self._orphans.add((dst, key.seq))

    def _post_in_order(self, key: P2PKey, request_id: str, drain: bool) -> _Receive:
        """Register ``key``'s receives and post them in the pair's order (NCCL) or at once (gloo).

        Raises:
            TransferFailed: the pair is broken, or ``key`` was already received or drained."""
        receive = _Receive(key, request_id, drain)
        src = key.src_rank
        if key.dst_rank not in (-1, self.rank):
            raise TransferFailed(f"KV of request {request_id} was sent to rank {key.dst_rank}, "
                                 f"not to this rank {self.rank}")
        with self._lock:
            self._check_pair(src, request_id)
            next_seq = self._next_post.get(src, 0)
            parked = self._parked.setdefault(src, {})
            if ((src, key.seq) in self._done or key.seq in parked
                    or (self.ordered_gets and key.seq < next_seq)):
                raise TransferFailed(f"KV of request {request_id} (rank {src}, seq "
                                     f"{key.seq}) was already received or drained here")
            parked[key.seq] = receive
        self._post_ready(src)
        return receive

    def _post_ready(self, src: int) -> None:
        """Post every parked receive from ``src`` whose turn has come, in seq order."""
        with self._post_lock:
            while True:
                with self._lock:
                    parked = self._parked.get(src, {})
                    if self.ordered_gets:
                        seq = self._next_post.get(src, 0)
                        receive = parked.pop(seq, None)
                        if receive is None:
                            return
                        self._next_post[src] = seq + 1
                    elif parked:  # gloo: tags keep transfers apart, any order will do
                        receive = parked.pop(next(iter(parked)))
                        self._done.add((src, receive.key.seq))
                    else:
                        return
                self._post(receive)

    def _post(self, receive: _Receive) -> None:
        """Allocate and post the receives of one handle (under ``_post_lock``)."""
        key = receive.key
        header = torch.empty(key.header_nbytes, dtype=torch.uint8, device=self.device)
        tensor_bytes = torch.empty(key.tensor_nbytes, dtype=torch.uint8, device=self.device)
        try:
            works = [self._p2p.irecv(header, key.src_rank, tag=2 * key.seq)]
            if key.tensor_nbytes:
                works.append(self._p2p.irecv(tensor_bytes, key.src_rank, tag=2 * key.seq + 1))
        except RuntimeError as err:
            reason = f"posting the receive of request {receive.request_id} failed: " \
                     f"{str(err).splitlines()[0]}"
            receive.error = TransferFailed(f"KV of request {receive.request_id}: {reason}")
            receive.posted.set()
            self._mark_broken(key.src_rank, reason)
            return
        receive.buffers, receive.works = [header, tensor_bytes], works
        receive.posted.set()
        if receive.drain:
            threading.Thread(target=self._finish_drain, args=(receive,), daemon=True,
                             name=f"kv-drain-{key.src_rank}-{key.seq}").start()

    def _complete(self, receive: _Receive, timeout_s: float, deadline_s: float) -> None:
        """Wait for ``receive``'s posted receives until ``deadline_s``.

        Raises:
            TransferTimeout, TransferFailed: and the pair is marked broken."""
        key = receive.key
        try:
            for work in receive.works:
                self._wait_host(work, deadline_s)
        except RuntimeError as e:
            with self._lock:
                self._stranded += receive.buffers  # a late message may still land
            timed_out = any(word in str(e).lower() for word in ("timed out", "timeout"))
            self._mark_broken(key.src_rank, f"the receive of request {receive.request_id} from "
                                            f"rank {key.src_rank} "
                                            f"{'timed out' if timed_out else 'failed'} after "
                                            f"{timeout_s} s")
            kind = TransferTimeout if timed_out else TransferFailed
            raise kind(f"KV for request {receive.request_id} from rank {key.src_rank} not "
                       f"received within {timeout_s} s: {e}") from e

    def _receive(self, key: P2PKey, request_id: str, timeout_s: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        deadline_s = time.monotonic() + timeout_s
        receive = self._post_in_order(key, request_id, drain=False)
        if not receive.posted.wait(max(deadline_s - time.monotonic(), 0.0)):
            with self._lock:
                parked = self._parked.get(key.src_rank, {})
                withdrawn = parked.get(key.seq) is receive
                if withdrawn:
                    del parked[key.seq]
                waiting_for = self._next_post.get(key.src_rank, 0)
            if withdrawn:  # never posted; the pair's order now has a hole
                self._mark_broken(key.src_rank, f"the KV of request {request_id} (seq {key.seq}) "
                                                f"waited {timeout_s} s for rank {key.src_rank}'s "
                                                f"transfer seq {waiting_for}, which was neither "
                                                "received nor freed here")
                raise TransferTimeout(f"KV for request {request_id} from rank {key.src_rank} "
                                      f"not received within {timeout_s} s: its receive waited "
                                      f"for transfer seq {waiting_for} of that rank, which was "
                                      "neither received nor freed here (NCCL matches in order)")
            receive.posted.wait()  # posted just now, by another thread
        if receive.error is not None:
            raise receive.error
        self._complete(receive, timeout_s, deadline_s)
        return receive.buffers[0], receive.buffers[1]

    def _finish_drain(self, receive: _Receive) -> None:
        try:
            self._complete(receive, self.drain_timeout_s,
                           time.monotonic() + self.drain_timeout_s)
        except TransferError:
            pass  # the pair is now marked broken

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        header, tensor_bytes = self._receive(handle.key, handle.request_id, timeout_s)
        return [header.cpu().numpy().tobytes(), tensor_bytes]

    def _free(self, handle: KVHandle) -> None:
        key: P2PKey = handle.key
        if key.src_rank == self.rank:  # sender side
            if key.dst_rank >= 0:
                self._free_sent(key, handle, key.dst_rank)
            return
        with self._lock:  # receiver side: drain a send it will never get otherwise
            if key.src_rank in self._broken:
                return
        try:
            self._post_in_order(key, handle.request_id, drain=True)
        except TransferFailed:
            pass  # already received or drained here, or the pair is broken
