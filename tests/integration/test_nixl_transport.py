"""NixlTransport: NIXL READs in one process (loopback) and across two, leases,
extent reuse, faults, deadlines, a dead producer, free by a one-sided WRITE, records."""

import dataclasses
import gc
import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import TransferConfig
from engine.kv_cache import KVSpec
from kv_transfer import (FaultyTransport, KVChecksumError, KVSpecMismatch, TransferFailed,
                         TransferTimeout)
from kv_transfer.factory import make_transport

nixl_module = pytest.importorskip("kv_transfer.nixl")
if not nixl_module.nixl_available():
    pytest.skip("NIXL is not installed (pip install 'pdlab[nixl]')", allow_module_level=True)

from kv_transfer.nixl import ALIGN, MISSING, NixlKey, NixlTransport  # noqa: E402

SPECS = {dtype: KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2,
                       head_dim=8, dtype=dtype) for dtype in ("float32", "bfloat16", "float16")}
SPEC, BF16 = SPECS["float32"], SPECS["bfloat16"]


def random_kv(spec: KVSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.kv_shape(num_tokens), generator=gen).to(spec.torch_dtype)


@pytest.fixture(scope="module")
def nixl():
    """One agent for the module's one-process tests (an agent's start-up costs ~0.1 s)."""
    transport = NixlTransport(capacity_bytes=16 * ALIGN, landing_bytes=16 * ALIGN,
                              alloc_timeout_s=0.2)
    yield transport
    transport.close()


@pytest.fixture(autouse=True)
def nothing_held_after(request):
    yield
    if "nixl" in request.fixturenames:
        gc.collect()
        transport = request.getfixturevalue("nixl")
        assert transport.num_held() == 0
        transport.records.clear()


@pytest.mark.parametrize("dtype", list(SPECS))
def test_round_trip_is_bit_exact_records_efficiency_and_no_leak(nixl, dtype):
    spec = SPECS[dtype]
    kvs = {f"r{i}": random_kv(spec, 3 + i, i) for i in range(3)}
    nixl.peak_gbps = 10.0
    try:
        handles = {rid: nixl.put(rid, spec, kv) for rid, kv in kvs.items()}
        assert nixl.num_held() == 3
        for rid, handle in handles.items():
            assert isinstance(handle.key, NixlKey) and handle.transport == "nixl"
            header, out = nixl.get(handle, spec, timeout_s=2.0)
            assert header.request_id == rid and out.dtype == spec.torch_dtype
            assert torch.equal(out.view(torch.uint8), kvs[rid].view(torch.uint8))  # bit for bit
            nixl.free(handle)
            del out
    finally:
        nixl.peak_gbps = None
    assert [r.request_id for r in nixl.records] == ["r0", "r1", "r2"]
    for record, kv in zip(nixl.records, kvs.values()):
        assert record.num_bytes == 2 * 2 * 2 * 8 * kv.shape[3] * spec.itemsize
        assert record.transport == "nixl" and record.num_messages == 1  # one descriptor
        total_s = record.put_s + record.get_s
        assert record.achieved_gbps == pytest.approx(record.num_bytes / total_s / 1e9)
        assert record.peak_gbps == 10.0
        assert record.efficiency == pytest.approx(record.achieved_gbps / 10.0)
        # whole request: the KV was ready when the put began, so all of it is exposed
        assert record.exposed_s == pytest.approx(total_s) and record.overlapped_s == 0.0
        assert (record.layer_start, record.layer_end) == (0, 2)


def test_put_copies_so_the_sender_may_reuse_its_memory(nixl):
    kv = random_kv(SPEC, 4)
    expected = kv.clone()
    handle = nixl.put("r1", SPEC, kv)
    kv.zero_()
    assert torch.equal(nixl.get(handle, SPEC, 1.0)[1], expected)
    nixl.free(handle)


def test_get_is_a_leased_view_of_the_landing_buffer(nixl):
    kv = random_kv(SPEC, 4)
    handle = nixl.put("r1", SPEC, kv)
    _, out = nixl.get(handle, SPEC, 1.0)
    landing = nixl._landing
    assert landing.addr <= out.data_ptr() < landing.addr + landing.capacity  # no copy out
    nixl.free(handle)
    assert nixl.num_held() == 1  # the producer's extent is back; the view holds the landing one
    del out
    gc.collect()
    assert nixl.num_held() == 0


def test_get_after_free_and_stale_generation_fail(nixl):
    handle = nixl.put("r1", SPEC, random_kv(SPEC, 2))
    nixl.free(handle)
    nixl.free(handle)  # twice is harmless
    with pytest.raises(TransferFailed, match="r1.*already freed"):
        nixl.get(handle, SPEC, 1.0)
    reused = nixl.put("r2", SPEC, random_kv(SPEC, 2))
    assert reused.key.addr == handle.key.addr  # the extent came back: same bytes, new stamp
    nixl.free(handle)  # a stale free must not release the extent's new owner
    assert nixl.num_held() == 1
    with pytest.raises(TransferFailed, match="already freed"):
        nixl.get(handle, SPEC, 1.0)
    assert torch.equal(nixl.get(reused, SPEC, 1.0)[1], random_kv(SPEC, 2))
    nixl.free(reused)
    gc.collect()
    assert [r.request_id for r in nixl.records] == ["r2"]


def test_another_agent_frees_by_write_and_a_stale_free_is_ignored(nixl):
    consumer = NixlTransport(capacity_bytes=ALIGN, landing_bytes=16 * ALIGN)  # its own agent
    try:
        handle = nixl.put("r1", SPEC, random_kv(SPEC, 2))
        assert torch.equal(consumer.get(handle, SPEC, 5.0)[1], random_kv(SPEC, 2))
        consumer.free(handle)  # a WRITE of the generation into the producer's freed word
        assert nixl.num_held() == 0
        reused = nixl.put("r2", SPEC, random_kv(SPEC, 2, 1))
        assert reused.key.addr == handle.key.addr
        consumer.free(handle)  # stale: writes r1's generation, r2's extent stays held
        assert nixl.num_held() == 1
        assert torch.equal(consumer.get(reused, SPEC, 5.0)[1], random_kv(SPEC, 2, 1))
        consumer.free(reused)
        gc.collect()
        assert nixl.num_held() == 0 and consumer.num_held() == 0
    finally:
        consumer.close()


def test_full_arena_fails_after_the_allocation_timeout_and_recovers(nixl):
    big = torch.randn(SPEC.kv_shape(3 * ALIGN // SPEC.bytes_per_token))  # 3 pages + tail: 4
    handles = [nixl.put(f"r{i}", SPEC, big) for i in range(4)]
    assert not nixl.has_room(big.numel() * 4)
    with pytest.raises(TransferFailed, match=r"arena full for request r4: 4 transfers hold it, "
                       r"none freed within 0\.2 s"):
        nixl.put("r4", SPEC, big)
    with pytest.raises(TransferFailed, match="exceeds"):
        nixl.put("huge", SPEC, torch.randn(SPEC.kv_shape(16 * ALIGN // SPEC.bytes_per_token)))
    nixl.free(handles[1])
    assert nixl.has_room(big.numel() * 4)
    handle = nixl.put("r5", SPEC, big)  # the freed extent is found again
    assert handle.key.addr == handles[1].key.addr
    for h in [handles[0], handles[2], handles[3], handle]:
        nixl.free(h)


def test_a_full_landing_buffer_reads_through_a_one_off_buffer(nixl):
    kv = random_kv(SPEC, 3 * ALIGN // SPEC.bytes_per_token)  # 3 pages + tail: 4 pages
    outs = []
    for i in range(4):  # 4 views of 4 pages each fill the 16-page landing buffer
        handle = nixl.put(f"r{i}", SPEC, kv)
        outs.append(nixl.get(handle, SPEC, 1.0)[1])
        nixl.free(handle)
    assert nixl.num_held() == 4 and nixl._landing.place(ALIGN) is None
    overflow = nixl.put("r4", SPEC, random_kv(SPEC, 1, 4))  # so this one goes around it
    assert torch.equal(nixl.get(overflow, SPEC, 1.0)[1], random_kv(SPEC, 1, 4))
    assert all(torch.equal(out, kv) for out in outs)
    nixl.free(overflow)
    outs.clear()


def test_corruption_is_caught_and_everything_is_released(nixl):
    transport = FaultyTransport(nixl, corrupt=True)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 4))
    with pytest.raises(KVChecksumError, match="r1"):
        transport.get(handle, SPEC, 1.0)
    transport.free(handle)


def test_header_mismatch_is_named(nixl):
    handle = nixl.put("r1", BF16, random_kv(BF16, 2))
    with pytest.raises(KVSpecMismatch, match="dtype expected float32, got bfloat16"):
        nixl.get(handle, SPEC, 1.0)
    nixl.free(handle)


# an hour's delay: only giving up at the deadline ends the get (pytest's timeout guards a hang)
@pytest.mark.parametrize("fault", [{"drop": True}, {"delay_s": 3600.0}])
def test_injected_drop_and_late_delay_time_out(nixl, fault):
    transport = FaultyTransport(nixl, **fault)
    handle = transport.put("r1", SPEC, random_kv(SPEC, 2))
    with pytest.raises(TransferTimeout, match=r"r1 not received within 0\.2 s \(injected "):
        transport.get(handle, SPEC, timeout_s=0.2)
    transport.free(handle)


class _StuckAgent:
    """Wraps an agent so every READ stays in progress (a peer that never answers)."""

    def __init__(self, agent):
        self.agent = agent

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def transfer(self, xfer, notif_msg=b""):
        return "PROC"

    def check_xfer_state(self, xfer):
        return "PROC"


def test_a_read_that_never_completes_times_out_and_releases_the_landing_extent(nixl):
    handle = nixl.put("r1", SPEC, random_kv(SPEC, 2))
    agent = nixl._agent
    nixl._agent = _StuckAgent(agent)
    try:
        with pytest.raises(TransferTimeout, match=r"r1 not read within 0\.3 s"):
            nixl.get(handle, SPEC, timeout_s=0.3)
    finally:
        nixl._agent = agent
    assert nixl.num_held() == 1 and not nixl._landing.extents  # only the producer's extent
    nixl.free(handle)


def test_factory_builds_nixl_and_refuses_it_in_one_line_without_the_wheel(monkeypatch):
    transport = make_transport(TransferConfig(transport="nixl", timeout_s=3.0))
    assert isinstance(transport, NixlTransport) and transport.alloc_timeout_s == 3.0
    transport.close()

    def missing(name):
        raise ImportError(name)

    monkeypatch.setattr(nixl_module.importlib, "import_module", missing)
    with pytest.raises(ValueError) as err:
        make_transport(TransferConfig(transport="nixl"))
    assert str(err.value) == MISSING and "\n" not in MISSING and "pdlab[nixl]" in MISSING


# --- two processes ------------------------------------------------------------------------

def _producer(handles, done) -> None:
    transport = NixlTransport(capacity_bytes=64 * ALIGN, landing_bytes=ALIGN)
    for i in range(6):
        spec = list(SPECS.values())[i % 3]
        handles.put(transport.put(f"r{i}", spec, random_kv(spec, 5 + i, i)))
    assert done.get(timeout=60) == "received"
    deadline_s = time.monotonic() + 10  # the consumer WROTE its frees: reclaimed here
    while transport.num_held() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    handles.put(("held", transport.num_held()))
    # one more transfer, then die without freeing it: the consumer must see the owner gone
    handles.put(transport.put("orphan", SPEC, random_kv(SPEC, 2)))
    assert done.get(timeout=60) == "exit"


def test_two_processes_read_free_by_write_and_owner_death():
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(handles, done), daemon=True)
    producer.start()
    consumer = NixlTransport(capacity_bytes=ALIGN, landing_bytes=64 * ALIGN)
    try:
        received = [handles.get(timeout=120) for _ in range(6)]
        for handle in reversed(received):  # any order
            i = int(handle.request_id[1:])
            spec = list(SPECS.values())[i % 3]
            header, out = consumer.get(handle, spec, timeout_s=10.0)
            assert torch.equal(out.view(torch.uint8), random_kv(spec, 5 + i, i).view(torch.uint8))
            assert header.request_id == handle.request_id
            consumer.free(handle)  # a WRITE into the producer's freed word
            del out
        gc.collect()
        assert consumer.num_held() == 0
        done.put("received")
        assert handles.get(timeout=60) == ("held", 0)  # every extent came back to its owner
        orphan = handles.get(timeout=60)
        done.put("exit")
        producer.join(timeout=60)
        with pytest.raises(TransferFailed, match="orphan.*owner.*died"):
            consumer.get(orphan, SPEC, 1.0)
        # seen from another node (no pid to check) the READ itself fails: disconnected
        remote = dataclasses.replace(orphan, key=orphan.key._replace(node="elsewhere/boot"))
        with pytest.raises(TransferFailed, match="orphan cannot be read"):
            consumer.get(remote, SPEC, 5.0)
        consumer.free(orphan)  # harmless: nothing left to release
        assert consumer.num_held() == 0
    finally:
        if producer.is_alive():
            producer.terminate()
        consumer.close()
