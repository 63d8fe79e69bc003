"""``RayCalls`` over a threaded actor (max_concurrency 16, as placements make them): a
method's own exception reaches the caller unwrapped (how a dead engine loop is recognised)
and an actor's death as ``WorkerDied``, leaving no reference cycle that keeps the caller's
frames alive."""

from __future__ import annotations

import gc
import weakref

import pytest
from placement_helpers import Probe

import ray  # a required dependency: a broken install fails here, it never skips

from engine.serving import EngineLoopDied
from deployment.ray_actors import RayCalls
from router.calls import WorkerDied

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]


class _Local:
    """A local of the caller's frame (the router loop's ``pending``: its calls in flight)."""


def _collect_failed(calls: RayCalls, pending, local: _Local) -> type:
    try:
        calls.result(pending)
    except Exception as err:
        return type(err)
    raise AssertionError("the call did not fail")


def test_a_failed_call_raises_its_own_error_and_leaves_its_callers_frames_alone():
    """``ray.get`` raises an error object its own frame holds (a reference cycle through the
    traceback); the caller's frames, and the ObjectRefs among their locals, must not ride
    on that cycle until the cycle collector runs: in the router they held a prefill
    worker's poll result, so the KV handles it carried stayed alive long after their request
    finished. Both ways a call fails: the method raised, the actor died."""
    probe = ray.remote(Probe).options(max_concurrency=16, num_cpus=0).remote()
    calls = RayCalls()
    raised = calls.call(probe, "fail")
    assert calls.ready([raised], 30.0)
    with pytest.raises(EngineLoopDied, match="probe: engine loop died: RuntimeError: boom"):
        calls.result(raised)
    # ray.kill only asks for the kill: a call sent after it can still run first, so the
    # call that must die with the actor is one that never returns, sent before
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
