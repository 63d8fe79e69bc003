"""Transports end to end in one process (InProcess, faults) and across two (torch.distributed)."""

import errno
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.kv_cache import KVSpec
from kv_transfer import (FaultyTransport, InProcessTransport, KVChecksumError, KVSpecMismatch,
                         TransferFailed, TransferTimeout)
from kv_transfer.torchdist import STORE_SCHEME, P2PKey, TorchDistributedTransport, open_rendezvous
from kv_transfer.transport import KVHandle

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="float32")
BF16 = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="bfloat16")


def random_kv(spec: KVSpec, num_tokens: int) -> torch.Tensor:
    return torch.randn(spec.kv_shape(num_tokens)).to(spec.torch_dtype)


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["float32", "bfloat16"])
def test_inprocess_round_trip_records_and_no_leak(spec):
    transport = InProcessTransport()
    kvs = {f"r{i}": random_kv(spec, 3 + i) for i in range(3)}
    handles = {rid: transport.put(rid, spec, kv) for rid, kv in kvs.items()}
    assert transport.num_held() == 3
    for rid, handle in handles.items():
        header, out = transport.get(handle, spec, timeout_s=1.0)
        assert header.request_id == rid and out.dtype == spec.torch_dtype
        assert torch.equal(out, kvs[rid])
        transport.free(handle)
    assert transport.num_held() == 0
    assert [r.request_id for r in transport.records] == ["r0", "r1", "r2"]
    for record, kv in zip(transport.records, kvs.values()):
        assert record.num_bytes == spec.kv_bytes(kv.shape[3]) == 2 * 2 * 2 * 8 * kv.shape[3] * spec.itemsize
        assert record.put_s > 0 and record.get_s > 0 and record.transport == "inprocess"


def test_inprocess_owns_the_bytes_after_put():
    transport = InProcessTransport()
    kv = random_kv(SPEC, 4)
    expected = kv.clone()
    handle = transport.put("r1", SPEC, kv)
    kv.zero_()  # the prefill worker reuses its slot
    assert torch.equal(transport.get(handle, SPEC, 1.0)[1], expected)


def test_get_after_free_fails():
    transport = InProcessTransport()
    handle = transport.put("r1", SPEC, random_kv(SPEC, 2))
    transport.free(handle)
    transport.free(handle)  # twice is harmless
    with pytest.raises(TransferFailed, match="r1"):
        transport.get(handle, SPEC, 1.0)
    assert transport.num_held() == 0 and transport.records == []


def test_get_validates_against_receiver_spec():
    transport = InProcessTransport()
    handle = transport.put("r1", BF16, random_kv(BF16, 2))
    with pytest.raises(KVSpecMismatch, match="dtype expected float32, got bfloat16"):
        transport.get(handle, SPEC, 1.0)


def test_fault_fail_raises_in_put_and_stores_nothing():
    transport = FaultyTransport(InProcessTransport(), fail=True)
    with pytest.raises(TransferFailed, match="r1"):
        transport.put("r1", SPEC, random_kv(SPEC, 2))
    assert transport.num_held() == 0


def test_fault_corrupt_is_caught_by_checksum():
    transport = FaultyTransport(InProcessTransport(), corrupt=True)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 4))
    with pytest.raises(KVChecksumError, match="r1"):
        transport.get(handle, SPEC, 1.0)
    transport.free(handle)
    assert transport.num_held() == 0


def test_fault_delay_within_deadline_arrives_late():
    transport = FaultyTransport(InProcessTransport(), delay_s=0.2)
    kv = random_kv(SPEC, 2)
    handle = transport.put("r1", SPEC, kv)
    assert torch.equal(transport.get(handle, SPEC, timeout_s=1.0)[1], kv)
    assert transport.records[0].get_s >= 0.2


def test_fault_delay_past_deadline_times_out():
    # an hour: only giving up at the deadline ends the get (pytest's timeout guards a hang)
    transport = FaultyTransport(InProcessTransport(), delay_s=3600.0)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 2))
    with pytest.raises(TransferTimeout,
                       match=r"r1 not received within 0\.2 s \(injected delay of 3600\.0 s\)"):
        transport.get(handle, SPEC, timeout_s=0.2)
    assert transport.records == []


def test_fault_drop_waits_out_the_deadline():
    transport = FaultyTransport(InProcessTransport(), drop=True)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 2))
    with pytest.raises(TransferTimeout, match=r"r1 not received within 0\.2 s \(injected drop\)"):
        transport.get(handle, SPEC, timeout_s=0.2)
    transport.free(handle)
    assert transport.num_held() == 0


def test_faults_target_only_named_requests():
    transport = FaultyTransport(InProcessTransport(), corrupt=True, only_request_ids={"bad"})
    kv = random_kv(SPEC, 3)
    good, bad = transport.put("good", SPEC, kv), transport.put("bad", SPEC, kv)
    assert torch.equal(transport.get(good, SPEC, 1.0)[1], kv)
    with pytest.raises(KVChecksumError):
        transport.get(bad, SPEC, 1.0)
    assert [r.request_id for r in transport.records] == ["good"]


# --- torch.distributed (gloo), two processes ------------------------------------------------

def _torchdist_worker(rank: int, init_method: str, handles, done) -> None:
    transport = TorchDistributedTransport(rank, world_size=2, backend="gloo",
                                          init_method=init_method, dst_rank=1)
    torch.manual_seed(0)
    kvs = {"r1": random_kv(SPEC, 5), "r2": random_kv(BF16, 3)}
    if rank == 0:  # prefill side: put, ship handles, check the sends drained
        for rid, kv in kvs.items():
            spec = SPEC if kv.dtype == torch.float32 else BF16
            handle = transport.put(rid, spec, kv)
            assert handle.num_bytes == spec.kv_bytes(kv.shape[3])
            handles.put(handle)
        handles.put(transport.put("aborted", SPEC, random_kv(SPEC, 4)))
        assert done.get(timeout=30) == "received"
        deadline_s = time.monotonic() + 5
        while transport.num_held() and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert transport.num_held() == 0
        assert done.get(timeout=30) == "finished"  # stay up: an exiting peer fails pending gets
    else:  # decode side: get in reverse order (tags match them), validate, time out
        received = [handles.get(timeout=30) for _ in kvs]
        aborted = handles.get(timeout=30)
        transport.free(aborted)  # never fetched: the free drains the send (sender's held -> 0)
        for handle in reversed(received):
            spec = SPEC if handle.request_id == "r1" else BF16
            header, out = transport.get(handle, spec, timeout_s=10.0)
            assert header.request_id == handle.request_id
            assert out.dtype == spec.torch_dtype and torch.equal(out, kvs[handle.request_id])
            transport.free(handle)
        assert [r.num_bytes for r in transport.records] == [BF16.kv_bytes(3), SPEC.kv_bytes(5)]
        assert all(r.get_s > 0 and r.put_s > 0 for r in transport.records)
        done.put("received")
        never_sent = KVHandle("torchdist", "lost", P2PKey(0, 999, 16, 16), 16, 0.0)
        try:
            transport.get(never_sent, SPEC, timeout_s=0.3)
            raise AssertionError("expected TransferTimeout")
        except TransferTimeout as e:
            assert "lost" in str(e)
        # gloo closed the pair on that timeout: later gets say so instead of hanging
        assert "the receive of request lost from rank 0 timed out" in transport.broken_peers()[0]
        try:
            transport.get(received[0], SPEC, timeout_s=0.3)
            raise AssertionError("expected TransferFailed")
        except TransferFailed as e:
            assert "pair 1<->0 is broken" in str(e) and "restart the placement" in str(e)
        done.put("finished")


def test_torchdist_gloo_two_processes_through_the_held_rendezvous():
    """The rendezvous port is chosen where it is bound (``open_rendezvous``), so nothing can
    take it between choosing and binding; the two ranks form their group through it, as a
    placement's do, and move KV."""
    store, init_method = open_rendezvous("127.0.0.1", timeout_s=60.0)  # held until we return
    assert init_method == f"{STORE_SCHEME}127.0.0.1:{store.port}" and store.port > 0
    intruder = socket.socket()
    try:  # another process grabbing the port now fails; start-up does not
        with pytest.raises(OSError) as info:
            intruder.bind(("127.0.0.1", store.port))
        assert info.value.errno == errno.EADDRINUSE
    finally:
        intruder.close()
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    mp.start_processes(_torchdist_worker, args=(init_method, handles, done), nprocs=2,
                       start_method="spawn")  # raises if either rank's assertions fail


def test_torchdist_rejects_missing_destination():
    transport = TorchDistributedTransport(rank=0, world_size=2)  # no group needed to refuse
    with pytest.raises(TransferFailed, match="dst_rank"):
        transport.put("r1", SPEC, random_kv(SPEC, 2))


def test_layer_wise_records_split_exposed_from_overlapped_time():
    """The definitions of kv_transfer/transport.py: a chunk's transfer time before the
    put of its request's last chunk began is overlapped, after it exposed."""
    transport = InProcessTransport()
    transport.peak_gbps = 4.0
    kv = random_kv(SPEC, 4)  # 2 layers: two one-layer chunks
    # r1: the first chunk is put and got while the producer still computes layer 1
    first = transport.put("r1", SPEC, kv[0:1], layer_start=0)
    transport.get(first, SPEC, 1.0)
    assert transport.records[0].exposed_s is None  # the stream is not complete yet
    time.sleep(0.02)
    last = transport.put("r1", SPEC, kv[1:2], layer_start=1)
    transport.get(last, SPEC, 1.0)
    # r2: both chunks put first, then both got (what a decode worker does)
    handles = [transport.put("r2", SPEC, kv[i:i + 1], layer_start=i) for i in range(2)]
    for handle in handles:
        transport.get(handle, SPEC, 1.0)
    r1a, r1b, r2a, r2b = transport.records
    near = lambda want: pytest.approx(want, abs=1e-5)  # noqa: E731 - wall stamps: ~0.2 us
    assert (r1a.exposed_s, r1a.overlapped_s) == (near(0.0), near(r1a.put_s + r1a.get_s))
    assert (r1b.exposed_s, r1b.overlapped_s) == (r1b.put_s + r1b.get_s, 0.0)
    assert (r2a.exposed_s, r2a.overlapped_s) == (near(r2a.get_s), near(r2a.put_s))
    assert (r2b.exposed_s, r2b.overlapped_s) == (r2b.put_s + r2b.get_s, 0.0)
    for record in transport.records:
        assert (record.layer_end - record.layer_start, record.num_messages) == (1, 1)
        assert record.achieved_gbps == record.num_bytes / (record.put_s + record.get_s) / 1e9
        assert record.efficiency == record.achieved_gbps / 4.0
