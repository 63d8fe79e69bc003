"""A disaggregated placement spanning two Ray nodes (``ray.cluster_utils.Cluster``): the KV
crosses nodes through the object store or NIXL READs, and the tokens still equal generate()."""

from __future__ import annotations

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

import ray  # a required dependency: a broken install fails here, it never skips

from ray.cluster_utils import Cluster

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment
from deployment.ray_actors import ray_init_kwargs
from kv_transfer.nixl import nixl_available

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    kwargs = ray_init_kwargs()
    ray.init(address=cluster.address, runtime_env=kwargs["runtime_env"], log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("transport,granularity", [
    ("ray", "request"), ("ray", "layer"),
    pytest.param("nixl", "layer", marks=pytest.mark.skipif(
        not nixl_available(), reason="pip install 'pdlab[nixl]'"))])
def test_disagg_across_two_nodes(tiny, two_nodes, transport, granularity):
    workload, expected = mixed_workload(tiny, num_requests=8)
    placement = PlacementConfig("disagg:1p1d", "cpu:0,cpu:1", address=two_nodes.address)
    with Deployment(placement, ModelConfig("tiny-random-llama"), ENGINE,
                    TransferConfig(transport=transport, granularity=granularity, timeout_s=10)
                    ) as deployment:
        nodes = {name: ray.get(handle.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()))
            for name, handle in deployment.handles.items()}
        assert nodes["prefill-0"] != nodes["decode-0"]  # one CPU per node: one worker each
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
        transfers = deployment.transfer_records()
        assert {t["transport"] for t in transfers} == {transport}
        peak = deployment.link_peaks["decode-0"]  # probed between the two nodes at start
        assert peak.method in ("nixl", "tcp") and peak.gbps > 0
        for t in transfers:
            assert t["peak_gbps"] == peak.gbps
            assert t["efficiency"] == pytest.approx(t["achieved_gbps"] / peak.gbps)
        if granularity == "layer":  # one record per layer, each scored once its stream ended
            assert all(t["layer_end"] - t["layer_start"] == 1 for t in transfers)
            for t in transfers:
                assert t["exposed_s"] + t["overlapped_s"] == pytest.approx(t["put_s"] + t["get_s"])
