"""A disaggregated placement spanning two Ray nodes (``ray.cluster_utils.Cluster``): the KV
crosses nodes through the object store, and the tokens still equal generate()."""

from __future__ import annotations

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

import ray  # a required dependency: a broken install fails here, it never skips

from ray.cluster_utils import Cluster

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from experiments.placement import Deployment
from experiments.ray_actors import ray_init_kwargs

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


@pytest.mark.parametrize("granularity", ["request", "layer"])
def test_disagg_across_two_nodes(tiny, two_nodes, granularity):
    workload, expected = mixed_workload(tiny, num_requests=8)
    placement = PlacementConfig("disagg:1p1d", "cpu:0,cpu:1", address=two_nodes.address)
    with Deployment(placement, ModelConfig("tiny-random-llama"), ENGINE,
                    TransferConfig(transport="ray", granularity=granularity, timeout_s=10)
                    ) as deployment:
        nodes = {name: ray.get(handle.__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_node_id()))
            for name, handle in deployment.handles.items()}
        assert nodes["prefill-0"] != nodes["decode-0"]  # one CPU per node: one worker each
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
