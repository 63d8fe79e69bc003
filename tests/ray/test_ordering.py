"""Ordered commands through Ray: a threaded actor (max_concurrency 16, as placements make
them) applies ``submit``/``abort`` in the order the router sent them, and a method's own
exception reaches the router unwrapped (how a dead engine loop is recognised)."""

from __future__ import annotations

import pytest
from placement_helpers import OrderProbe, local_ray

import ray  # a required dependency: a broken install fails here, it never skips

from engine.serving import EngineLoopDied
from experiments.ray_actors import RayCalls

pytestmark = pytest.mark.ray


def test_threaded_actor_runs_ordered_commands_in_sent_order():
    with local_ray(num_cpus=2):
        probe = ray.remote(OrderProbe).options(max_concurrency=16, num_cpus=0).remote()
        calls = RayCalls()
        sent = [("submit", i) if i % 3 else ("abort", i - 1) for i in range(1, 301)]
        pending = [calls.call(probe, method, i) for method, i in sent]
        ray.get(pending, timeout=60)
        assert ray.get(probe.history.remote(), timeout=60) == sent
        assert calls.result(pending[0]) == 1  # each call returns its own result
        poll = calls.call(probe, "wait_events", 0.1)
        assert calls.ready([poll], 30.0)
        with pytest.raises(EngineLoopDied, match="probe: engine loop died: RuntimeError: boom"):
            calls.result(poll)
