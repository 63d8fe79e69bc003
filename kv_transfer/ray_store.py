"""``RayObjectStoreTransport``: KV through Ray's shared-memory object store.

Lifecycle:
    1. ``put`` calls ``ray.put([header, tensor_bytes])``: the bytes are copied once into the
       local node's object store and the handle's key is the ``ObjectRef``. The putting
       process (the prefill worker) becomes the object's **owner**.
    2. The handle crosses actor calls like any argument; Ray counts every process holding a
       copy as a borrower, so the object lives while any copy of the handle does.
    3. ``get`` calls ``ray.get(ref, timeout=timeout_s)`` in the decode worker: on another node
       the bytes go store to store (never through the router); the read-only store buffer is
       copied once into a writable tensor, so the store copy can be released right away.
    4. ``free`` drops this transport's reference. Ray frees the object when the last reference
       (owner's and borrowers') is gone, so callers must not keep handles after ``free``.

If the owner dies before the get (prefill worker crashed), Ray cannot resolve the object:
``ray.get`` raises ``OwnerDiedError`` (an ``ObjectLostError``) and ``get`` raises
``TransferFailed``; a passed deadline raises ``TransferTimeout``. (Objects under Ray's inline limit,
100 KiB by default, travel inside the handle itself and survive the owner; a reader on the owner's
node may still be served for a moment while Ray cleans up.)

``num_held()`` counts objects this instance put, has not freed, and whose owner (this process) still
tracks a reference anywhere in the cluster: it drops to 0 on the put side once the decode side is
done with the handle, wherever that happened."""

from __future__ import annotations

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from engine.errors import without_traceback
from kv_transfer.payload import Frame
from kv_transfer.transport import KVHandle, Transport, TransferFailed, TransferTimeout


def live_object_ids() -> set[str]:
    """Hex ids of objects this process holds a reference to or owns with live borrowers."""
    worker = ray._private.worker.global_worker  # no public API lists a process's references
    ids = worker.core_worker.get_all_reference_counts()
    return {i.decode() if isinstance(i, bytes) else str(i) for i in ids}


class RayObjectStoreTransport(Transport):
    """Frames stored as one Ray object; the handle key is its ``ObjectRef``."""

    name = "ray"

    def __init__(self, checksum: bool = True):
        super().__init__(checksum)
        self._put_ids: set[str] = set()  # objects put here and not freed here

    def num_held(self) -> int:
        self._put_ids &= live_object_ids()
        return len(self._put_ids)

    def _put_frames(self, request_id: str, frames: list[Frame], dst_rank: int | None
                    ) -> ray.ObjectRef:
        header, tensor_bytes = frames
        # numpy arrays are stored out of band: ray.put copies the bytes once, no pickling.
        ref = ray.put([bytes(header), np.asarray(memoryview(tensor_bytes).cast("B"))])
        self._put_ids.add(ref.hex())
        return ref

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        try:
            return ray.get(handle.key, timeout=timeout_s)
        # Ray's error is chained without its traceback, which would keep this fetch's
        # callers (and the handles among their locals) alive: engine.errors.without_traceback
        except GetTimeoutError as e:
            raise TransferTimeout(f"KV for request {handle.request_id} not available within "
                                  f"{timeout_s} s") from without_traceback(e)
        except RayError as e:  # OwnerDiedError, ObjectLostError, ObjectFreedError, ...
            raise TransferFailed(f"KV for request {handle.request_id} is lost: "
                                 f"{type(e).__name__}: {e}") from without_traceback(e)

    def _free(self, handle: KVHandle) -> None:
        self._put_ids.discard(handle.key.hex())
