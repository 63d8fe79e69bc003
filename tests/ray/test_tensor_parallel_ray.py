"""TP instances as Ray actors: one actor per instance (its bundle holds every device of the
instance; rank 0 spawns the others in it); outputs equal ``generate()`` and each decode rank
receives the formula's bytes over its TP, over the ray and torchdist transports."""

from __future__ import annotations

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

from deployment.placement import Deployment
from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.placement import Placement

# shared_ray's 4 logical CPUs: 3 devices over 4 cores' worth of bundles
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
TINY = ModelConfig("tiny-random-llama")


@pytest.mark.parametrize("placement,devices,transport,granularity", [
    ("colocated:1+tp2", "cpu:0,cpu:1", "ray", "request"),
    ("disagg:1p1d+ptp2", "cpu:0,cpu:1,cpu:0-1", "ray", "layer"),
    ("disagg:1p1d+dtp2", "cpu:0-1,cpu:0,cpu:1", "torchdist", "request"),
])
def test_tp_instances_under_ray_give_generates_tokens(tiny, placement, devices, transport,
                                                      granularity):
    workload, expected = mixed_workload(tiny, num_requests=6, spacing_s=0.005)
    parsed = Placement.parse(placement)
    with Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                    TransferConfig(transport=transport, granularity=granularity,
                                   timeout_s=20.0)) as deployment:
        assert sorted(deployment.handles) == sorted(i.name for i in parsed.instances)
        assert {i["name"]: i["tp"] for i in deployment.gather("info")} == {
            i.name: i.tp for i in parsed.instances}
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
        if not parsed.needs_transfer:
            return
        decode_tp = parsed.size_of("decode")[0]
        per_rank: dict[tuple[str, int], int] = {}
        for t in deployment.transfer_records():
            key = (t["request_id"], t["decode_rank"])
            per_rank[key] = per_rank.get(key, 0) + t["num_bytes"]
        assert per_rank == {(r.request_id, j): tiny.kv_spec.kv_bytes(r.num_prompt_tokens) // decode_tp
                            for r in records for j in range(decode_tp)}
