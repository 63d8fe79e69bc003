"""``RayObjectStoreTransport``: KV through Ray's shared-memory object store. ``put`` is
``ray.put([header, tensor_bytes])``, one copy into the node's store, owned by the putting process
(the ``ObjectRef`` is the key); ``get`` is ``ray.get(ref, timeout=timeout_s)`` (store to store,
never through the router), the read-only buffer copied once into a writable tensor; ``free``
drops this reference. An owner that died before the get: ``TransferFailed`` (objects under Ray's
100 KiB inline limit travel in the handle and survive); a passed deadline: ``TransferTimeout``.
``num_held()`` counts objects put, not freed, and still referenced anywhere in the cluster."""

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
        # without the traceback, which would keep the callers' handles alive
        except GetTimeoutError as e:
            raise TransferTimeout(f"KV for request {handle.request_id} not available within "
                                  f"{timeout_s} s") from without_traceback(e)
        except RayError as e:  # OwnerDiedError, ObjectLostError, ObjectFreedError, ...
            raise TransferFailed(f"KV for request {handle.request_id} is lost: "
                                 f"{type(e).__name__}: {e}") from without_traceback(e)

    def _free(self, handle: KVHandle) -> None:
        self._put_ids.discard(handle.key.hex())
