"""``InProcessTransport``: the reference transport, a dict of frames in one process (tests, and
colocated experiments where prefill and decode share a process). ``put`` copies the tensor bytes
once into a tensor the transport owns, under a fresh integer key (the sender may reuse its memory
at once); ``get`` hands that tensor out without copying (every get of a handle returns the same
memory, only read); ``free`` drops the entry (the memory lives while a caller holds it)."""

from __future__ import annotations

import itertools

import torch

from kv_transfer.payload import Frame, copy_to_tensor
from kv_transfer.transport import KVHandle, Transport, TransferFailed


def _owned_copy(frame: Frame) -> torch.Tensor:
    if isinstance(frame, torch.Tensor):
        return frame.detach().reshape(-1).clone()
    return copy_to_tensor(frame)


class InProcessTransport(Transport):
    """Frames kept in a dict keyed by an int handle id."""

    name = "inprocess"
    copies_on_put = True  # ``_owned_copy``

    def __init__(self, checksum: bool = True):
        super().__init__(checksum)
        self._frames: dict[int, list[Frame]] = {}
        self._next_key = itertools.count()

    def num_held(self) -> int:
        return len(self._frames)

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> int:
        key = next(self._next_key)
        self._frames[key] = [bytes(frames[0]), _owned_copy(frames[1])]
        return key

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        try:
            return self._frames[handle.key]
        except KeyError:
            raise TransferFailed(f"no KV for request {handle.request_id} under handle "
                                 f"{handle.key}: never put here, or already freed") from None

    def _free(self, handle: KVHandle) -> None:
        self._frames.pop(handle.key, None)
