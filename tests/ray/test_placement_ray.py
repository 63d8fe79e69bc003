"""Placements as Ray actors on a local cluster: every transport and granularity gives
generate()'s tokens, dead workers turn into named errors within the deadline, nothing leaks."""

from __future__ import annotations

import threading

import pytest
from placement_helpers import (ENGINE, assert_clean, assert_outputs, boundary_workload,
                               kill_once_decoding, mixed_workload, was_decoding_on)

import ray  # a required dependency: a broken install fails here, it never skips

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment
from kv_transfer.nixl import nixl_available

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
TINY = ModelConfig("tiny-random-llama")
NEEDS_NIXL = pytest.mark.skipif(not nixl_available(), reason="pip install 'pdlab[nixl]'")


def deploy(placement, transport="ray", granularity="request", devices="cpu:0,cpu:1",
           faults=None, timeout_s=5.0, model=TINY, engine=ENGINE):
    return Deployment(PlacementConfig(placement, devices), model, engine,
                      TransferConfig(transport=transport, granularity=granularity,
                                     timeout_s=timeout_s), faults=faults)


@pytest.mark.parametrize("placement,transport,granularity,num_requests", [
    ("colocated:2", "ray", "request", 8),
    ("disagg:1p1d", "ray", "request", 18),  # 18 concurrent requests of mixed lengths
    ("disagg:1p1d", "ray", "layer", 8),
    ("disagg:1p1d", "torchdist", "request", 8),
    ("disagg:1p1d", "torchdist", "layer", 8),
    pytest.param("disagg:1p1d", "nixl", "request", 8, marks=NEEDS_NIXL),
])
def test_greedy_through_ray_placement(tiny, placement, transport, granularity, num_requests):
    workload, expected = mixed_workload(tiny, num_requests=num_requests, spacing_s=0.005)
    boundary, boundary_expected = boundary_workload(tiny, start_s=0.005 * num_requests)
    workload, expected = workload + boundary, {**expected, **boundary_expected}  # block edges
    with deploy(placement, transport, granularity) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)  # engines empty, object store / sends released
        if placement.startswith("disagg"):
            transfers = deployment.transfer_records()
            per_request = {}
            for t in transfers:
                per_request[t["request_id"]] = per_request.get(t["request_id"], 0) + t["num_bytes"]
            for record in records:  # bytes = 2 * layers * kv_heads * head_dim * tokens * 4
                want = 2 * 2 * 2 * 16 * record.num_prompt_tokens * 4
                assert record.kv_bytes == want == per_request[record.request_id]


def test_corrupted_transfer_fails_only_its_request(tiny):
    workload, expected = mixed_workload(tiny, num_requests=6)
    with deploy("disagg:1p1d", faults={"prefill-0": {"corrupt": True, "only_request_ids": ["r3"]}}
                ) as deployment:
        records = deployment.run(workload)
        assert_clean(deployment)
    by_id = {r.request_id: r for r in records}
    assert "KVChecksumError" in by_id["r3"].error
    assert_outputs([r for r in records if r.request_id != "r3"], expected)


@pytest.mark.parametrize("transport", ["ray", pytest.param("nixl", marks=NEEDS_NIXL)])
def test_decode_actor_killed_mid_decode(tiny, transport):
    workload, expected = mixed_workload(tiny, num_requests=6, max_tokens=60)
    with deploy("disagg:1p2d", transport, devices="cpu:0,cpu:1,cpu:0-1",
                faults={"decode-0": {"step_delay_s": 0.05}}, timeout_s=3.0) as deployment:
        kill_once_decoding(deployment, "decode-0")
        records = deployment.run(workload)
        # the named death, not the deadline, ended them
        failed = [r for r in records if r.error]
        assert failed and all(was_decoding_on(r, "decode-0") for r in failed), failed
        assert all("decode worker decode-0 died" in r.error for r in failed), failed[0].error
        assert_outputs([r for r in records if not r.error], expected)
        assert_clean(deployment)


@pytest.mark.parametrize("transport", ["ray", pytest.param("nixl", marks=NEEDS_NIXL)])
def test_prefill_actor_killed_mid_prefill(tiny, transport):
    workload, expected = mixed_workload(tiny, num_requests=8, spacing_s=0.2)
    with deploy("disagg:2p1d", transport, devices="cpu:0,cpu:1,cpu:0-1",
                faults={"prefill-0": {"step_delay_s": 0.5}}, timeout_s=3.0) as deployment:
        threading.Timer(0.3, deployment.kill, ["prefill-0"]).start()
        records = deployment.run(workload)
        # every failed request was prefill-0's, and fails naming its death: queued or
        # prefilling there ("died: ..."), or prefilled with its KV lost before decode-0 fetched
        # it ("died holding the KV of ...": a Ray owner's objects die with it)
        failed = [r for r in records if r.error]
        assert failed and all(r.prefill_worker == "prefill-0" and
                              "prefill worker prefill-0 died" in r.error for r in failed), failed
        done = [r for r in records if not r.error]
        # the router moved on to the live worker (a request whose KV decode-0 fetched before
        # the kill landed finished, prefilled on prefill-0)
        assert any(r.prefill_worker == "prefill-1" for r in done)
        assert_outputs(done, expected)
        assert_clean(deployment)


@pytest.mark.slow
def test_smollm2_disaggregated_matches_generate(smollm2):
    from conftest import reference_generate

    from engine.request import Request, SamplingParams

    texts = ["What is the capital of France?", "Write a short poem about GPUs.",
             "List three prime numbers."]
    prompts = [smollm2.encode_chat(t) for t in texts]
    workload = [(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=12)), 0.0)
                for i, p in enumerate(prompts)]
    expected = {f"s{i}": reference_generate(smollm2.model, p, 12) for i, p in enumerate(prompts)}
    engine = EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64)
    with deploy("disagg:1p1d", model=ModelConfig("smollm2-135m"), engine=engine,
                timeout_s=30) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
