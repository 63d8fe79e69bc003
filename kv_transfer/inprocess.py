"""``InProcessTransport``: the reference transport, a dict of frames in one process.

Lifecycle: ``put`` copies the frames into immutable ``bytes`` under a fresh integer key (the
sender may reuse its memory at once); ``get`` decodes them into a new writable tensor (one
copy, so repeated gets never alias each other); ``free`` deletes the entry. Used by tests and
by colocated experiments where prefill and decode share a process.
"""

from __future__ import annotations

import itertools

from kv_transfer.payload import Frame
from kv_transfer.transport import KVHandle, Transport, TransferFailed


class InProcessTransport(Transport):
    """Frames kept in a dict keyed by an int handle id."""

    name = "inprocess"

    def __init__(self, checksum: bool = True):
        super().__init__(checksum)
        self._frames: dict[int, list[bytes]] = {}
        self._next_key = itertools.count()

    def num_held(self) -> int:
        return len(self._frames)

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None) -> int:
        key = next(self._next_key)
        self._frames[key] = [bytes(frame) for frame in frames]
        return key

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[bytes]:
        try:
            return self._frames[handle.key]
        except KeyError:
            raise TransferFailed(f"no KV for request {handle.request_id} under handle "
                                 f"{handle.key}: never put here, or already freed") from None

    def _free(self, handle: KVHandle) -> None:
        self._frames.pop(handle.key, None)
