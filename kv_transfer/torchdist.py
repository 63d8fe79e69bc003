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
       On the receiver ``free`` has nothing to release.

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
from kv_transfer.transport import KVHandle, Transport, TransferFailed, TransferTimeout


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
        self._sends: set[int] = set()  # seqs of sends not yet received and not freed

    def num_held(self) -> int:
        with self._lock:
            return len(self._sends)

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
        header = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8).to(self.device)
        tensor_bytes = frames[1]
        seq = next(self._seq)
        works = [dist.isend(header, dst, tag=2 * seq)]
        if tensor_bytes.numel():
            works.append(dist.isend(tensor_bytes, dst, tag=2 * seq + 1))
        with self._lock:
            self._sends.add(seq)
        # The thread holds the buffers until the receiver has them (a gloo send cannot be
        # waited on with a timeout without breaking the pair, hence a blocking wait here).
        threading.Thread(target=self._wait_sent, args=(seq, works, [header, tensor_bytes]),
                         daemon=True, name=f"kv-send-{seq}").start()
        return P2PKey(self.rank, seq, header.numel(), tensor_bytes.numel())

    def _wait_sent(self, seq: int, works: list[dist.Work], buffers: list[torch.Tensor]) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError:
            pass  # peer gone: the receiver's get fails on its side
        with self._lock:
            self._sends.discard(seq)

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        key: P2PKey = handle.key
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
            timed_out = any(word in str(e).lower() for word in ("timed out", "timeout"))
            kind = TransferTimeout if timed_out else TransferFailed
            raise kind(f"KV for request {handle.request_id} from rank {key.src_rank} not "
                       f"received within {timeout_s} s: {e}") from e
        return [header.cpu().numpy().tobytes(), tensor_bytes]

    def _free(self, handle: KVHandle) -> None:
        if handle.key.src_rank == self.rank:
            with self._lock:
                self._sends.discard(handle.key.seq)
