"""TorchDistributedTransport over NCCL: two ranks on two GPUs, tensor bytes stay on device."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.kv_cache import KVSpec
from kv_transfer.torchdist import TorchDistributedTransport

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA devices")]

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=64,
              dtype="bfloat16")


def _nccl_worker(rank: int, port: int, handles, done) -> None:
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    transport = TorchDistributedTransport(rank, 2, backend="nccl", device=device,
                                          init_method=f"tcp://127.0.0.1:{port}", dst_rank=1)
    torch.manual_seed(0)
    kv = torch.randn(SPEC.kv_shape(33)).to(torch.bfloat16)
    if rank == 0:
        handles.put(transport.put("r1", SPEC, kv.to(device)))
        assert done.get(timeout=60) == "ok"
    else:
        handle = handles.get(timeout=60)
        header, out = transport.get(handle, SPEC, timeout_s=30.0)
        assert out.device == torch.device(device) and out.dtype == torch.bfloat16
        assert torch.equal(out.cpu(), kv)
        assert transport.records[0].num_bytes == SPEC.kv_bytes(33)
        done.put("ok")
    transport.close()


def test_nccl_two_gpus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    mp.start_processes(_nccl_worker, args=(port, ctx.Queue(), ctx.Queue()), nprocs=2,
                       start_method="spawn")
