"""RayObjectStoreTransport on a local Ray cluster: actor to actor, timeouts, owner death, leaks."""

import gc
import time
import weakref

import pytest
import torch

import ray  # a required dependency: a broken install fails here, it never skips

from engine.kv_cache import KVSpec
from kv_transfer import FaultyTransport, KVChecksumError, TransferFailed, TransferTimeout
from kv_transfer.ray_store import RayObjectStoreTransport, live_object_ids
from kv_transfer.transport import KVHandle

# shared_ray: its workers import this module (the actor classes): local_ray()'s PYTHONPATH
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="bfloat16")


def kv_for(seed: int, num_tokens: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(SPEC.kv_shape(num_tokens)).to(torch.bfloat16)


@ray.remote(num_cpus=0)
class Prefill:
    def __init__(self):
        self.transport = RayObjectStoreTransport()

    def put(self, request_id, seed, num_tokens):
        return self.transport.put(request_id, SPEC, kv_for(seed, num_tokens))

    def num_held(self):
        return self.transport.num_held()


@ray.remote(num_cpus=0)
class Decode:
    def __init__(self):
        self.transport = RayObjectStoreTransport()

    def get_and_free(self, handle, seed, num_tokens):
        header, kv = self.transport.get(handle, SPEC, timeout_s=10.0)
        self.transport.free(handle)
        return header.request_id, kv.dtype == torch.bfloat16, torch.equal(kv, kv_for(seed, num_tokens))

    def records(self):
        return self.transport.records


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline_s:
        time.sleep(0.05)
    return predicate()


def test_actor_to_actor_through_the_driver_and_back_to_baseline():
    prefill, decode = Prefill.remote(), Decode.remote()
    handle = ray.get(prefill.put.remote("r1", 1, 6))  # the driver only sees the handle
    assert handle.num_bytes == SPEC.kv_bytes(6) == 2 * 2 * 2 * 8 * 6 * 2
    assert ray.get(prefill.num_held.remote()) == 1
    assert ray.get(decode.get_and_free.remote(handle, 1, 6)) == ("r1", True, True)
    [record] = ray.get(decode.records.remote())
    assert record.num_bytes == SPEC.kv_bytes(6) and record.put_s > 0 and record.get_s > 0
    assert record.transport == "ray"
    object_id = handle.key.hex()
    del handle
    gc.collect()
    # the owner (prefill) releases the object once no process holds the handle any more
    assert wait_until(lambda: ray.get(prefill.num_held.remote()) == 0)
    assert object_id not in live_object_ids()
    ray.kill(prefill)
    ray.kill(decode)


def test_get_in_driver_free_and_leak_count():
    transport = RayObjectStoreTransport()
    kv = kv_for(2, 4)
    handle = transport.put("r2", SPEC, kv)
    assert transport.num_held() == 1
    assert torch.equal(transport.get(handle, SPEC, timeout_s=5.0)[1], kv)
    transport.free(handle)
    assert transport.num_held() == 0


def test_owner_death_turns_into_transfer_failed():
    prefill = Prefill.remote()
    # 2000 tokens = 256 KiB: above Ray's 100 KiB inline limit, so the bytes live in the store
    # under the owner (a small object would travel inline with the handle and survive)
    handle = ray.get(prefill.put.remote("r3", 3, 2000))
    ray.kill(prefill)
    transport = RayObjectStoreTransport()
    # the local store may still serve the bytes for a moment while Ray cleans up the owner
    deadline_s = time.monotonic() + 20
    with pytest.raises(TransferFailed, match="r3.*OwnerDied"):
        while time.monotonic() < deadline_s:
            transport.get(handle, SPEC, timeout_s=5.0)
            time.sleep(0.1)


def test_timeout_on_an_object_that_never_arrives():
    @ray.remote(num_cpus=0)
    def slow():
        time.sleep(30)

    pending = slow.remote()
    transport = RayObjectStoreTransport()
    handle = KVHandle("ray", "r4", pending, 0, 0.0)
    with pytest.raises(TransferTimeout, match="r4"):
        transport.get(handle, SPEC, timeout_s=0.3)
    ray.cancel(pending, force=True)


class _Local:
    """A local of the fetching frame (in a decode worker: the handles of other requests)."""


def _get_failing(transport, handle, timeout_s, local: _Local) -> type | None:
    """The type of the error ``get`` raised (None: it did not fail)."""
    try:
        transport.get(handle, SPEC, timeout_s=timeout_s)
    except (TransferFailed, TransferTimeout) as err:
        return type(err)
    return None


def test_a_failed_get_leaves_its_callers_frames_to_reference_counting():
    """``ray.get`` raises an error that its own frame holds (a reference cycle through the
    traceback): chained as the cause, it must not keep the fetching frames, and the
    ObjectRefs among their locals, alive until the cycle collector runs. Both failures: the
    owner died (the error is among the fetched values) and a timeout."""
    prefill = Prefill.remote()
    lost = ray.get(prefill.put.remote("r6", 3, 2000))  # in the store (see the owner-death test)
    ray.kill(prefill)
    transport = RayObjectStoreTransport()
    assert wait_until(lambda: _get_failing(transport, lost, 5.0, _Local()) is TransferFailed,
                      20.0)

    @ray.remote(num_cpus=0)
    def slow():
        time.sleep(30)

    pending = slow.remote()
    gc.disable()  # only reference counting frees what the failed gets left behind
    try:
        for handle, timeout_s, error in ((lost, 5.0, TransferFailed),
                                         (KVHandle("ray", "r7", pending, 0, 0.0), 0.2,
                                          TransferTimeout)):
            local = _Local()
            alive = weakref.ref(local)
            assert _get_failing(transport, handle, timeout_s, local) is error
            del local
            assert alive() is None, f"{error.__name__} kept its caller's frame alive"
    finally:
        gc.enable()
        ray.cancel(pending, force=True)


def test_faulty_ray_transport_corruption_is_caught():
    transport = FaultyTransport(RayObjectStoreTransport(), corrupt=True)
    handle = transport.put("r5", SPEC, kv_for(5, 3))
    with pytest.raises(KVChecksumError, match="r5"):
        transport.get(handle, SPEC, timeout_s=5.0)
    transport.free(handle)
    assert transport.num_held() == 0
