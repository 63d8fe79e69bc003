"""SharedMemoryTransport: one process and two, zero-copy leases, slot reuse, faults, leaks."""

import gc
import glob
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import TransferConfig
from engine.kv_cache import KVSpec
from kv_transfer import FaultyTransport, KVChecksumError, KVSpecMismatch, TransferFailed
from kv_transfer.factory import make_transport
from kv_transfer.payload import pack
from kv_transfer.shm import PAGE, SharedMemoryTransport, ShmKey
from kv_transfer.transport import KVHandle

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="float32")
BF16 = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="bfloat16")


def random_kv(spec: KVSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.kv_shape(num_tokens), generator=gen).to(spec.torch_dtype)


@pytest.fixture
def shm():
    transport = SharedMemoryTransport(capacity_bytes=64 * PAGE, num_slots=8, alloc_timeout_s=0.2)
    yield transport
    transport.close()


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["float32", "bfloat16"])
def test_round_trip_records_and_no_leak(shm, spec):
    kvs = {f"r{i}": random_kv(spec, 3 + i, i) for i in range(3)}
    handles = {rid: shm.put(rid, spec, kv) for rid, kv in kvs.items()}
    assert shm.num_held() == 3
    for rid, handle in handles.items():
        assert isinstance(handle.key, ShmKey) and handle.transport == "shm"
        assert handle.num_bytes == spec.kv_bytes(kvs[rid].shape[3])
        header, out = shm.get(handle, spec, timeout_s=1.0)
        assert header.request_id == rid and header.checksum_kind == "crc32c"
        assert out.dtype == spec.torch_dtype and torch.equal(out, kvs[rid])
        shm.free(handle)
        del out
    assert shm.num_held() == 0
    assert [r.request_id for r in shm.records] == ["r0", "r1", "r2"]
    assert all(r.transport == "shm" and r.put_s > 0 and r.get_s > 0 for r in shm.records)


def test_put_copies_so_the_sender_may_reuse_its_memory(shm):
    kv = random_kv(SPEC, 4)
    expected = kv.clone()
    handle = shm.put("r1", SPEC, kv)
    kv.zero_()
    assert torch.equal(shm.get(handle, SPEC, 1.0)[1], expected)
    shm.free(handle)


def test_a_strided_view_is_put_with_one_copy_and_the_wire_of_its_contiguous_copy(shm):
    store = random_kv(BF16, 10)  # a cache: the request's tokens are 2..8 of it, a strided view
    view = store[:, :, :, 2:8]
    assert not view.is_contiguous()
    handle = shm.put("r1", BF16, view, token_start=16)
    assert handle.num_bytes == BF16.kv_bytes(6)
    want = view.contiguous()
    assert handle.key.header == pack("r1", BF16, want, token_start=16)[0]  # checksum too
    store.zero_()  # the sender reuses its cache at once
    header, out = shm.get(handle, BF16, 1.0)
    assert torch.equal(out, want)
    assert header.token_start == 16 and header.token_end == 22


def test_a_put_that_does_not_fit_its_spec_takes_no_slot(shm):
    with pytest.raises(ValueError, match="must be torch.float32 of shape"):
        shm.put("r1", SPEC, random_kv(BF16, 3))
    with pytest.raises(ValueError, match="must be torch.float32 of shape"):
        shm.put("r2", SPEC, random_kv(SPEC, 3)[:, :1])
    assert shm.num_held() == 0 and shm.has_room(shm.capacity)


def test_get_is_zero_copy_and_the_slot_outlives_free_while_the_tensor_lives(shm):
    kv = random_kv(SPEC, 4)
    handle = shm.put("r1", SPEC, kv)
    _, out = shm.get(handle, SPEC, 1.0)
    seg = shm._own
    start = seg.data.data_ptr() + handle.key.offset
    assert out.data_ptr() == start  # a view of the shared slot, no copy
    view = out[0]  # a view of the view keeps the slot too
    shm.free(handle)
    del out
    assert shm.num_held() == 1  # freed, but a tensor still reads the slot
    other = shm.put("r2", SPEC, random_kv(SPEC, 4, 1))
    assert other.key.offset != handle.key.offset  # the busy extent is not handed out again
    assert torch.equal(view, kv[0])
    del view
    gc.collect()
    assert shm.num_held() == 1  # only r2 now
    shm.free(other)
    assert shm.num_held() == 0
    again = shm.put("r3", SPEC, kv)
    assert again.key.offset == 0  # steady state: the lowest extent, already mapped, is reused
    shm.free(again)


def test_get_after_free_and_stale_generation_fail(shm):
    handle = shm.put("r1", SPEC, random_kv(SPEC, 2))
    shm.free(handle)
    shm.free(handle)  # twice is harmless
    with pytest.raises(TransferFailed, match="r1.*already freed"):
        shm.get(handle, SPEC, 1.0)
    reused = shm.put("r2", SPEC, random_kv(SPEC, 2))
    assert reused.key.slot == handle.key.slot and reused.key.gen == handle.key.gen + 1
    shm.free(handle)  # a stale free must not release the slot's new owner
    assert shm.num_held() == 1
    with pytest.raises(TransferFailed, match="r1"):
        shm.get(handle, SPEC, 1.0)
    assert torch.equal(shm.get(reused, SPEC, 1.0)[1], random_kv(SPEC, 2))
    shm.free(reused)
    gc.collect()
    assert shm.num_held() == 0 and [r.request_id for r in shm.records] == ["r2"]


def test_full_arena_fails_after_the_allocation_timeout_and_recovers(shm):
    big = torch.randn(SPEC.kv_shape(16 * PAGE // (2 * 2 * 2 * 8 * 4)))  # 16 pages
    handles = [shm.put(f"r{i}", SPEC, big) for i in range(4)]
    start_s = time.perf_counter()
    with pytest.raises(TransferFailed, match="arena full"):
        shm.put("r4", SPEC, big)
    assert time.perf_counter() - start_s >= 0.2
    with pytest.raises(TransferFailed, match="exceeds"):
        shm.put("huge", SPEC, torch.randn(SPEC.kv_shape(65 * PAGE // 256)))
    shm.free(handles[1])
    handle = shm.put("r5", SPEC, big)  # the freed extent is found again
    assert handle.key.offset == handles[1].key.offset
    for h in [handles[0], handles[2], handles[3], handle]:
        shm.free(h)
    assert shm.num_held() == 0


def test_running_out_of_slots_is_a_full_arena():
    transport = SharedMemoryTransport(capacity_bytes=64 * PAGE, num_slots=2, alloc_timeout_s=0.05)
    handles = [transport.put(f"r{i}", SPEC, random_kv(SPEC, 1)) for i in range(2)]
    with pytest.raises(TransferFailed, match="arena full"):
        transport.put("r2", SPEC, random_kv(SPEC, 1))
    for handle in handles:
        transport.free(handle)
    transport.put("r3", SPEC, random_kv(SPEC, 1))
    transport.close()


def test_corruption_is_caught_and_the_slot_is_released(shm):
    transport = FaultyTransport(shm, corrupt=True)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 4))
    with pytest.raises(KVChecksumError, match="r1"):
        transport.get(handle, SPEC, 1.0)
    transport.free(handle)
    gc.collect()
    assert transport.num_held() == 0


def test_header_mismatch_is_named(shm):
    handle = shm.put("r1", BF16, random_kv(BF16, 2))
    with pytest.raises(KVSpecMismatch, match="dtype expected float32, got bfloat16"):
        shm.get(handle, SPEC, 1.0)
    shm.free(handle)
    gc.collect()
    assert shm.num_held() == 0


def test_copy_out_mode_returns_private_bytes_and_frees_at_once():
    transport = SharedMemoryTransport(capacity_bytes=16 * PAGE, num_slots=4, zero_copy=False)
    kv = random_kv(SPEC, 3)
    handle = transport.put("r1", SPEC, kv)
    _, out = transport.get(handle, SPEC, 1.0)
    transport.free(handle)
    assert transport.num_held() == 0  # out is a copy: the slot is free already
    assert torch.equal(out, kv)
    transport.close()


def test_handle_from_another_node_is_refused(shm):
    handle = shm.put("r1", SPEC, random_kv(SPEC, 2))
    foreign = KVHandle("shm", "r1", handle.key._replace(node="elsewhere/boot"), handle.num_bytes, 0.0)
    with pytest.raises(TransferFailed, match="use transport 'ray'"):
        SharedMemoryTransport().get(foreign, SPEC, 1.0)
    shm.free(handle)


def test_factory_builds_shm_and_segments_have_no_name_left():
    transport = make_transport(TransferConfig(transport="shm", timeout_s=3.0))
    assert isinstance(transport, SharedMemoryTransport) and transport.alloc_timeout_s == 3.0
    handle = transport.put("r1", SPEC, random_kv(SPEC, 2))
    assert transport.segment_name.startswith("/proc/")
    assert not glob.glob("/dev/shm/pdlab-kv-*")  # unlinked at creation: nothing can leak
    transport.free(handle)
    transport.close()


# --- two processes ------------------------------------------------------------------------

def _producer(handles, done) -> None:
    transport = SharedMemoryTransport(capacity_bytes=256 * PAGE, num_slots=16)
    for i in range(6):
        spec = SPEC if i % 2 else BF16
        handles.put(transport.put(f"r{i}", spec, random_kv(spec, 5 + i, i), layer_start=0))
    assert done.get(timeout=30) == "received"
    deadline_s = time.monotonic() + 5
    while transport.num_held() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    handles.put(("held", transport.num_held()))
    # one more transfer, then die without freeing: the consumer must see the owner gone
    handles.put(transport.put("orphan", SPEC, random_kv(SPEC, 2)))
    assert done.get(timeout=30) == "exit"


def test_two_processes_put_get_free_and_owner_death():
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(handles, done), daemon=True)
    producer.start()
    consumer = SharedMemoryTransport()
    received = [handles.get(timeout=60) for _ in range(6)]
    kept = []
    for handle in reversed(received):  # any order
        i = int(handle.request_id[1:])
        spec = SPEC if i % 2 else BF16
        header, out = consumer.get(handle, spec, timeout_s=5.0)
        assert torch.equal(out, random_kv(spec, 5 + i, i)) and header.request_id == handle.request_id
        consumer.free(handle)
        if i == 0:
            kept.append(out)  # freed but still read: released only when dropped
        del out
    assert consumer.num_held() == 1
    kept.clear()
    gc.collect()
    assert consumer.num_held() == 0
    done.put("received")
    assert handles.get(timeout=30) == ("held", 0)  # the producer saw every slot come back
    orphan = handles.get(timeout=30)
    done.put("exit")
    producer.join(timeout=30)
    with pytest.raises(TransferFailed, match="orphan.*owner.*died"):
        consumer.get(orphan, SPEC, 1.0)
    consumer.free(orphan)  # harmless: nothing left to release
    assert consumer.num_held() == 0


def _short_lived_producer(handles, done) -> None:
    transport = SharedMemoryTransport(capacity_bytes=64 * PAGE, num_slots=4)
    handles.put(os.getpid())
    for i in range(2):
        handles.put(transport.put(f"d{i}", SPEC, random_kv(SPEC, 4 + i, i)))
    assert done.get(timeout=30) == "exit"  # then die holding both slots


def _start_short_lived_producer():
    """A producer process (``_short_lived_producer``): returns (process, its pid, the queue
    its two handles arrive on, the queue that tells it to exit)."""
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_short_lived_producer, args=(handles, done), daemon=True)
    producer.start()
    return producer, handles.get(timeout=60), handles, done


def _mapped_segments_of(pid: int) -> int:
    with open("/proc/self/maps") as maps:
        return sum(f"pdlab-kv-{pid}-" in line for line in maps)


def test_dead_producers_segment_is_unmapped_once_nothing_views_it():
    producer, pid, handles, done = _start_short_lived_producer()
    consumer = SharedMemoryTransport()
    views = {}
    for _ in range(2):
        handle = handles.get(timeout=30)
        views[handle.request_id] = consumer.get(handle, SPEC, timeout_s=5.0)[1]
    assert _mapped_segments_of(pid) >= 1 and consumer.num_held() == 2
    done.put("exit")
    producer.join(timeout=30)
    assert producer.exitcode == 0
    del views["d0"]  # one tensor dropped: its lease goes at the next sweep
    gc.collect()
    assert consumer.num_held() == 1  # sweeps: the dead owner's segment is forgotten ...
    assert _mapped_segments_of(pid) >= 1  # ... but d1's tensor still views it
    assert torch.equal(views["d1"], random_kv(SPEC, 5, 1))
    del views["d1"]
    gc.collect()
    assert _mapped_segments_of(pid) == 0  # the memory went back with the last view
    assert consumer.num_held() == 0 and consumer.release_dead_peers() == 0
    consumer.close()


def test_dead_producers_segment_without_views_is_unmapped_at_the_next_call():
    producer, pid, handles, done = _start_short_lived_producer()
    consumer = SharedMemoryTransport(zero_copy=False)  # copies out: no view keeps the mapping
    for _ in range(2):
        handle = handles.get(timeout=30)
        _, out = consumer.get(handle, SPEC, timeout_s=5.0)
        assert torch.equal(out, random_kv(SPEC, 4 + int(handle.request_id[1:]),
                                          int(handle.request_id[1:])))
    assert _mapped_segments_of(pid) >= 1
    done.put("exit")
    producer.join(timeout=30)
    assert _mapped_segments_of(pid) >= 1  # nothing has looked yet
    assert consumer.release_dead_peers() == 1
    assert _mapped_segments_of(pid) == 0 and consumer.num_held() == 0
    consumer.close()
