"""Worker liveness: an exception that escapes an engine loop kills the worker at once (its
last words name the cause, its calls raise, the router fails its requests naming the cause
and routes nothing new to it). Plain worker objects in this process (tiny model, no Ray)."""

from __future__ import annotations

import threading
import time

import pytest
from placement_helpers import (ENGINE, assert_clean, assert_outputs, collect_events, listen,
                               mixed_workload)

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from engine.events import DIED
from engine.serving import EngineLoop, EngineLoopDied
from deployment.placement import Deployment

pytestmark = pytest.mark.workers
TINY = ModelConfig("tiny-random-llama")


def test_an_exception_escaping_the_loop_kills_the_worker_at_once():
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False)
    try:
        def broken_step(on_launch=None):
            raise RuntimeError("boom")

        loop.engine.start_step = broken_step
        listen(loop)  # its channel is open
        loop.submit(Request("r0", (3, 4, 5), SamplingParams(max_tokens=2)))
        loop._thread.join(timeout=10)
        assert not loop._thread.is_alive()
        cause = "colocated worker colocated-0: engine loop died: RuntimeError: boom"
        events = collect_events(loop, lambda events: events)
        assert [(e.kind, e.error) for e in events] == [(DIED, cause)]  # its last words
        with pytest.raises(EngineLoopDied, match=cause):
            loop.status()
    finally:
        loop.shutdown()


def test_call_raises_the_callee_s_error_and_never_waits_out_a_dead_loop():
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False)
    try:
        def fails():
            raise KeyError("no such request")

        with pytest.raises(KeyError, match="no such request"):
            loop.call(fails, timeout_s=30.0)
        assert loop.call(lambda: 7) == 7  # the loop carried on
        started = threading.Event()

        def dies_while_a_call_waits():
            started.set()
            raise SystemExit("loop killed")  # BaseException: escapes the command guard
        loop._commands.put(dies_while_a_call_waits)
        started.wait(10)
        # an hour's timeout: only a check of the dead loop ends the call (pytest's timeout
        # guards a hang)
        with pytest.raises(EngineLoopDied, match="loop killed"):
            loop.call(lambda: 1, timeout_s=3600.0)
    finally:
        loop.shutdown()


def test_router_fails_a_dead_loop_s_requests_naming_the_cause_and_moves_on(tiny):
    """prefill-0's loop dies on its first step; the deadline is 60 s, so the errors can only
    come from liveness; requests arriving later all go to prefill-1 and decode exactly."""
    workload, expected = mixed_workload(tiny, num_requests=8, spacing_s=0.1)
    with Deployment(PlacementConfig("disagg:2p1d", "cpu:0,cpu:1,cpu:0-1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                    policy="round_robin", deadline_s=60.0) as deployment:
        def broken_step(on_launch=None):
            raise RuntimeError("boom")

        deployment.handles["prefill-0"].engine.start_step = broken_step
        records = deployment.run(workload)
        failed = [r for r in records if r.error]
        assert failed and all(r.prefill_worker == "prefill-0" for r in failed)
        assert all("prefill worker prefill-0 died: prefill worker prefill-0: engine loop "
                   "died: RuntimeError: boom" in r.error for r in failed), failed[0].error
        done = [r for r in records if not r.error]
        assert len(done) >= 4 and {r.prefill_worker for r in done} == {"prefill-1"}
        assert_outputs(done, expected)
        assert not deployment.router.workers["prefill-0"].alive
        assert deployment.router.loads == {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}
        assert_clean(deployment)  # the live workers hold nothing
