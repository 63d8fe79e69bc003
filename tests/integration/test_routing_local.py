"""Routing and KV ownership with real workers in one process (tiny model, ``bind=False``):
xPyD placements split their pools as the policy says and decode exactly; requests the router
ends before their KV reaches a decode worker (deadline, dead decode worker) leave nothing
held: the producer frees the handles, the in-process transport holds nothing and the shm
arena is all free, for whole-request and layer-wise transfers."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
from placement_helpers import (ENGINE, assert_clean, assert_outputs, boundary_workload,
                              mixed_workload)

from decode_worker import DecodeWorker
from engine.config import ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.shm import SharedMemoryTransport
from prefill_worker import PrefillWorker
from router.calls import LocalCalls
from router.router import Router, WorkerRef

TINY = ModelConfig("tiny-random-llama")


@pytest.mark.parametrize("placement,decode_split", [
    ("disagg:2p2d", {"decode-0": 4, "decode-1": 4}),
    ("disagg:1p3d", {"decode-0": 3, "decode-1": 3, "decode-2": 2}),
])
def test_round_robin_xpyd_splits_each_pool_and_decodes_exactly(tiny, placement, decode_split):
    workload, expected = mixed_workload(tiny, num_requests=8)
    # bind=False: the devices are only labels here (4 distinct names for 4 workers on 2 cores)
    devices = "cpu:0,cpu:1,cpu:0-1,cpu:1-1"
    with Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                    policy="round_robin") as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        num_prefill = int(placement.split(":")[1].split("p")[0])
        assert Counter(r.prefill_worker for r in records) == {
            f"prefill-{i}": 8 // num_prefill for i in range(num_prefill)}
        assert Counter(r.decode_worker for r in records) == decode_split
        assert set(deployment.router.loads.values()) == {0}
        assert_clean(deployment)


@contextlib.contextmanager
def disagg(num_prefill: int, num_decode: int, transport: str, granularity: str,
           deadline_s: float, prefill_delay_s: float):
    """Prefill and decode workers as plain objects over ``transport`` (one shared in-process
    store, or one shm transport per worker), and a router over them."""
    transfer = TransferConfig(transport=transport, granularity=granularity, layers_per_chunk=1,
                              timeout_s=5.0)
    shared = InProcessTransport()
    workers = []
    try:
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                cls = PrefillWorker if role == "prefill" else DecodeWorker
                own = shared if transport == "inprocess" else SharedMemoryTransport(num_slots=16)
                workers.append(cls(f"{role}-{i}", TINY, ENGINE, transfer, transport=own,
                                   bind=False,
                                   step_delay_s=prefill_delay_s if role == "prefill" else 0.0))
        calls = LocalCalls()
        refs = [WorkerRef(w.name, w.role, w, rank) for rank, w in enumerate(workers)]
        router = Router(refs, calls, f"disagg:{num_prefill}p{num_decode}d", deadline_s=deadline_s)
        yield router, {w.name: w for w in workers}, calls
    finally:
        for worker in workers:
            worker.shutdown()


def assert_kv_all_freed(router, workers) -> None:
    """Every live worker's engine is empty and its transport holds nothing; each shm arena
    (the producers') has every slot FREE again; router loads are all 0."""
    for name, worker in workers.items():
        if not router.workers[name].alive:
            continue
        status = worker.status()
        assert status["engine_empty"] and status["transport_held"] == 0, status
        segment = getattr(worker.transport, "_own", None)
        assert segment is None or not segment.state.any(), f"{name}: shm slots still READY"
    assert set(router.loads.values()) == {0}


@pytest.mark.parametrize("transport,granularity", [
    ("inprocess", "request"), ("inprocess", "layer"), ("shm", "request"), ("shm", "layer")])
def test_block_boundary_lengths_decode_exactly_and_free_every_block(tiny, transport, granularity):
    """Prompts and reservations of 15-17 and 31-33 tokens (block size 16): the prefill side
    exports from its blocks, the decode side reserves blocks first and fetches into them;
    outputs equal generate() and every block is free at the end (``engine_empty``)."""
    workload, expected = boundary_workload(tiny)
    with disagg(1, 1, transport, granularity, deadline_s=20.0, prefill_delay_s=0.0) as (
            router, workers, _):
        records = router.run(workload)
        assert_outputs(records, expected)
        assert_kv_all_freed(router, workers)
        assert {r.prefill_path for r in records} == {"remote"}


@pytest.mark.parametrize("transport,granularity", [("inprocess", "request"), ("shm", "layer")])
def test_kv_of_requests_past_their_deadline_is_freed_by_its_producer(tiny, transport, granularity):
    """Each prefill step takes 0.6 s, the deadline is 0.3 s: every request ends in the
    prefill stage, and its first token and KV come after it ended."""
    workload, _ = mixed_workload(tiny, num_requests=4)
    with disagg(1, 1, transport, granularity, deadline_s=0.3, prefill_delay_s=0.6) as (
            router, workers, _):
        records = router.run(workload)
        assert all("waiting for prefill on prefill-0" in r.error for r in records)
        assert_kv_all_freed(router, workers)
        assert workers["prefill-0"].transport.records == []  # nothing was ever fetched


@pytest.mark.parametrize("transport,granularity", [("inprocess", "layer"), ("shm", "request")])
def test_requests_of_a_decode_worker_dead_before_hand_over_move_to_the_survivor(
        tiny, transport, granularity):
    """decode-1 dies while the first prefill step runs (each takes 0.5 s): the requests
    assigned to it had not reached it, so they are handed to decode-0 instead (the
    survivors take the load) and none fails; outputs exact, every block and handle
    freed, loads back to 0."""
    workload, expected = mixed_workload(tiny, num_requests=6)
    with disagg(1, 2, transport, granularity, deadline_s=30.0, prefill_delay_s=0.5) as (
            router, workers, calls):
        threading.Timer(0.2, calls.kill, [workers["decode-1"]]).start()
        records = router.run(workload)
        assert not router.workers["decode-1"].alive
        assert [r.error for r in records] == [None] * len(records)
        assert {r.decode_worker for r in records} == {"decode-0"}
        assert_outputs(records, expected)
        assert_kv_all_freed(router, workers)
