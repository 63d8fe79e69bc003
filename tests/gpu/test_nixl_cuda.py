"""NixlTransport on CUDA: the arena and the landing buffer are device memory
registered as VRAM, frame 1 stays on the device, a READ between two processes on one GPU
(or two) comes back bit for bit. Skipped without CUDA or NIXL."""

import pytest
import torch
import torch.multiprocessing as mp

from kv_transfer.nixl import nixl_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or not nixl_available(), reason="needs CUDA and NIXL")]

from engine.kv_cache import KVSpec  # noqa: E402
from kv_transfer.nixl import NixlTransport  # noqa: E402

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=64,
              dtype="bfloat16")


def _kv() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SPEC.kv_shape(33), generator=gen).to(torch.bfloat16)


def test_one_process_round_trip_stays_on_the_device():
    transport = NixlTransport(capacity_bytes=1 << 20, landing_bytes=1 << 20, device="cuda:0")
    handle = transport.put("r1", SPEC, _kv().cuda())
    assert handle.key.mem == "VRAM"
    header, out = transport.get(handle, SPEC, timeout_s=10.0)
    assert out.is_cuda and torch.equal(out.cpu(), _kv())
    transport.free(handle)
    assert transport.num_held() == 0  # a CUDA get copies out: the landing extent is back
    transport.close()


def _producer(handles, done) -> None:
    device = f"cuda:{torch.cuda.device_count() - 1}"
    transport = NixlTransport(capacity_bytes=1 << 20, landing_bytes=4096, device=device)
    handles.put(transport.put("r1", SPEC, _kv().to(device)))
    assert done.get(timeout=120) == "ok"
    transport.close()


def test_two_processes_read_device_memory():
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_producer, args=(handles, done), daemon=True)
    producer.start()
    consumer = NixlTransport(capacity_bytes=4096, landing_bytes=1 << 20, device="cuda:0")
    try:
        handle = handles.get(timeout=120)
        header, out = consumer.get(handle, SPEC, timeout_s=30.0)
        assert out.device == torch.device("cuda:0") and torch.equal(out.cpu(), _kv())
        assert consumer.records[0].num_bytes == SPEC.kv_bytes(33)
        consumer.free(handle)
        done.put("ok")
        producer.join(timeout=60)
        assert producer.exitcode == 0
    finally:
        if producer.is_alive():
            producer.terminate()
        consumer.close()
