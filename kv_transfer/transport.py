"""The KV transfer protocol every transport implements. The prefill side's ``put(request_id, spec,
kv)`` packs the KV ``[L', 2, H_kv, T, D]`` (``payload``'s wire format), hands it over and returns a
small picklable ``KVHandle`` (the router passes handles, never bytes). The decode side's
``get(handle, expected_spec, timeout_s)`` fetches it within the deadline, checks it against its
``KVSpec`` and checksum, returns ``(KVHeader, kv)`` and appends one ``TransferRecord``. The last
holder of a handle calls ``free``. Errors: ``TransferTimeout``, ``TransferFailed`` (bytes gone:
freed, owner died, put failed), ``payload.KVSpecMismatch``, ``payload.KVChecksumError``.

``achieved_gbps = num_bytes / (put_s + get_s) / 1e9``; ``efficiency = achieved_gbps / peak_gbps``
(``kv_transfer.link``'s peak, or None). A request's chunks form a stream, ``ready`` when the put
of its last chunk began: of each chunk's put and get, ``exposed_s`` is the part after ``ready``
(critical path), ``overlapped_s`` the part before, summing to ``put_s + get_s`` (None until the
last chunk is got; the stamps are two processes' wall clocks)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch

from engine.kv_cache import KVSpec
from kv_transfer.payload import WHOLE, Frame, KVHeader, RankPart, pack, unpack


class TransferError(RuntimeError):
    """Base class of transport failures."""


class TransferTimeout(TransferError):
    """The KV did not arrive before the deadline."""


class TransferFailed(TransferError):
    """The transfer cannot complete: put failed, handle freed or unknown, owner/peer died."""


@dataclass(frozen=True)
class KVHandle:
    """Opaque reference to KV held by a transport; small and picklable.

    ``key``: transport-specific locator; ``num_bytes``: tensor bytes (frame 1),
    ``spec.kv_bytes(T, L')``; ``put_s``: seconds inside ``put``; ``put_time_s``: ``time.time()``
    when ``put`` began (0.0 unknown); ``decode_rank``: the decode rank its heads go to
    (``RankPart``); ``put_pid``: the process that put it (0 unknown)."""

    transport: str
    request_id: str
    key: Any
    num_bytes: int
    put_s: float
    put_time_s: float = 0.0
    decode_rank: int = 0
    put_pid: int = 0


@dataclass(frozen=True)
class TransferRecord:
    """One completed transfer (one chunk of a request), appended by ``get``. ``put_s``, ``get_s``:
    seconds inside each; ``*_time_s``: ``time.time()`` when they began; ``layer_start``,
    ``layer_end``: ``[start, end)``; ``num_messages``: wire messages (NIXL: descriptors);
    ``achieved_gbps``, ``efficiency``, ``exposed_s``, ``overlapped_s``: module docstring;
    ``prefill_rank`` sent KV heads ``[head_start, head_end)`` to ``decode_rank``; ``put_pid``,
    ``get_pid``: the processes that put and got them (a TP instance's rank processes)."""

    request_id: str
    num_bytes: int
    put_s: float
    get_s: float
    transport: str
    put_time_s: float = 0.0
    get_time_s: float = 0.0
    layer_start: int = 0
    layer_end: int = 0
    num_messages: int = 1
    achieved_gbps: float = 0.0
    peak_gbps: float | None = None
    efficiency: float | None = None
    exposed_s: float | None = None
    overlapped_s: float | None = None
    prefill_rank: int = 0
    decode_rank: int = 0
    head_start: int = 0
    head_end: int = 0
    put_pid: int = 0
    get_pid: int = 0


def split_exposed(records: list[TransferRecord]) -> list[TransferRecord]:
    """``records`` (one request's chunks) with ``exposed_s`` and ``overlapped_s`` set."""
    last = max(records, key=lambda r: r.layer_end)
    ready_s = last.put_time_s

    def after(start_s: float, length_s: float) -> float:
        lead_s = ready_s - start_s  # > 0: the interval began before the KV was ready
        return length_s if lead_s <= 0 else max(0.0, length_s - lead_s)

    out = []
    for r in records:
        exposed_s = min(after(r.put_time_s, r.put_s) + after(r.get_time_s, r.get_s),
                        r.put_s + r.get_s)
        out.append(dataclasses.replace(r, exposed_s=exposed_s,
                                       overlapped_s=r.put_s + r.get_s - exposed_s))
    return out


def frame_nbytes(frame: Frame) -> int:
    """Byte length of a frame (bytes-like or flat uint8 tensor)."""
    return frame.numel() if isinstance(frame, torch.Tensor) else memoryview(frame).nbytes


class Transport(ABC):
    """Moves packed KV from a put side to a get side. ``checksum``: a CRC of the tensor bytes in
    the header, verified on get."""

    name = "transport"
    # gets from one sender must follow its puts' order (NCCL): the decode worker uses one thread
    ordered_gets = False
    # ``put`` has copied ``kv``'s bytes when it returns, whatever its strides: a caller may pass
    # a view of its KV cache and reuse that memory at once (else it passes a copy it gives up)
    copies_on_put = False

    def __init__(self, checksum: bool = True):
        self.checksum = checksum
        self.records: list[TransferRecord] = []
        self.peak_gbps: float | None = None
        self._records_lock = threading.Lock()  # decode workers get on several threads
        self._streams: dict[tuple, list[int]] = {}  # (request, part) -> its open stream's indices

    def has_room(self, num_bytes: int) -> bool:
        """Whether a ``put`` of ``num_bytes`` would be taken now without waiting for buffer space
        (a producer that checks never blocks: it keeps the KV and retries). Unbounded: always.

        Raises:
            TransferFailed: ``num_bytes`` can never fit this transport's buffer."""
        return True

    def put(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
            layer_start: int = 0, dst_rank: int | None = None,
            part: RankPart = WHOLE) -> KVHandle:
        """Hand over ``kv`` ``[L', 2, H', T, D]`` (tokens from ``token_start``, layers from
        ``layer_start``, the heads and ranks of ``part``: all heads by default); ``dst_rank``:
        the receiving worker, for point-to-point transports.

        Raises:
            ValueError: ``kv`` does not match ``spec``. TransferFailed: the transport refused."""
        start_time_s, start_s = time.time(), time.perf_counter()
        key, num_bytes = self._put_kv(request_id, spec, kv, token_start, layer_start, dst_rank,
                                      part)
        return KVHandle(self.name, request_id, key, num_bytes, time.perf_counter() - start_s,
                        start_time_s, part.decode_rank, os.getpid())

    def _put_kv(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
                layer_start: int, dst_rank: int | None, part: RankPart) -> tuple[Any, int]:
        """``put``'s work: ``(the handle's key, bytes of frame 1)``. By default ``_pack`` then
        ``_put_frames``; a transport that copies ``kv`` straight into its own buffer overrides
        it (and sets ``copies_on_put``)."""
        frames = self._pack(request_id, spec, kv, token_start, layer_start, part)
        return self._put_frames(request_id, frames, dst_rank), frame_nbytes(frames[1])

    def get(self, handle: KVHandle, expected: KVSpec, timeout_s: float
            ) -> tuple[KVHeader, torch.Tensor]:
        """``(header, kv)`` of ``handle``, ``kv`` ``[L', 2, H_kv, T, D]``, within ``timeout_s`` s.

        Raises:
            TransferTimeout, TransferFailed, KVSpecMismatch, KVChecksumError."""
        start_time_s, start_s = time.time(), time.perf_counter()
        frames = self._get_frames(handle, timeout_s)
        header, kv = unpack(frames, expected)
        get_s = time.perf_counter() - start_s
        num_bytes = frame_nbytes(frames[1])
        total_s = handle.put_s + get_s
        achieved = num_bytes / total_s / 1e9 if total_s > 0 else 0.0
        peak = self.peak_gbps
        self._record(TransferRecord(
            handle.request_id, num_bytes, handle.put_s, get_s, self.name,
            put_time_s=handle.put_time_s, get_time_s=start_time_s,
            layer_start=header.layer_start, layer_end=header.layer_end,
            num_messages=self._num_messages(handle), achieved_gbps=achieved, peak_gbps=peak,
            efficiency=achieved / peak if peak else None, prefill_rank=header.prefill_rank,
            decode_rank=header.decode_rank, head_start=header.head_start,
            head_end=header.head_start + header.shape[2], put_pid=handle.put_pid,
            get_pid=os.getpid()), header.num_layers)
        return header, kv

    def _record(self, record: TransferRecord, num_layers: int) -> None:
        """Append ``record``; once its stream covers ``num_layers``, fill in exposed/overlapped."""
        with self._records_lock:
            self.records.append(record)
            index = len(self.records) - 1
            key = (record.request_id, record.prefill_rank, record.decode_rank, record.head_start)
            if record.layer_start == 0:  # a stream's first chunk (a retry starts anew)
                self._streams[key] = []
            stream = self._streams.setdefault(key, [])
            stream.append(index)
            parts = [self.records[i] for i in stream]
            if sum(r.layer_end - r.layer_start for r in parts) >= num_layers:
                del self._streams[key]
                for i, scored in zip(stream, split_exposed(parts)):
                    self.records[i] = scored

    def take_records(self) -> list[TransferRecord]:
        """Every record so far, removed (a TP rank's, handed to rank 0's ``add_records``)."""
        with self._records_lock:
            taken = list(self.records)
            self.records.clear()
            self._streams.clear()
            return taken

    def add_records(self, records: list[TransferRecord]) -> None:
        """Append another process's ``take_records``."""
        with self._records_lock:
            self.records.extend(records)

    def rank_factory(self) -> Callable[[], Transport] | None:
        """A picklable callable building this transport's equal in another process of the
        node, where any process opens any handle: then each TP rank moves its own KV heads
        (``kv_transfer.rank_kv``). None (in-process objects, per-process set-up): rank 0 does."""
        return None

    def _num_messages(self, handle: KVHandle) -> int:
        """Wire messages (NIXL: descriptors) one get of ``handle`` consumes; 1 by default."""
        return 1

    def free(self, handle: KVHandle) -> None:
        """Release the bytes of ``handle``; freeing twice is harmless."""
        self._free(handle)

    def portable(self, handle: KVHandle) -> KVHandle:
        """``handle`` as it may leave this process by plain pickling (a worker's channel):
        itself by default; ``get`` and ``free`` take either form."""
        return handle

    @abstractmethod
    def num_held(self) -> int:
        """Transfers whose bytes are still held (0 once everything is freed)."""

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int, part: RankPart = WHOLE) -> list[Frame]:
        return pack(request_id, spec, kv, token_start, layer_start, self.checksum, part)

    @abstractmethod
    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> Any:
        """Take ownership of ``frames``; return the handle's key."""

    @abstractmethod
    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        """Return the frames of ``handle.key`` within ``timeout_s`` or raise a TransferError."""

    @abstractmethod
    def _free(self, handle: KVHandle) -> None:
        """Release the bytes of ``handle.key`` (no-op if already released)."""
