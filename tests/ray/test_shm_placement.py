"""``--transport shm`` in Ray placements on one node: greedy tokens match generate(), the
shared-memory slots all come back, corruption fails only its request."""

from __future__ import annotations

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

import ray  # a required dependency: a broken install fails here, it never skips

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
TINY = ModelConfig("tiny-random-llama")


def deploy(placement, granularity="request", devices="cpu:0,cpu:1", faults=None):
    return Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                      TransferConfig(transport="shm", granularity=granularity, timeout_s=5.0),
                      faults=faults, deadline_s=30.0)  # slow actor start on a busy host


@pytest.mark.parametrize("placement,granularity,num_requests", [
    ("disagg:1p1d", "request", 12),
    ("disagg:1p1d", "layer", 8),
    ("disagg:2p1d", "request", 8),  # two producers' segments mapped by one decode worker
])
def test_greedy_through_shm(tiny, placement, granularity, num_requests):
    workload, expected = mixed_workload(tiny, num_requests=num_requests, spacing_s=0.005)
    devices = "cpu:0,cpu:1,cpu:0-1" if placement == "disagg:2p1d" else "cpu:0,cpu:1"
    with deploy(placement, granularity, devices) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)  # every slot freed, on the prefill (owner) side too
        transfers = deployment.transfer_records()
        assert {t["transport"] for t in transfers} == {"shm"}
        for record in records:  # bytes = 2 * layers * kv_heads * head_dim * tokens * 4
            assert record.kv_bytes == 2 * 2 * 2 * 16 * record.num_prompt_tokens * 4


def test_corrupted_shm_transfer_fails_only_its_request(tiny):
    workload, expected = mixed_workload(tiny, num_requests=6)
    with deploy("disagg:1p1d", faults={"prefill-0": {"corrupt": True, "only_request_ids": ["r3"]}}
                ) as deployment:
        records = deployment.run(workload)
        assert_clean(deployment)
    by_id = {r.request_id: r for r in records}
    assert "KVChecksumError" in by_id["r3"].error
    assert_outputs([r for r in records if r.request_id != "r3"], expected)


def test_shm_kv_of_requests_past_their_deadline_is_freed(tiny):
    """Prefill steps take 1 s, the per-request deadline is 0.5 s: the router ends every
    request before its KV is handed over; the late KV (one handle per layer) is freed by
    its producer (ordered abort/release through Ray), so every shm slot comes back."""
    workload, _ = mixed_workload(tiny, num_requests=4)
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="shm", granularity="layer", layers_per_chunk=1,
                                   timeout_s=5.0),
                    faults={"prefill-0": {"step_delay_s": 1.0}}, deadline_s=0.5) as deployment:
        records = deployment.run(workload)
        assert all("waiting for prefill on prefill-0" in r.error for r in records), records[0].error
        for worker in deployment.workers:  # status waits for the slow step: a long timeout
            status = deployment.router.call_now(worker, "status", timeout_s=60.0)
            assert status["engine_empty"] and status["transport_held"] == 0, status
        assert set(deployment.router.loads.values()) == {0}
