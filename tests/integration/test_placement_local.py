"""Placements in one process (plain worker objects, in-process transport): outputs equal
generate(), timelines are complete, failures end requests with a named cause, nothing leaks."""

from __future__ import annotations

import threading

import pytest
from placement_helpers import (ENGINE, assert_clean, assert_outputs, boundary_workload,
                               kill_once_decoding, mixed_workload, was_decoding_on)

from engine import metrics
from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from deployment.placement import Deployment

TINY = ModelConfig("tiny-random-llama")


def deploy(placement, granularity="request", faults=None, timeout_s=5.0, devices="cpu:0,cpu:1"):
    return Deployment(PlacementConfig(placement, devices), TINY, ENGINE,
                      TransferConfig(transport="inprocess", granularity=granularity,
                                     layers_per_chunk=1, timeout_s=timeout_s),
                      local=True, faults=faults)


@pytest.mark.parametrize("placement,granularity", [
    ("colocated:2", "request"), ("colocated-nochunk:2", "request"),
    ("disagg:1p1d", "request"), ("disagg:1p1d", "layer"),
])
def test_greedy_through_placement(tiny, placement, granularity):
    workload, expected = mixed_workload(tiny)
    with deploy(placement, granularity) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)
        chunked = {info["enable_chunked_prefill"] for info in deployment.gather("info")}
        steps = deployment.step_records()
        transfers, peaks = deployment.transfer_records(), deployment.link_peaks
    assert chunked == {placement != "colocated-nochunk:2"}
    if placement == "colocated-nochunk:2":  # every prompt ran whole: no step split one
        assert sum(s["num_prefill_tokens"] for s in steps) == sum(r.num_prompt_tokens for r in records)
        assert all(s["num_prefill_tokens"] in _prompt_sums(records) for s in steps
                   if s["num_prefill_tokens"])
    for record in records:
        assert record.placement == placement
        for event in (metrics.ARRIVED, metrics.PREFILL_QUEUED, metrics.PREFILL_STARTED,
                      metrics.PREFILL_FINISHED, metrics.FINISHED):
            assert event in record.timeline
        if placement.startswith("disagg"):
            assert record.kv_bytes == 2 * 2 * 2 * 16 * record.num_prompt_tokens * 4
            times = [record.timeline[e] for e in (metrics.ARRIVED, metrics.PREFILL_STARTED,
                     metrics.PREFILL_FINISHED, metrics.KV_PUT, metrics.KV_GOT,
                     metrics.DECODE_ADMITTED, metrics.FINISHED)]
            assert times == sorted(times)
            assert record.kv_transfer_s > 0
    if placement.startswith("disagg"):  # every record scored against the memcpy peak
        assert peaks["decode-0"].method == "memcpy" and peaks["decode-0"].gbps > 0
        assert len(transfers) == len(records) * (2 if granularity == "layer" else 1)
        for t in transfers:
            assert t["peak_gbps"] == peaks["decode-0"].gbps
            assert t["efficiency"] == pytest.approx(t["achieved_gbps"] / t["peak_gbps"])
            assert t["exposed_s"] + t["overlapped_s"] == pytest.approx(t["put_s"] + t["get_s"])
    else:
        assert peaks == {} and transfers == []


@pytest.mark.parametrize("placement,granularity", [
    ("colocated:1", "request"), ("disagg:1p1d", "request"), ("disagg:1p1d", "layer")])
def test_block_boundary_lengths_through_placement(tiny, placement, granularity):
    """Prompts and reservations of 15-17 and 31-33 tokens (block size 16) are token-exact,
    and every KV block is free at the end (``assert_clean``: ``engine_empty``)."""
    workload, expected = boundary_workload(tiny)
    with deploy(placement, granularity, devices="cpu:0" if placement == "colocated:1"
                else "cpu:0,cpu:1") as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert_clean(deployment)


def _prompt_sums(records) -> set[int]:
    """Every total of whole prompts some subset of ``records`` can make."""
    sums = {0}
    for record in records:
        sums |= {s + record.num_prompt_tokens for s in sums}
    return sums


def test_many_concurrent_requests_never_mix_kv(tiny):
    workload, expected = mixed_workload(tiny, num_requests=18, max_tokens=12, spacing_s=0.003)
    # round_robin: both prefill workers produce KV for the one decode worker whatever the
    # timing (least_loaded sends every request to prefill-0 when each prefill ends before the
    # next arrival, and the check below then failed by chance)
    with Deployment(PlacementConfig("disagg:2p1d", "cpu:0,cpu:1,cpu:0-1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5), local=True,
                    policy="round_robin") as deployment:
        records = deployment.run(workload)
        assert_outputs(records, expected)
        assert sorted(r.prefill_worker for r in records) == ["prefill-0"] * 9 + ["prefill-1"] * 9
        assert_clean(deployment)


def test_bad_request_fails_alone(tiny):
    workload, expected = mixed_workload(tiny, num_requests=4)
    too_long = Request("long", tuple(range(3, 123)), SamplingParams(max_tokens=20))
    bad_token = Request("vocab", (5, 999), SamplingParams(max_tokens=2))
    with deploy("disagg:1p1d") as deployment:
        records = deployment.run(workload + [(too_long, 0.0), (bad_token, 0.0)])
        by_id = {r.request_id: r for r in records}
        assert "exceeds the context length 128" in by_id["long"].error
        assert "prompt_token_ids must be in [0, 256)" in by_id["vocab"].error
        assert_outputs([by_id[f"r{i}"] for i in range(4)], expected)
        assert_clean(deployment)


@pytest.mark.parametrize("fault,causes", [
    ({"fail": True}, ["injected put failure"]),
    ({"corrupt": True}, ["KVChecksumError"]),
    # the get gave up at its own deadline (what was left of the 1 s): the 10 s delay would
    # have met the router's 6 s deadline first
    ({"delay_s": 10.0}, ["TransferTimeout: KV for request r2 not received within ",
                         " s (injected delay of 10.0 s)"]),
    ({"drop": True}, ["TransferTimeout: KV for request r2 not received within ",
                      " s (injected drop)"]),
])
def test_transfer_faults_fail_only_their_request(tiny, fault, causes):
    workload, expected = mixed_workload(tiny, num_requests=6)
    on = "decode-0" if "delay_s" in fault or "drop" in fault else "prefill-0"
    with deploy("disagg:1p1d", faults={on: {**fault, "only_request_ids": ["r2"]}},
                timeout_s=1.0) as deployment:
        records = deployment.run(workload)
        assert_clean(deployment)
    by_id = {r.request_id: r for r in records}
    assert all(cause in by_id["r2"].error for cause in causes), by_id["r2"].error
    # every fault, a failed put too, comes after the first token left the router
    assert by_id["r2"].output_token_ids == expected["r2"][:1]
    assert_outputs([r for r in records if r.request_id != "r2"], expected)


def test_dead_decode_worker_fails_its_requests_naming_its_death(tiny):
    workload, expected = mixed_workload(tiny, num_requests=6, max_tokens=60)
    with deploy("disagg:1p2d", faults={"decode-0": {"step_delay_s": 0.05}},
                devices="cpu:0,cpu:1,cpu:0-1") as deployment:
        kill_once_decoding(deployment, "decode-0")
        records = deployment.run(workload)
        failed = [r for r in records if r.error]
        assert failed and all(was_decoding_on(r, "decode-0") for r in failed), failed
        # the named death, not the deadline, ended them
        assert all("decode worker decode-0 died: killed" in r.error for r in failed), failed
        assert_outputs([r for r in records if not r.error], expected)
        assert_clean(deployment)  # the live workers hold nothing


def test_dead_prefill_worker_fails_its_requests_and_router_goes_on(tiny):
    workload, expected = mixed_workload(tiny, num_requests=8, spacing_s=0.1)
    with deploy("disagg:2p1d", faults={"prefill-0": {"step_delay_s": 0.3}},
                devices="cpu:0,cpu:1,cpu:0-1") as deployment:
        threading.Timer(0.15, deployment.kill, ["prefill-0"]).start()
        records = deployment.run(workload)
        failed = [r for r in records if r.error]
        # queued or prefilling on prefill-0, or prefilled there with the KV it put lost
        assert failed and all(r.prefill_worker == "prefill-0" and
                              "prefill worker prefill-0 died" in r.error for r in failed), failed
        done = [r for r in records if not r.error]
        assert len(done) >= 4 and any(r.prefill_worker == "prefill-1" for r in done)
        assert_outputs(done, expected)
        assert_clean(deployment)


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 3 devices, the device set cpu:0,cpu:1 has 2"):
        deploy("disagg:2p1d")
    with pytest.raises(ValueError, match="device cpu:7 does not exist"):
        deploy("colocated:1", devices="cpu:7")
