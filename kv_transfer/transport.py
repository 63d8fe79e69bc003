"""The KV transfer protocol every transport implements.

Lifecycle of one transfer:
    1. The prefill side calls ``put(request_id, spec, kv)``: the KV ``[L', 2, H_kv, T, D]`` is
       packed (``payload.pack``: msgpack header + raw bytes) and handed to the transport,
       which now owns the bytes; the caller may free its own copy. ``put`` returns a
       ``KVHandle``: small and picklable, it is what crosses processes (the router passes
       handles, never bytes).
    2. The handle travels to the decode side (e.g. as an argument of an actor call).
    3. The decode side calls ``get(handle, expected_spec, timeout_s)``: the bytes are fetched
       within the deadline, the header is checked against the receiver's ``KVSpec`` and the
       checksum verified, and ``(KVHeader, kv)`` comes back. One ``TransferRecord`` (bytes,
       put and get seconds) is appended to that transport's ``records``.
    4. Whoever holds the handle last calls ``free(handle)``; afterwards ``num_held()`` no longer
       counts it (tests end by asserting ``num_held() == 0``).

Errors: ``TransferTimeout`` (deadline passed) and ``TransferFailed`` (bytes gone: freed,
owner died, put failed) are ``TransferError``s; a header that does not fit the receiver
raises ``payload.KVSpecMismatch``, corrupted bytes ``payload.KVChecksumError``.

A subclass implements four hooks: ``_put_frames``, ``_get_frames``, ``_free`` and
``num_held``; packing, validation, timing and records live here once.
"""

from __future__ import annotations

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
    """

    transport: str
    request_id: str
    key: Any
    num_bytes: int
    put_s: float


@dataclass(frozen=True)
class TransferRecord:
    """One completed transfer, appended by ``get``: tensor bytes and seconds inside put/get."""

    request_id: str
    num_bytes: int
    put_s: float
    get_s: float
    transport: str


def frame_nbytes(frame: Frame) -> int:
    """Byte length of a frame (bytes-like or flat uint8 tensor)."""
    return frame.numel() if isinstance(frame, torch.Tensor) else memoryview(frame).nbytes


class Transport(ABC):
    """Moves packed KV from a put side to a get side; see the module docstring.

    Args:
        checksum: put a CRC32 of the tensor bytes in the header (verified on get).
    """

    name = "transport"
    # True when gets from one sender must run in the order of its puts (NCCL matches
    # point-to-point messages in order): the decode worker then fetches on one thread.
    ordered_gets = False

    def __init__(self, checksum: bool = True):
        self.checksum = checksum
        self.records: list[TransferRecord] = []

    def has_room(self, num_bytes: int) -> bool:
        """Whether a ``put`` of ``num_bytes`` tensor bytes would be taken now without waiting
        for buffer space. A producer that checks this never blocks on a full buffer: it
        keeps the KV in its own engine and tries again later. Transports without a bounded
        buffer always have room.

        Raises:
            TransferFailed: ``num_bytes`` can never fit this transport's buffer.
        """
        return True

    def put(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
            layer_start: int = 0, dst_rank: int | None = None) -> KVHandle:
        """Hand over ``kv`` ``[L', 2, H_kv, T, D]`` (tokens from ``token_start``, layers from
        ``layer_start``). ``dst_rank`` names the receiver for point-to-point transports and
        is ignored by store-based ones.

        Raises:
            ValueError: ``kv`` does not match ``spec``. TransferFailed: the transport refused.
        """
        start_s = time.perf_counter()
        frames = self._pack(request_id, spec, kv, token_start, layer_start)
        key = self._put_frames(request_id, frames, dst_rank)
        return KVHandle(self.name, request_id, key, frame_nbytes(frames[1]),
                        time.perf_counter() - start_s)

    def get(self, handle: KVHandle, expected: KVSpec, timeout_s: float
            ) -> tuple[KVHeader, torch.Tensor]:
        """Fetch, validate and decode the KV of ``handle`` within ``timeout_s`` seconds.

        Returns:
            ``(header, kv)``, ``kv`` of ``header.shape`` = ``[L', 2, H_kv, T, D]``.

        Raises:
            TransferTimeout, TransferFailed, KVSpecMismatch, KVChecksumError.
        """
        start_s = time.perf_counter()
        frames = self._get_frames(handle, timeout_s)
        header, kv = unpack(frames, expected)
        get_s = time.perf_counter() - start_s
        self.records.append(TransferRecord(handle.request_id, frame_nbytes(frames[1]),
                                           handle.put_s, get_s, self.name))
        return header, kv

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
