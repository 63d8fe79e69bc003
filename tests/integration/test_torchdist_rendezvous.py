"""torchdist rendezvous: the port is chosen where it is bound, so nothing can take it between
choosing and binding; the ranks form their group through it and move KV."""

import errno
import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.kv_cache import KVSpec
from kv_transfer.torchdist import STORE_SCHEME, TorchDistributedTransport, open_rendezvous

SPEC = KVSpec(model_fingerprint="tiny-llama:abc", num_layers=2, num_kv_heads=2, head_dim=8,
              dtype="float32")


def _kv(num_tokens: int) -> torch.Tensor:
    return torch.randn(SPEC.kv_shape(num_tokens), generator=torch.Generator().manual_seed(7))


def _rank(rank: int, init_method: str, handles, done) -> None:
    transport = TorchDistributedTransport(rank, world_size=2, backend="gloo",
                                          init_method=init_method, dst_rank=1)
    try:
        if rank == 0:
            handles.put(transport.put("r0", SPEC, _kv(6)))
            assert done.get(timeout=60) == "received"
        else:
            header, out = transport.get(handles.get(timeout=60), SPEC, timeout_s=30.0)
            assert header.request_id == "r0" and torch.equal(out, _kv(6))
            done.put("received")
    finally:
        transport.close()


def test_rendezvous_port_is_held_from_the_moment_it_is_chosen():
    store, init_method = open_rendezvous("127.0.0.1", timeout_s=60.0)
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
    mp.start_processes(_rank, args=(init_method, handles, done), nprocs=2,
                       start_method="spawn")  # raises if either rank fails


def test_kv_cost_torchdist_measures_through_the_held_rendezvous():
    from experiments.transfer_cost import time_torchdist

    timings = time_torchdist(SPEC, [(4, [(0, 2)]), (4, [(0, 1), (1, 2)])], repeats=2,
                             timeout_s=120.0)
    assert [t.num_runs for t in timings] == [2, 2]
    assert all(t.min_s > 0 for t in timings)
