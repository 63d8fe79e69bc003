"""Soak over Ray: 500 requests through ``disagg:1p1d`` as Ray actors with the Ray
object-store transport, 5% of the transfers failed, corrupted (prefill side) or delayed
(decode side) by stacked fault wrappers. Every request finishes or fails with a named
cause, the healthy ones (delayed included) give generate()'s tokens, and at the end both
engines are empty, both transports hold nothing and the router's loads are 0.
Aborts while the KV is in flight need the decode worker's internals: the in-process and
shm soak (tests/integration/test_soak.py) covers them.
"""

from __future__ import annotations

import pytest
from placement_helpers import assert_clean, soak_workload

import ray  # a required dependency: a broken install fails here, it never skips

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
TINY = ModelConfig("tiny-random-llama")
NUM_REQUESTS, NUM_PROMPTS, MAX_TOKENS = 500, 16, 4
ENGINE = EngineConfig(max_num_seqs=16, max_model_len=64, max_num_batched_tokens=128)
FAILED = set(range(7, NUM_REQUESTS, 60))       # put fails
CORRUPTED = set(range(27, NUM_REQUESTS, 60))   # one byte flipped: checksum error at the get
DELAYED = set(range(47, NUM_REQUESTS, 60))     # get 0.2 s late, within the 3 s deadline


def rid(i: int) -> str:
    return f"q{i:03d}"


def test_soak_500_requests_through_ray_with_faults(tiny):
    items, expected = soak_workload(tiny, NUM_REQUESTS, NUM_PROMPTS, MAX_TOKENS)
    faults = {"prefill-0": [{"fail": True, "only_request_ids": [rid(i) for i in FAILED]},
                            {"corrupt": True, "only_request_ids": [rid(i) for i in CORRUPTED]}],
              "decode-0": {"delay_s": 0.2, "only_request_ids": [rid(i) for i in DELAYED]}}
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="ray", timeout_s=3.0), faults=faults) as deployment:
        records = deployment.run(items)
        assert_clean(deployment)
        loads = dict(deployment.router.loads)
    by_id = {r.request_id: r for r in records}
    assert len(by_id) == NUM_REQUESTS
    for i in range(NUM_REQUESTS):
        record = by_id[rid(i)]
        cause = ("injected put failure" if i in FAILED else
                 "KVChecksumError" if i in CORRUPTED else None)
        if cause is not None:
            assert record.error and cause in record.error, (i, record.error)
        else:  # healthy, delayed included: exact greedy output
            assert record.error is None, (i, record.error)
            assert record.output_token_ids == expected[rid(i)], i
    assert (len(FAILED) + len(CORRUPTED) + len(DELAYED)) / NUM_REQUESTS == 0.05
    assert loads == {"prefill-0": 0, "decode-0": 0}


def test_soak_500_requests_through_ray_with_faults_and_the_prefill_actor_killed(tiny):
    """The same soak, prefill-0's actor killed 0.5 s in and restarted (budget 1): every
    request ends; the faulted ones fail with their cause; the ones prefill-0 held when the
    router learnt of its death fail naming it (prefilling there, or their KV, owned by the
    dead actor, lost on the way); every other one, those that waited for the new actor
    included, gives
    generate()'s tokens; at the end both engines are empty, both transports hold nothing,
    the loads are 0 and prefill-0 is live again."""
    import dataclasses
    import threading
    import time

    items, expected = soak_workload(tiny, NUM_REQUESTS, NUM_PROMPTS, MAX_TOKENS)
    # prefill-0's steps take 10 ms more, so that it always holds prompts when it is killed
    # (a worker that keeps up with prompts 2 ms apart may hold none at that instant)
    faults = {"prefill-0": [{"fail": True, "only_request_ids": [rid(i) for i in FAILED]},
                            {"corrupt": True, "only_request_ids": [rid(i) for i in CORRUPTED]},
                            {"step_delay_s": 0.01}],
              "decode-0": {"delay_s": 0.2, "only_request_ids": [rid(i) for i in DELAYED]}}
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="ray", timeout_s=3.0), faults=faults,
                    deadline_s=120.0, max_worker_restarts=1) as deployment:
        kills: list[float] = []
        timer = threading.Timer(0.5, lambda: (kills.append(time.time()),
                                              deployment.kill("prefill-0")))
        timer.start()
        records = deployment.run(items)
        timer.join()
        # one more request: it waits for prefill-0 if the run ended before it was back
        after = deployment.run([(dataclasses.replace(items[0][0], request_id="after"), 0.0)])
        assert after[0].error is None and after[0].output_token_ids == expected[rid(0)]
        worker = deployment.router.workers["prefill-0"]
        assert_clean(deployment)
        loads = dict(deployment.router.loads)
    assert (worker.state, worker.restarts) == ("live", 1)
    by_id = {r.request_id: r for r in records}
    assert len(by_id) == NUM_REQUESTS
    lost = []
    # the router knew of the death when it failed the first request naming it; requests
    # that arrived between the kill and then went to prefill-0 too
    known_s = min(r.timeline["finished"] for r in records
                  if r.error and "prefill worker prefill-0 died" in r.error)
    assert known_s >= kills[0]
    for i in range(NUM_REQUESTS):
        record = by_id[rid(i)]
        cause = ("injected put failure" if i in FAILED else
                 "KVChecksumError" if i in CORRUPTED else None)
        if cause is not None and record.error and cause in record.error:
            continue
        if record.error is not None:  # what prefill-0 held when it was killed
            assert record.timeline["arrived"] < known_s, (i, record.error)
            assert ("prefill worker prefill-0 died" in record.error
                    or "KV transfer failed" in record.error), (i, record.error)
            lost.append(i)
        else:
            assert cause is None, (i, "a faulted request succeeded")
            assert record.output_token_ids == expected[rid(i)], i
    assert lost and len(lost) < NUM_REQUESTS / 2
    assert loads == {"prefill-0": 0, "decode-0": 0}
