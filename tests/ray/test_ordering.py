"""Ordered commands through Ray: a threaded actor (max_concurrency 16, as placements make
them) applies ``submit``/``abort`` in the order the router sent them, and a method's own
exception reaches the router unwrapped (how a dead engine loop is recognised), leaving no
reference cycle that keeps the caller's frames alive."""

from __future__ import annotations

import gc
import weakref

import pytest
from placement_helpers import OrderProbe, local_ray

import ray  # a required dependency: a broken install fails here, it never skips

from engine.serving import EngineLoopDied
from deployment.ray_actors import RayCalls
from router.calls import WorkerDied

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


class _Local:
    """A local of the caller's frame (the router loop's ``pending``: its calls in flight)."""


def _collect_failed(calls: RayCalls, pending, local: _Local) -> type:
    try:
        calls.result(pending)
    except Exception as err:
        return type(err)
    raise AssertionError("the call did not fail")


def test_a_failed_call_leaves_its_callers_frames_to_reference_counting():
    """``ray.get`` raises an error object its own frame holds (a reference cycle through the
    traceback); the caller's frames, and the ObjectRefs among their locals, must not ride
    on that cycle until the cycle collector runs: in the router they held a prefill
    worker's poll result, so the KV handles it carried stayed alive long after their request
    finished. Both ways a call fails: the method raised, the actor died."""
    with local_ray(num_cpus=2):
        probe = ray.remote(OrderProbe).options(max_concurrency=16, num_cpus=0).remote()
        calls = RayCalls()
        raised = calls.call(probe, "wait_events", 0.1)
        assert calls.ready([raised], 30.0)
        # ray.kill only asks for the kill: a call sent after it can still run first (a
        # "history" call did, under load, and returned), so the call that must die with the
        # actor is one that never returns, sent before
        died = calls.call(probe, "hang")
        ray.kill(probe, no_restart=True)
        assert calls.ready([died], 30.0)
        gc.disable()  # only reference counting frees what the calls left behind
        try:
            for pending, error in ((raised, EngineLoopDied), (died, WorkerDied)):
                local = _Local()
                alive = weakref.ref(local)
                assert _collect_failed(calls, pending, local) is error
                del local
                assert alive() is None, f"{error.__name__} kept its caller's frame alive"
        finally:
            gc.enable()
