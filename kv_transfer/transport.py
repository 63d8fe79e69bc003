"""The KV transfer protocol every transport implements.

1. The prefill side calls ``put(request_id, spec, kv)``: the KV ``[L', 2, H_kv, T, D]`` is
   packed (``payload.pack``) and handed to the transport, which now owns the bytes. It
   returns a ``KVHandle``, small and picklable: the router passes handles, never bytes.
2. The decode side calls ``get(handle, expected_spec, timeout_s)``: the bytes are fetched
   within the deadline, checked against the receiver's ``KVSpec`` and checksum, and
   ``(KVHeader, kv)`` returned; one ``TransferRecord`` is appended to ``records``.
3. Whoever holds the handle last calls ``free(handle)``; ``num_held()`` then no longer
   counts it.

Errors: ``TransferTimeout`` (deadline passed) and ``TransferFailed`` (bytes gone: freed, owner
died, put failed) are ``TransferError``s; a header that does not fit raises
``payload.KVSpecMismatch``, corrupted bytes ``payload.KVChecksumError``.

A subclass implements ``_put_frames``, ``_get_frames``, ``_free`` and ``num_held``; packing,
validation, timing and records live here once.

Efficiency: ``achieved_gbps = num_bytes / (put_s + get_s) / 1e9`` and ``efficiency =
achieved_gbps / peak_gbps``, the peak of the link measured by ``kv_transfer.link`` and set on
the transport (None without one). A request's chunks form a stream; ``ready`` is when the put
of its last chunk began (its KV was computed then). Of each chunk's put and get intervals,
``exposed_s`` is the part after ``ready`` (on the critical path) and ``overlapped_s`` the part
before (hidden behind prefill), so ``exposed_s + overlapped_s = put_s + get_s``; both are None
until the last chunk is got. The stamps are two processes' wall clocks."""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_cache import KVSpec
from kv_transfer.payload import Frame, KVHeader, pack, unpack


class TransferError(RuntimeError):
    """Base class of transport failures."""


class TransferTimeout(TransferError):
    """The KV did not arrive before the deadline."""


class TransferFailed(TransferError):
    """The transfer cannot complete: put failed, handle freed or unknown, owner/peer died."""


@dataclass(frozen=True)
class KVHandle:
    """Opaque reference to KV held by a transport; small and picklable.

    Attributes:
        transport: name of the transport that issued it.
        request_id: the request whose KV this is.
        key: transport-specific locator (an int id, a Ray ObjectRef, a (rank, seq, ...) tuple).
        num_bytes: tensor bytes (frame 1), ``spec.kv_bytes(T, L')``.
        put_s: seconds spent inside ``put`` (packing + handing over), so the get side can
            record the whole transfer.
        put_time_s: wall-clock time (``time.time()``, seconds) at which ``put`` began
            (exposed/overlapped time, module docstring); 0.0 when unknown."""

    transport: str
    request_id: str
    key: Any
    num_bytes: int
    put_s: float
    put_time_s: float = 0.0


@dataclass(frozen=True)
class TransferRecord:
    """One completed transfer (one chunk of a request), appended by ``get``.

    Attributes:
        request_id, transport: whose KV, moved by which transport.
        num_bytes: tensor bytes (frame 1).
        put_s, get_s: seconds inside ``put`` and inside ``get``.
        put_time_s, get_time_s: wall-clock times (``time.time()``) at which they began.
        layer_start, layer_end: the chunk's layer range ``[start, end)``.
        num_messages: wire messages (NIXL: descriptors) the get consumed for this chunk.
        achieved_gbps: ``num_bytes / (put_s + get_s) / 1e9``.
        peak_gbps: the link peak set on the transport (``Transport.peak_gbps``), or None.
        efficiency: ``achieved_gbps / peak_gbps``, or None without a peak.
        exposed_s, overlapped_s: this chunk's transfer seconds after / before its request's
            KV was ready (module docstring); None until the request's last chunk arrived."""

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


def split_exposed(records: list[TransferRecord]) -> list[TransferRecord]:
    """``records`` (one stream: a request's chunks, the last chunk covering its last layer)
    with ``exposed_s`` and ``overlapped_s`` set, as defined in the module docstring."""
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
    """Moves packed KV from a put side to a get side; see the module docstring.

    Args:
        checksum: put a CRC32 of the tensor bytes in the header (verified on get)."""

    name = "transport"
    # True when gets from one sender must run in the order of its puts (NCCL matches
    # point-to-point messages in order): the decode worker then fetches on one thread.
    ordered_gets = False

    def __init__(self, checksum: bool = True):
        self.checksum = checksum
        self.records: list[TransferRecord] = []
        # GB/s of the link transfers run on (kv_transfer.link), set by the experiment
        self.peak_gbps: float | None = None
        self._records_lock = threading.Lock()  # decode workers get on several threads
        self._streams: dict[str, list[int]] = {}  # request id -> indices of its open stream

    def has_room(self, num_bytes: int) -> bool:
        """Whether a ``put`` of ``num_bytes`` tensor bytes would be taken now without waiting for
        buffer space. A producer that checks this never blocks on a full buffer: it keeps the KV in
        its own engine and tries again later. Transports without a bounded buffer always have room.

        Raises:
            TransferFailed: ``num_bytes`` can never fit this transport's buffer."""
        return True

    def put(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
            layer_start: int = 0, dst_rank: int | None = None) -> KVHandle:
        """Hand over ``kv`` ``[L', 2, H_kv, T, D]`` (tokens from ``token_start``, layers from
        ``layer_start``). ``dst_rank`` names the receiver for point-to-point transports and is
        ignored by store-based ones.

        Raises:
            ValueError: ``kv`` does not match ``spec``. TransferFailed: the transport refused."""
        start_time_s, start_s = time.time(), time.perf_counter()
        frames = self._pack(request_id, spec, kv, token_start, layer_start)
        key = self._put_frames(request_id, frames, dst_rank)
        return KVHandle(self.name, request_id, key, frame_nbytes(frames[1]),
                        time.perf_counter() - start_s, start_time_s)

    def get(self, handle: KVHandle, expected: KVSpec, timeout_s: float
            ) -> tuple[KVHeader, torch.Tensor]:
        """Fetch, validate and decode the KV of ``handle`` within ``timeout_s`` seconds.

        Returns:
            ``(header, kv)``, ``kv`` of ``header.shape`` = ``[L', 2, H_kv, T, D]``.

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
            efficiency=achieved / peak if peak else None), header.num_layers)
        return header, kv

    def _record(self, record: TransferRecord, num_layers: int) -> None:
        """Append ``record``; once its stream covers all ``num_layers`` layers, fill in the
        stream's exposed and overlapped seconds (module docstring)."""
        with self._records_lock:
            self.records.append(record)
            index = len(self.records) - 1
            if record.layer_start == 0:  # a stream's first chunk (a retry starts anew)
                self._streams[record.request_id] = []
            stream = self._streams.setdefault(record.request_id, [])
            stream.append(index)
            parts = [self.records[i] for i in stream]
            if sum(r.layer_end - r.layer_start for r in parts) >= num_layers:
                del self._streams[record.request_id]
                for i, scored in zip(stream, split_exposed(parts)):
                    self.records[i] = scored

    def _num_messages(self, handle: KVHandle) -> int:
        """Wire messages (NIXL: descriptors) one get of ``handle`` consumes; 1 by default."""
        return 1

    def free(self, handle: KVHandle) -> None:
        """Release the bytes of ``handle``; freeing twice is harmless."""
        self._free(handle)

    @abstractmethod
    def num_held(self) -> int:
        """Transfers this transport still keeps bytes for (0 once everything is freed)."""

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int) -> list[Frame]:
        return pack(request_id, spec, kv, token_start, layer_start, self.checksum)

    @abstractmethod
    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> Any:
        """Take ownership of ``frames``; return the handle's key."""

    @abstractmethod
    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        """Return the frames of ``handle.key`` within ``timeout_s`` or raise a TransferError."""

    @abstractmethod
    def _free(self, handle: KVHandle) -> None:
        """Release the bytes of ``handle.key`` (no-op if already released)."""
