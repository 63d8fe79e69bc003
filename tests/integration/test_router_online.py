"""The router's online interface (one router, two front ends) with real workers in one
process: ``submit`` from many threads streams exact greedy tokens, ``abort`` frees the KV
on every worker, a duplicate id is refused, the replay front end refuses to run beside the
online loop and works again after ``stop``."""

from __future__ import annotations

import threading

import pytest
from placement_helpers import ENGINE, assert_clean, mixed_workload

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from deployment.placement import Deployment
from router.router import FINISH, TOKEN

TINY = ModelConfig("tiny-random-llama")


@pytest.fixture(params=["colocated:1", "disagg:1p1d"])
def deployment(request):
    with Deployment(PlacementConfig(request.param, "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as dep:
        yield dep


def test_submit_from_threads_streams_exact_tokens_then_replay_runs_again(tiny, deployment):
    router = deployment.router
    workload, expected = mixed_workload(tiny, num_requests=6)
    router.start()
    try:
        with pytest.raises(RuntimeError, match="stop"):
            router.run(workload)
        outputs: dict[str, list] = {}

        def client(request: Request) -> None:
            outputs[request.request_id] = list(router.submit(request))

        threads = [threading.Thread(target=client, args=(r,)) for r, _ in workload]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        router.stop()
    for rid, events in outputs.items():
        tokens = [e.token_id for e in events if e.kind == TOKEN]
        assert tokens == expected[rid], rid
        assert [e.index for e in events if e.kind == TOKEN] == list(range(len(tokens)))
        assert events[-1].kind == FINISH and events[-1].record.output_token_ids == tokens
        assert events[-2].finish_reason == events[-1].finish_reason  # the last token says it
    records = router.run(workload)  # the replay front end, same router
    assert {r.request_id: r.output_token_ids for r in records} == expected
    assert_clean(deployment)


def test_abort_mid_decode_frees_kv_everywhere_and_duplicate_ids_are_refused(deployment):
    router = deployment.router
    long = Request("long", tuple(range(3, 20)), SamplingParams(max_tokens=100, ignore_eos=True))
    router.start()
    try:
        stream = router.submit(long)
        events = iter(stream)
        first = next(events)
        assert first.kind == TOKEN
        twin = router.submit(Request("long", (5, 6), SamplingParams(max_tokens=2))).result()
        assert twin.finish_reason == "error" and "already in flight" in twin.error
        router.abort("long")
        rest = list(events)
        assert rest[-1].kind == FINISH and rest[-1].finish_reason == "abort"
        assert rest[-1].record.error is None
        assert len(rest[-1].record.output_token_ids) < 100
        router.abort("long")  # twice, or unknown: ignored
        router.abort("nobody")
    finally:
        router.stop()
    assert router.loads == {name: 0 for name in router.loads}
    assert_clean(deployment)


def test_a_sink_that_raises_never_stops_the_loop(tiny, deployment):
    router = deployment.router
    workload, expected = mixed_workload(tiny, num_requests=2)
    (bad, _), (good, _) = workload

    def broken(event):
        raise RuntimeError("front end gone")

    router.start()
    try:
        router.submit(bad, broken)
        stream = router.submit(good)
        stream.timeout_s = 20.0  # a dead loop would leave it waiting: fail (queue.Empty) instead
        record = stream.result()
    finally:
        router.stop()
    assert record.output_token_ids == expected[good.request_id]
    assert_clean(deployment)


def test_a_submit_after_stop_is_answered_at_once(tiny, deployment):
    router = deployment.router
    workload, expected = mixed_workload(tiny, num_requests=1)
    (request, _), = workload
    router.start()
    router.stop()
    stream = router.submit(request)
    stream.timeout_s = 5.0  # nobody drives the loop: the refusal must already be there
    record = stream.result()
    assert record.finish_reason == "error" and "the router is stopped" in record.error
    records = router.run(workload)  # the replay front end still serves it
    assert [r.output_token_ids for r in records] == [expected[request.request_id]]
    assert_clean(deployment)


def test_a_loop_error_whose_cleanup_fails_too_still_answers_and_the_loop_lives(tiny, deployment):
    router = deployment.router
    workload, expected = mixed_workload(tiny, num_requests=2)
    (first, _), (second, _) = workload
    real_finish, real_step = router._finish, router._step
    broken = {"step": True, "finish": True}

    def step(timeout_s):  # the first step with a flight raises, as a router bug would
        if router._flights and broken.pop("step", False):
            raise RuntimeError("router bug")
        return real_step(timeout_s)

    def finish(flight, *args, **kwargs):  # and ending that flight fails once as well
        if broken.pop("finish", False):
            raise RuntimeError("abort could not be sent")
        return real_finish(flight, *args, **kwargs)

    router._step, router._finish = step, finish
    router.start()
    try:
        stream = router.submit(first)
        stream.timeout_s = 20.0
        record = stream.result()
        assert record.finish_reason == "error" and "ending it failed too" in record.error
        assert router.loop_errors == 2
        later = router.submit(second)
        later.timeout_s = 20.0
        assert later.result().output_token_ids == expected[second.request_id]  # loop alive
        assert router.loads == {name: 0 for name in router.loads}  # no charge left behind
    finally:
        router.stop()
        router._step, router._finish = real_step, real_finish
