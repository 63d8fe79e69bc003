"""Deployments whose instances span several devices: each TP instance is one worker to the
router (one channel port, one scheduler) whose other ranks are processes; its outputs equal
``generate()``; a dead rank is a dead worker, whose requests end with a named cause."""

from __future__ import annotations

import os
import signal

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

from deployment.placement import Deployment, worker_layout
from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.placement import Placement

TINY = ModelConfig("tiny-random-llama")


def deploy(placement: str, devices: str, granularity: str = "request", **kwargs) -> Deployment:
    return Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                      TransferConfig(transport="inprocess", granularity=granularity,
                                     timeout_s=20.0), local=True, **kwargs)


def test_the_layout_is_one_worker_per_instance_over_its_devices():
    layout = worker_layout("disagg:1p2d+ptp2", ("cpu:0", "cpu:1", "cpu:2", "cpu:3"))
    assert [(i.name, i.devices) for i in layout] == [
        ("prefill-0", ("cpu:0", "cpu:1")), ("decode-0", ("cpu:2",)), ("decode-1", ("cpu:3",))]
    with pytest.raises(ValueError, match="needs 3 devices, the device set cpu:0,cpu:1 has 2"):
        worker_layout("disagg:1p1d+ptp2", ("cpu:0", "cpu:1"))
    with pytest.raises(ValueError, match="decode PP 2 runs on emulated devices only"):
        worker_layout("disagg:1p1d+dpp2", ("cpu:0", "cpu:1", "cpu:2"))
    emulated = worker_layout(Placement.parse("colocated:1+tp2+pp2"), tuple(f"emu:{i}" for i in range(4)))
    assert emulated[0].devices == ("emu:0", "emu:1", "emu:2", "emu:3")


@pytest.mark.parametrize("placement,devices,granularity", [
    ("colocated:1+tp2", "cpu:0,cpu:1", "request"),
    ("disagg:1p1d+ptp2", "cpu:0,cpu:1,cpu:0-1", "layer"),  # oversubscribed: 3 devices, 2 cores
])
def test_a_tp_instance_is_one_worker_and_its_outputs_equal_generate(
        tiny, placement, devices, granularity):
    workload, expected = mixed_workload(tiny)
    with deploy(placement, devices, granularity) as deployment:
        assert len(deployment.router.workers) == len(Placement.parse(placement).instances)
        infos = {i["name"]: i for i in deployment.gather("info")}
        first = next(iter(infos.values()))
        assert first["tp"] == 2 and len(first["rank_devices"]) == 1
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
        if deployment.placement.kind != "colocated":
            sent: dict[str, int] = {}
            for t in deployment.transfer_records():
                sent[t["request_id"]] = sent.get(t["request_id"], 0) + t["num_bytes"]
            assert sent == {r.request_id: tiny.kv_spec.kv_bytes(len(r.prompt_token_ids))
                            for r, _ in workload}

@pytest.mark.workers
def test_a_dead_rank_is_a_dead_worker_and_its_requests_end(tiny):
    workload, _ = mixed_workload(tiny, num_requests=4)
    with deploy("colocated:1+tp2", "cpu:0,cpu:1") as deployment:
        worker = deployment.handles["colocated-0"]
        rank = worker._instance.processes[0]
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        records = deployment.run(workload)
        assert records and all(r.error for r in records), records
        assert not deployment.router.workers["colocated-0"].alive
    assert "TP rank 1" in worker._died and "exited with code -9" in worker._died


@pytest.mark.workers
def test_a_tp_worker_whose_rank_died_is_restarted_with_new_ranks(tiny):
    """The run after the death waits for the replacement (new rank processes) and is exact."""
    workload, expected = mixed_workload(tiny, num_requests=4)
    with deploy("colocated:1+tp2", "cpu:0,cpu:1", max_worker_restarts=1) as deployment:
        first = deployment.handles["colocated-0"]
        os.kill(first._instance.processes[0].pid, signal.SIGKILL)
        failed = deployment.run(workload)  # the router hears of the death on its next turn
        assert any(r.error for r in failed), failed  # the dead rank's step, or the dead worker
        assert_outputs(deployment.run(workload), expected)
        assert deployment.restarts.attempts == {"colocated-0": 1}
        replacement = deployment.handles["colocated-0"]
        assert replacement is not first
        assert [p.is_alive() for p in replacement._instance.processes] == [True]
