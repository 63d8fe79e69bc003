"""Self-healing over Ray: a killed actor is started again in its own bundle by
pdlab (``deployment.restarts``, not Ray's actor restart), rejoins its pool and is routed to
again; the second death, past the budget, is final and says so."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import ENGINE, assert_clean

import ray  # a required dependency: a broken install fails here, it never skips

from engine.config import ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from deployment.placement import Deployment

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("shared_ray")]
TINY = ModelConfig("tiny-random-llama")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    end_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end_s, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_killed_decode_actor_restarts_rejoins_then_its_budget_runs_out(tiny):
    """4 requests decoding (50 ms steps) when decode-0's actor is killed: they fail naming
    it; a request sent right after the kill waits for the new actor and gives generate()'s
    tokens; the second kill is final: a request fails at once naming the spent budget."""
    prompts = random_prompts([5, 7, 9, 11, 6], seed=2)
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="ray", timeout_s=5.0),
                    faults={"decode-0": {"step_delay_s": 0.05}}, deadline_s=120.0,
                    max_worker_restarts=1) as dep:
        router = dep.router
        router.start()
        try:
            old = dep.handles["decode-0"]
            streams = [router.submit(Request(f"a{i}", tuple(p), SamplingParams(
                max_tokens=60, ignore_eos=True))) for i, p in enumerate(prompts[:4])]
            wait_for(lambda: router.num_running == 4, 60, "4 requests decoding")
            time.sleep(0.3)
            dep.kill("decode-0")
            new = router.submit(Request("new", tuple(prompts[4]), SamplingParams(max_tokens=6)))
            for stream in streams:
                record = stream.result()
                assert "decode worker decode-0 died" in record.error, record.error
                assert len(record.output_token_ids) < 60
            record = new.result()
            assert record.error is None, record.error
            assert record.output_token_ids == reference_generate(tiny.model, prompts[4], 6)
            # the new actor's transport got the link peak measured at start again
            kv = ray.get(dep.handles["decode-0"].transfer_records.remote(), timeout=30)
            assert [r["peak_gbps"] for r in kv] == [dep.link_peaks["decode-0"].gbps]
            assert kv[0]["efficiency"] is not None
            worker = router.workers["decode-0"]
            assert (worker.state, worker.restarts, worker.incarnation) == ("live", 1, 1)
            assert dep.handles["decode-0"] is not old and worker.handle is dep.handles["decode-0"]
            assert_clean(dep)
            dep.kill("decode-0")
            wait_for(lambda: worker.state == "dead", 60, "the final death")
            record = router.submit(Request("after", tuple(prompts[0]),
                                           SamplingParams(max_tokens=3))).result()
            assert "no live decode worker" in record.error
            assert "restart budget of 1 (--max-worker-restarts) is spent" in record.error
            assert dep.restarts.attempts == {"decode-0": 1}
        finally:
            router.stop()
        assert set(router.loads.values()) == {0}
