"""On a Ray cluster pdlab starts, a ``cuda:i`` worker gets exactly GPU i: the placement's
own bundles and actor options (``deployment.ray_actors.gpu_actor_resources``) schedule and
reach the actor as the GPU it must make visible (``engine.device.PIN_ENV``; that
``bind_device`` applies it is ``tests/unit/test_device.py``'s). Stand-in actors, no GPU."""

from __future__ import annotations

import ray
import pytest
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import device as dev
from deployment.ray_actors import gpu_actor_resources, local_cluster_kwargs, ray_init_kwargs

pytestmark = pytest.mark.ray
DEVICES = ("cuda:0", "cuda:1")


def test_each_cuda_worker_is_pinned_to_its_own_gpu(monkeypatch):
    class PinProbe:  # defined here: pickled by value, so its actor imports neither torch nor pdlab
        def pin(self) -> str | None:
            import os

            return os.environ.get("PDLAB_CUDA_VISIBLE_DEVICES")  # engine.device.PIN_ENV

    monkeypatch.setenv(dev.VISIBLE_ENV, "5,6")  # the driver's own view: cuda:i = GPU 5 + i
    ray.init(**{**ray_init_kwargs(), **local_cluster_kwargs(DEVICES), "num_cpus": 2})
    try:
        resources = [gpu_actor_resources(d, pinned=True) for d in DEVICES]
        group = placement_group([bundle for bundle, _ in resources], strategy="PACK")
        ray.get(group.ready(), timeout=60)
        # created last first: the bundle, not the order of creation, decides the GPU
        actors = {d: ray.remote(PinProbe).options(
                      **resources[i][1], scheduling_strategy=PlacementGroupSchedulingStrategy(
                          group, placement_group_bundle_index=i)).remote()
                  for i, d in reversed(list(enumerate(DEVICES)))}
        assert {d: ray.get(a.pin.remote(), timeout=60) for d, a in actors.items()} == {
            "cuda:0": "5", "cuda:1": "6"}
        assert ray.cluster_resources().get("GPU", 0) == 0  # Ray hands out no GPU of its own
        remove_placement_group(group)
    finally:
        ray.shutdown()
