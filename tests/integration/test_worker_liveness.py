"""Worker liveness and command order: an exception that escapes an engine loop kills the
worker at once (its polls raise, the router fails its requests naming the cause and routes
nothing new to it); ordered commands run in their numbered order whatever order they
arrive in. Plain worker objects in this process (tiny model, no Ray)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from engine.serving import EngineLoop, EngineLoopDied, InOrder
from deployment.placement import Deployment

pytestmark = pytest.mark.workers
TINY = ModelConfig("tiny-random-llama")


def test_in_order_runs_calls_by_number_whatever_order_they_arrive_in():
    late_errors = []
    in_order, ran = InOrder(on_late_error=lambda fn, args, err: late_errors.append(
        (args, str(err)))), []
    numbers = list(range(40))
    random.Random(0).shuffle(numbers)
    threads = [threading.Thread(target=in_order.run, args=(n, ran.append, n)) for n in numbers]
    for thread in threads:
        thread.start()
        time.sleep(0.001)  # let late numbers arrive first, really out of order
    for thread in threads:
        thread.join(timeout=10)
    assert ran == list(range(40))
    assert in_order.run(40, lambda: "its own result") == "its own result"
    with pytest.raises(ValueError, match="call number 3 came twice"):
        in_order.run(3, ran.append, 3)
    # an early arrival never waits: it is parked (None at once) and runs when the gap fills
    assert in_order.run(42, ran.append, 42) is None and ran[-1] == 39
    with pytest.raises(ValueError, match="call number 42 came twice"):
        in_order.run(42, ran.append, 42)

    def fails(x):
        raise RuntimeError(f"bad {x}")
    in_order.run(43, fails, "late")  # parked too
    with pytest.raises(RuntimeError, match="bad own"):
        in_order.run(41, fails, "own")  # runs now, raises its own error, then 42 and 43 run
    assert ran[-1] == 42
    assert late_errors == [(("late",), "bad late")]


def test_an_exception_escaping_the_loop_kills_the_worker_at_once():
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False)
    try:
        def broken_step(on_launch=None):
            raise RuntimeError("boom")

        loop.engine.start_step = broken_step
        loop.submit(Request("r0", (3, 4, 5), SamplingParams(max_tokens=2)))
        loop._thread.join(timeout=10)
        assert not loop._thread.is_alive()
        cause = "colocated worker colocated-0: engine loop died: RuntimeError: boom"
        with pytest.raises(EngineLoopDied, match=cause):
            loop.wait_events(5.0)
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
        t0 = time.monotonic()
        with pytest.raises(EngineLoopDied, match="loop killed"):
            loop.call(lambda: 1, timeout_s=30.0)
        assert time.monotonic() - t0 < 5.0  # raised at the next check, not after 30 s
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
