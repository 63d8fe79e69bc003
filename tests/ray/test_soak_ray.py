"""Soak over Ray (issue 8): 500 requests through ``disagg:1p1d`` as Ray actors with the Ray
object-store transport, 5% of the transfers failed, corrupted (prefill side) or delayed
(decode side) by stacked fault wrappers. Every request finishes or fails with a named
cause, the healthy ones (delayed included) give generate()'s tokens, and at the end both
engines are empty, both transports hold nothing and the router's loads are 0.
Aborts while the KV is in flight need the decode worker's internals: the in-process and
shm soak (tests/integration/test_soak.py) covers them.
"""

from __future__ import annotations

import pytest
from placement_helpers import assert_clean, local_ray, soak_workload

import ray  # a required dependency: a broken install fails here, it never skips

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from experiments.placement import Deployment

pytestmark = pytest.mark.ray
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
    with local_ray(), Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                                 TransferConfig(transport="ray", timeout_s=3.0),
                                 faults=faults) as deployment:
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
