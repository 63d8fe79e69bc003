"""``RayObjectStoreTransport``: KV through Ray's shared-memory object store. ``put`` is
``ray.put([header, tensor_bytes])``, one copy into the node's store, owned by the putting process
(the ``ObjectRef`` is the key); ``get`` is ``ray.get(ref, timeout=timeout_s)`` (store to store,
never through the router), the read-only buffer copied once into a writable tensor; ``free``
drops this reference. An owner that died before the get: ``TransferFailed`` (objects under Ray's
100 KiB inline limit travel in the handle and survive); a passed deadline: ``TransferTimeout``.
``num_held()`` counts objects put, not freed, and still referenced anywhere in the cluster.

Across a worker's channel (plain pickle) an ``ObjectRef`` would be pinned for its owner's life,
so ``portable`` lends it: the owner keeps the ref under its id and the key becomes a ``LentRef``
(that id and the owner actor's handle); the first ``get`` elsewhere redeems it with one call to
the owner, which hands the ref over in band (Ray's borrowing then frees the object with its last
holder); ``free`` of a lent key never redeemed asks the owner to drop it. A dead owner's lent KV
is lost like its objects: ``TransferFailed``."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

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


_LENT: dict[str, ray.ObjectRef] = {}  # this process's lent objects, by id, until redeemed or freed
_LENT_LOCK = threading.Lock()


@dataclass(frozen=True)
class LentRef:
    """The key of a lent KV object (module docstring): its id and the owning actor."""

    object_id: str
    owner: Any  # the owner's ActorHandle (it pickles; its ObjectRef would be pinned)


def _lend(_actor: Any, object_id: str) -> list | None:
    """Run in the owner (``__ray_call__``): hand ``object_id``'s ref over in band, once."""
    with _LENT_LOCK:
        ref = _LENT.pop(object_id, None)
    return None if ref is None else [ref]


def _drop(_actor: Any, object_id: str) -> None:
    """Run in the owner: a lent object nobody will redeem."""
    with _LENT_LOCK:
        _LENT.pop(object_id, None)


class RayObjectStoreTransport(Transport):
    """Frames stored as one Ray object; the handle key is its ``ObjectRef``."""

    name = "ray"

    def __init__(self, checksum: bool = True):
        super().__init__(checksum)
        self._put_ids: set[str] = set()  # objects put here and not freed here
        self._redeemed: set[str] = set()  # lent objects fetched here, not yet freed here
        self._owner: Any = None  # this actor's handle, once something was lent

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

    def portable(self, handle: KVHandle) -> KVHandle:
        """Lend ``handle``'s object (module docstring); outside an actor (the driver) the
        handle is returned as it is."""
        ref = handle.key
        if not isinstance(ref, ray.ObjectRef):
            return handle
        if self._owner is None:
            try:
                self._owner = ray.get_runtime_context().current_actor
            except Exception:  # not an actor: nobody could redeem a lent key here
                return handle
        with _LENT_LOCK:
            _LENT[ref.hex()] = ref
        return dataclasses.replace(handle, key=LentRef(ref.hex(), self._owner))

    def _get_frames(self, handle: KVHandle, timeout_s: float) -> list[Frame]:
        try:
            return ray.get(self._redeem(handle, timeout_s), timeout=timeout_s)
        # without the traceback, which would keep the callers' handles alive
        except GetTimeoutError as e:
            raise TransferTimeout(f"KV for request {handle.request_id} not available within "
                                  f"{timeout_s} s") from without_traceback(e)
        except RayError as e:  # OwnerDiedError, ObjectLostError, ObjectFreedError, ...
            raise TransferFailed(f"KV for request {handle.request_id} is lost: "
                                 f"{type(e).__name__}: {e}") from without_traceback(e)

    def _redeem(self, handle: KVHandle, timeout_s: float) -> ray.ObjectRef:
        """The ``ObjectRef`` of ``handle``: its key, or a lent key's ref from its owner
        (raises ``TransferFailed`` when the owner no longer lends it)."""
        key = handle.key
        if not isinstance(key, LentRef):
            return key
        with _LENT_LOCK:
            ref = _LENT.get(key.object_id)  # lent by this very process
        if ref is not None:
            return ref
        lent = ray.get(key.owner.__ray_call__.remote(_lend, key.object_id), timeout=timeout_s)
        if lent is None:
            raise TransferFailed(f"KV for request {handle.request_id} is no longer lent by "
                                 "its owner (freed)")
        self._redeemed.add(key.object_id)
        return lent[0]

    def _free(self, handle: KVHandle) -> None:
        key = handle.key
        if not isinstance(key, LentRef):
            self._put_ids.discard(key.hex())
            return
        self._put_ids.discard(key.object_id)
        with _LENT_LOCK:
            mine = _LENT.pop(key.object_id, None) is not None
        if mine or key.object_id in self._redeemed:
            self._redeemed.discard(key.object_id)
            return
        try:  # lent elsewhere and never redeemed here: its owner drops it (fire and forget)
            key.owner.__ray_call__.remote(_drop, key.object_id)
        except Exception:  # the owner is gone, and its objects with it
            pass
