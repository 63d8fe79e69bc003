"""``FaultyTransport``: wraps any transport and injects the failures P/D systems see.

Modes (each only for ``only_request_ids`` when given): ``delay_s``: ``get`` sleeps this long
first (to the deadline at most, then ``TransferTimeout``); ``fail``: ``put`` raises
``TransferFailed``, nothing stored; ``corrupt``: ``put`` flips one byte of the tensor frame (the
receiver's checksum raises ``payload.KVChecksumError``; undetected with checksums off); ``drop``:
``get`` waits out the deadline, then ``TransferTimeout``. Records, ``num_held``, ``free`` and
``peak_gbps`` are the inner transport's."""

from __future__ import annotations

import functools
import time
from typing import Any, Iterable

import torch

from engine.kv_cache import KVSpec
from kv_transfer.payload import WHOLE, Frame, RankPart
from kv_transfer.transport import KVHandle, Transport, TransferFailed, TransferTimeout, frame_nbytes


def flip_one_byte(frame: Frame) -> Frame:
    """A copy of ``frame`` with its middle byte inverted (a bytearray or a uint8 tensor)."""
    if isinstance(frame, torch.Tensor):
        corrupted = frame.clone()
        corrupted[corrupted.numel() // 2] ^= 0xFF
        return corrupted
    corrupted = bytearray(frame)
    corrupted[len(corrupted) // 2] ^= 0xFF
    return corrupted


class FaultyTransport(Transport):
    """``inner`` with injected delay / fail / corrupt / drop faults (see module docstring)."""

    def __init__(self, inner: Transport, delay_s: float = 0.0, fail: bool = False,
                 corrupt: bool = False, drop: bool = False,
                 only_request_ids: Iterable[str] | None = None):
        self.inner = inner  # first: Transport.__init__ sets peak_gbps, forwarded to it
        peak = inner.peak_gbps
        super().__init__(inner.checksum)
        inner.peak_gbps = peak
        self.name = inner.name
        self.records = inner.records
        self.delay_s, self.fail, self.corrupt, self.drop = delay_s, fail, corrupt, drop
        self.only_request_ids = None if only_request_ids is None else set(only_request_ids)

    def applies_to(self, request_id: str) -> bool:
        return self.only_request_ids is None or request_id in self.only_request_ids

    def num_held(self) -> int:
        return self.inner.num_held()

    @property
    def peak_gbps(self) -> float | None:
        return self.inner.peak_gbps

    @peak_gbps.setter
    def peak_gbps(self, value: float | None) -> None:
        self.inner.peak_gbps = value

    def _num_messages(self, handle: KVHandle) -> int:
        return self.inner._num_messages(handle)

    def rank_factory(self):
        """The inner transport's, under the same faults (they apply on every rank)."""
        inner = self.inner.rank_factory()
        if inner is None:
            return None
        return functools.partial(_faulty, inner, dict(
            delay_s=self.delay_s, fail=self.fail, corrupt=self.corrupt, drop=self.drop,
            only_request_ids=self.only_request_ids))

    def has_room(self, num_bytes: int) -> bool:
        return self.inner.has_room(num_bytes)

    @property
    def ordered_gets(self) -> bool:
        return self.inner.ordered_gets

    def _pack(self, request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int,
              layer_start: int, part: RankPart = WHOLE) -> list[Frame]:
        frames = self.inner._pack(request_id, spec, kv, token_start, layer_start, part)
        if self.corrupt and self.applies_to(request_id) and frame_nbytes(frames[1]):
            frames = [frames[0], flip_one_byte(frames[1])]
        return frames

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> Any:
        if self.fail and self.applies_to(request_id):
            raise TransferFailed(f"injected put failure for request {request_id}")
        return self.inner._put_frames(request_id, frames, dst_rank)

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        if self.applies_to(handle.request_id):
            if self.drop or self.delay_s >= timeout_s:
                time.sleep(timeout_s)
                raise TransferTimeout(
                    f"KV for request {handle.request_id} not received within {timeout_s} s "
                    f"(injected {'drop' if self.drop else f'delay of {self.delay_s} s'})")
            time.sleep(self.delay_s)
            timeout_s -= self.delay_s
        return self.inner._get_frames(handle, timeout_s)

    def _free(self, handle: KVHandle) -> None:
        self.inner._free(handle)

    def portable(self, handle: KVHandle) -> KVHandle:
        return self.inner.portable(handle)


def _faulty(inner_factory, faults: dict) -> FaultyTransport:
    return FaultyTransport(inner_factory(), **faults)


def with_faults(transport: Transport, faults: dict | list[dict] | None) -> Transport:
    """``transport`` under fault injection: ``faults`` is one ``FaultyTransport``'s keyword
    arguments, or a list of them stacked in order (each with its own ``only_request_ids``,
    so one worker can fail some requests' puts and corrupt others'); None: unchanged."""
    for fault in [faults] if isinstance(faults, dict) else faults or []:
        transport = FaultyTransport(transport, **fault)
    return transport
