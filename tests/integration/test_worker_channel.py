"""A worker's loop over the message plane (``EngineLoop.open_channel``): commands in through
its port, one message out per engine step with that step's events; greedy outputs equal
``generate()``; a loop that dies falls silent and its hub reports the death. Both channel
implementations, the tiny model, one process (the sockets one still crosses ipc)."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import ENGINE

from channel.contract import ABORT, SUBMIT, Command, Died, Message
from channel.local import LocalHub
from channel.sockets import SocketHub
from engine import events as ev
from engine.config import ModelConfig
from engine.request import Request, SamplingParams
from engine.serving import EngineLoop

TINY = ModelConfig("tiny-random-llama")
BOUND_S = 60.0  # a broken channel fails the test, never hangs it


@pytest.fixture(params=["local", "zmq-ipc"])
def hub(request):
    hub = LocalHub(dead_after_s=3600.0) if request.param == "local" else SocketHub(
        "ipc", dead_after_s=3600.0)
    yield hub
    hub.close()


@pytest.fixture
def loop(hub):
    """A colocated worker's loop, its channel open on ``hub``; shut down after the test."""
    loop = EngineLoop("colocated-0", TINY, ENGINE, bind=False)
    try:
        loop.open_channel(hub.attach("colocated-0", 0))
        yield loop
    finally:
        loop.shutdown()


def receive_until(hub, done) -> list:
    items: list = []
    end_s = time.monotonic() + BOUND_S
    while not done(items):
        assert time.monotonic() < end_s, f"channel stalled; got {items[-3:]}"
        items.extend(hub.receive(0.5))
    return items


def finished(items, ids) -> bool:
    ended = {e.request_id for m in items if isinstance(m, Message)
             for e in ev.expand(m.body) if e.finish_reason or e.kind == ev.ERROR}
    return set(ids) <= ended


def test_a_colocated_loop_over_the_channel_sends_one_message_per_step(tiny, hub, loop):
    prompts = random_prompts([5, 9, 13])
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", tuple(prompt), SamplingParams(max_tokens=6))
        hub.send("colocated-0", Command(SUBMIT, request.request_id, (request,)))
    hub.send("colocated-0", Command("no-such-command", "r9"))
    items = receive_until(hub, lambda items: finished(items, ["r0", "r1", "r2", "r9"]))
    got = [m for m in items if isinstance(m, Message)]
    assert [m.seq for m in got] == list(range(len(got)))
    events = [e for m in got for e in ev.expand(m.body)]
    for i, prompt in enumerate(prompts):
        tokens = [e.token_id for e in events if e.request_id == f"r{i}" and e.kind == ev.TOKEN]
        assert tokens == reference_generate(tiny.model, prompt, 6)
    assert [(e.request_id, e.error) for e in events if e.kind == ev.ERROR] == [
        ("r9", "no-such-command failed: ValueError: unknown command 'no-such-command' "
               "(have: submit, admit, abort, release)")]
    # one message per step that produced tokens: never two messages for one step
    with_tokens = [m for m in got if any(e.kind == ev.TOKEN for e in ev.expand(m.body))]
    assert len(with_tokens) == len(loop.engine.step_records)


def test_an_abort_over_the_channel_ends_the_request_on_the_worker(hub, loop):
    launch_step, steps = loop.engine.launch_step, []

    def step_once_the_abort_arrived(on_launch=None):
        # r0's first step runs at once, later ones only once its abort reached the port: only
        # the abort can end it, never its 100 tokens
        if steps and on_launch is not None:
            on_launch()  # the last step's events leave now: the abort answers them
        end_s = time.monotonic() + BOUND_S
        while steps and loop._port.arrived < 2 and time.monotonic() < end_s:
            time.sleep(0.001)
        steps.append(launch_step(on_launch))
        return steps[-1]

    loop.engine.launch_step = step_once_the_abort_arrived
    request = Request("r0", (5, 6, 7), SamplingParams(max_tokens=100, ignore_eos=True))
    hub.send("colocated-0", Command(SUBMIT, "r0", (request,)))
    items = receive_until(hub, lambda items: any(isinstance(m, Message) for m in items))
    hub.send("colocated-0", Command(ABORT, "r0", ("r0",)))
    end_s = time.monotonic() + BOUND_S
    while not loop.call(loop.engine.is_empty):
        assert time.monotonic() < end_s, "the abort never reached the engine"
        items.extend(hub.receive(0.05))
    items.extend(hub.receive(0.05))
    events = [e for m in items if isinstance(m, Message) for e in ev.expand(m.body)]
    tokens = [e for e in events if e.kind == ev.TOKEN]
    assert 1 <= len(tokens) < 100 and not any(e.finish_reason for e in tokens), tokens


def test_a_loop_that_dies_falls_silent_and_its_hub_reports_it(hub, loop):
    def broken_step(on_launch=None):
        raise RuntimeError("boom")

    loop.engine.launch_step = broken_step
    hub.liveness.dead_after_s = 0.3
    hub.send("colocated-0", Command(SUBMIT, "r0", (Request("r0", (3, 4, 5),
                                                            SamplingParams(max_tokens=2)),)))
    items = receive_until(hub, lambda items: any(isinstance(i, Died) for i in items))
    assert [(d.worker, d.incarnation) for d in items if isinstance(d, Died)] == [
        ("colocated-0", 0)]
