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

        loop.engine.launch_step = broken_step  # where every step of the loop begins
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


@pytest.mark.parametrize("end", ["stopped", "dies"])
def test_a_loop_ending_right_after_a_step_still_sends_that_step_s_events(end):
    """A step's events wait for the next step to begin; the loop ends right after its first
    step (stopped, or ``_check_ranks`` raising at the next turn) with r0 unfinished. r0's
    first token still leaves, before the last words of a loop that died."""
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False)
    try:
        finish_step, stepped = loop.engine.finish_step, threading.Event()

        def one_step(*args, **kwargs):
            output = finish_step(*args, **kwargs)
            stepped.set()
            if end == "stopped":
                loop._stopped.set()
            return output

        def check_ranks():
            if stepped.is_set():
                raise RuntimeError("rank 1 died")

        loop.engine.finish_step, loop._check_ranks = one_step, check_ranks
        listen(loop)
        loop.submit(Request("r0", (3, 4, 5), SamplingParams(max_tokens=5)))
        loop._thread.join(timeout=30)
        assert not loop._thread.is_alive()
        events = collect_events(loop, lambda events: events and (
            end == "stopped" or events[-1].kind == DIED))
        assert [(e.kind, e.request_id, e.index) for e in events[:1]] == [("token", "r0", 0)]
        if end == "dies":
            assert [e.kind for e in events] == ["token", DIED]
            assert events[-1].error.endswith("RuntimeError: rank 1 died")
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

        deployment.handles["prefill-0"].engine.launch_step = broken_step
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
