"""``TorchDistributedTransport``: KV point-to-point over ``torch.distributed`` (gloo or NCCL).

Setup: every worker that sends or receives KV is a rank of one process group (the
placement creates it: e.g. prefill workers ranks ``0..x-1``, decode workers ``x..x+y-1``).
Pass ``init_method`` to have the constructor call ``init_process_group``, or create the
group yourself first. The rendezvous port is chosen where it is bound: ``open_rendezvous``
binds a ``TCPStore`` to port 0 (the kernel picks a free port and the store holds it) in the
process that sets the group up, and returns ``store://host:port``; every rank joins it as a
client. No port is picked first and bound later, so another process taking it in between
cannot break start-up (``tcp://host:port``, where rank 0 binds a port chosen beforehand,
still works for callers that own the port).

Lifecycle:
    1. ``put(..., dst_rank=r)`` on the sender posts two non-blocking sends to rank ``r``:
       the msgpack header, then the tensor bytes, tagged ``2*seq`` and ``2*seq+1``. It
       returns at once; the handle's key is ``P2PKey(src_rank, seq, header_nbytes,
       tensor_nbytes)`` (plain ints), so the receiver can allocate before receiving.
    2. The handle reaches the receiver through the control path (router / actor call).
    3. ``get`` on rank ``r`` posts the matching receives from ``src_rank`` and waits for them
       until the deadline (``TransferTimeout`` after it; the pending receive then poisons the
       pair, so treat the group as broken). Each handle can be received once.
    4. A daemon thread per send waits for it to complete, then releases the send buffers;
       ``num_held()`` counts sends not yet received (nor given up by ``free`` on the sender).
       On the receiver ``free`` of a handle it received has nothing to release.

Sends that can no longer be matched (a posted send or receive cannot be withdrawn: neither
gloo nor NCCL can cancel one):
    - ``free`` on the receiver of a handle it never received (request aborted or failed
      before its fetch) **drains** it: a background receive matches the send into a scratch
      buffer and drops it, so the sender's buffers are released and NCCL's in-order
      matching stays aligned. A drain that fails marks the pair broken.
    - A receive that times out or fails marks the pair (sender rank -> this rank) broken:
      gloo closes the pair, and a late NCCL message would land in a stale buffer. Later
      gets from that rank raise ``TransferFailed`` naming the first failure. Puts whose
      send fails mark the pair broken on the sender side the same way.
    - ``free`` on the sender of a send not yet received: with NCCL the pair is marked
      broken (every later message would be matched to the wrong receive); with gloo, whose
      tags keep other transfers apart, the send stays posted (``num_orphaned_sends``)
      until the receiver drains it or the group is destroyed. Free late handles on the
      receiving rank when it lives.

Zero copy: the sender's buffer is ``kv``'s own memory (when contiguous on ``device``), kept
alive by the transport until sent; do not modify ``kv`` in place after ``put``.

``backend='gloo'`` moves host tensors; ``backend='nccl'`` keeps the tensor bytes on the GPU
(``device='cuda:i'``): nothing is staged on the host except the header. NCCL ignores tags
and matches messages in order, so with NCCL a receiver must get handles from one sender in
the order they were put.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.kv_cache import KVSpec
from kv_transfer.payload import Frame, pack_tensor
from kv_transfer.transport import (KVHandle, Transport, TransferError, TransferFailed,
                                   TransferTimeout)


STORE_SCHEME = "store://"


def open_rendezvous(host: str = "127.0.0.1", timeout_s: float = 60.0) -> tuple[dist.TCPStore, str]:
    """A rendezvous store listening on ``host`` at a port the kernel picks as it binds.

    Keep the returned store alive (it is the group's rendezvous) until the ranks have
    formed the group; pass the returned ``store://host:port`` as every rank's ``init_method``.

    Raises:
        RuntimeError (``torch.distributed.DistNetworkError``): ``host`` cannot be bound.
    """
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{STORE_SCHEME}{host}:{store.port}"


def _init_group(backend: str, init_method: str, rank: int, world_size: int,
                timeout_s: float) -> None:
    """``init_process_group`` through ``init_method``: ``store://host:port`` joins a store
    from ``open_rendezvous`` as a client; anything else goes to torch unchanged."""
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
    """Where a point-to-point transfer comes from and how big its two messages are."""

    src_rank: int
    seq: int
    header_nbytes: int
    tensor_nbytes: int


class TorchDistributedTransport(Transport):
    """Point-to-point KV transfer between ranks of one process group.

    Args:
        rank, world_size: this process's rank and the group size.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        init_method: ``store://host:port`` from ``open_rendezvous`` (or torch's own, e.g.
            ``tcp://127.0.0.1:29500``); None = the group already exists.
        device: where received tensors land (``cpu`` for gloo, ``cuda:i`` for NCCL).
        dst_rank: default receiver for ``put`` when it names none.
        checksum: CRC32 in the header (with NCCL this costs a device-to-host copy per side).
        init_timeout_s: deadline for forming the group.
    """

    name = "torchdist"

    def __init__(self, rank: int, world_size: int, backend: str = "gloo",
                 init_method: str | None = None, device: str = "cpu",
                 dst_rank: int | None = None, checksum: bool = True,
                 init_timeout_s: float = 60.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(checksum)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self.dst_rank = dst_rank
        if init_method is not None and not dist.is_initialized():
            _init_group(backend, init_method, rank, world_size, init_timeout_s)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._sends: dict[int, int] = {}  # seq -> dst rank of sends not yet received nor freed
        self._orphans: dict[int, int] = {}  # seq -> dst of sends freed here before received
        self._done: set[tuple[int, int]] = set()  # (src, seq) received or drained here
        self._broken: dict[int, str] = {}  # peer rank -> why the pair with it is unusable
        self._stranded: list[torch.Tensor] = []  # buffers of receives that may still land
        self.drain_timeout_s = init_timeout_s

    @property
    def ordered_gets(self) -> bool:
        return self.backend == "nccl"  # NCCL matches messages in order, ignoring tags

    def num_held(self) -> int:
        with self._lock:
            return len(self._sends)

    def num_orphaned_sends(self) -> int:
        """gloo sends freed on this (sending) side before their receiver took them."""
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
        with self._lock:
            self._broken.setdefault(peer, reason)

    def close(self) -> None:
        """Destroy the process group (call once per process, after the last transfer)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int) -> list[Frame]:
        header, tensor_bytes = pack_tensor(request_id, spec, kv.to(self.device), token_start,
                                           layer_start, self.checksum)
        return [header, tensor_bytes]

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> P2PKey:
        dst = self.dst_rank if dst_rank is None else dst_rank
        if dst is None or dst == self.rank or not 0 <= dst < self.world_size:
            raise TransferFailed(f"put of request {request_id} needs a dst_rank in "
                                 f"[0, {self.world_size}) other than {self.rank}, got {dst}")
        self._check_pair(dst, request_id)
        header = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).to(self.device)
        tensor_bytes = frames[1]
        seq = next(self._seq)
        works = [dist.isend(header, dst, tag=2 * seq)]
        if tensor_bytes.numel():
            works.append(dist.isend(tensor_bytes, dst, tag=2 * seq + 1))
        with self._lock:
            self._sends[seq] = dst
        # The thread holds the buffers until the receiver has them (a gloo send cannot be
        # waited on with a timeout without breaking the pair, hence a blocking wait here).
        threading.Thread(target=self._wait_sent,
                         args=(seq, dst, request_id, works, [header, tensor_bytes]),
                         daemon=True, name=f"kv-send-{seq}").start()
        return P2PKey(self.rank, seq, header.numel(), tensor_bytes.numel())

    def _wait_sent(self, seq: int, dst: int, request_id: str, works: list[dist.Work],
                   buffers: list[torch.Tensor]) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as err:  # peer gone or pair closed: later puts fail clearly
            self._mark_broken(dst, f"the send of request {request_id} to rank {dst} failed: "
                                   f"{str(err).splitlines()[0]}")
        with self._lock:
            self._sends.pop(seq, None)
            self._orphans.pop(seq, None)

    def _receive(self, key: P2PKey, request_id: str, timeout_s: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Post and wait for both receives of ``key``; a failure marks the pair broken."""
        with self._lock:
            self._check_pair(key.src_rank, request_id)
            if (key.src_rank, key.seq) in self._done:
                raise TransferFailed(f"KV of request {request_id} (rank {key.src_rank}, seq "
                                     f"{key.seq}) was already received or drained here")
            self._done.add((key.src_rank, key.seq))
        header = torch.empty(key.header_nbytes, dtype=torch.uint8, device=self.device)
        tensor_bytes = torch.empty(key.tensor_nbytes, dtype=torch.uint8, device=self.device)
        works = [dist.irecv(header, key.src_rank, tag=2 * key.seq)]
        if key.tensor_nbytes:
            works.append(dist.irecv(tensor_bytes, key.src_rank, tag=2 * key.seq + 1))
        deadline_s = time.monotonic() + timeout_s
        try:
            for work in works:
                left_s = max(deadline_s - time.monotonic(), 1e-3)
                work.wait(timeout=datetime.timedelta(seconds=left_s))
        except RuntimeError as e:
            with self._lock:
                self._stranded += [header, tensor_bytes]  # a late message may still land
            timed_out = any(word in str(e).lower() for word in ("timed out", "timeout"))
            self._mark_broken(key.src_rank, f"the receive of request {request_id} from rank "
                                            f"{key.src_rank} {'timed out' if timed_out else 'failed'}"
                                            f" after {timeout_s} s")
            kind = TransferTimeout if timed_out else TransferFailed
            raise kind(f"KV for request {request_id} from rank {key.src_rank} not "
                       f"received within {timeout_s} s: {e}") from e
        return header, tensor_bytes

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        header, tensor_bytes = self._receive(handle.key, handle.request_id, timeout_s)
        return [header.cpu().numpy().tobytes(), tensor_bytes]

    def _free(self, handle: KVHandle) -> None:
        key: P2PKey = handle.key
        if key.src_rank == self.rank:  # sender side
            with self._lock:
                dst = self._sends.pop(key.seq, None)
                if dst is None:
                    return
                if self.backend != "nccl":
                    self._orphans[key.seq] = dst  # tagged: other transfers stay unaffected
                    return
            self._mark_broken(dst, f"the send of request {handle.request_id} to rank {dst} "
                                   "was freed before it was received; NCCL matches in order")
            return
        with self._lock:  # receiver side: drain a send it will never get otherwise
            if (key.src_rank, key.seq) in self._done or key.src_rank in self._broken:
                return
        threading.Thread(target=self._drain, args=(key, handle.request_id), daemon=True,
                         name=f"kv-drain-{key.src_rank}-{key.seq}").start()

    def _drain(self, key: P2PKey, request_id: str) -> None:
        try:
            self._receive(key, request_id, self.drain_timeout_s)
        except TransferError:
            pass  # already drained, or the pair is (now) marked broken
