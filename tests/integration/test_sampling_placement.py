"""Sampling through the engine and through placements (issue 8): a request whose sampling
cannot work fails alone (or is greedy below the documented threshold) while its greedy
step-mates keep their exact generate() output; seeded sampling gives the same tokens
colocated and disaggregated (both granularities), because each draw is seeded by
(seed, token index) and not by the process that made it."""

from __future__ import annotations

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import ENGINE, assert_clean

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from experiments.placement import Deployment

TINY = ModelConfig("tiny-random-llama")
CONFIG = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)


def generate(engine: Engine, requests: list[Request]):
    """``Engine.generate`` keeping what its steps report failed: (outputs, failed)."""
    outputs, failed = {r.request_id: [] for r in requests}, []
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        step = engine.step()
        failed += step.failed
        for out in step:
            outputs[out.request_id].append(out.token_id)
    return outputs, failed


def test_float32_zero_temperature_and_top_p_share_a_step_with_greedy(tiny):
    prompts = random_prompts([7, 11, 5], seed=21)
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-46, seed=3),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, top_p=1e-46, seed=4)]
    requests = [Request(f"r{i}", tuple(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine = Engine(tiny, CONFIG)
    outputs, failed = generate(engine, requests)
    assert failed == [] and engine.is_empty()
    assert all(s.num_requests == 3 for s in engine.step_records)  # they really shared steps
    for i, prompt in enumerate(prompts):  # the two odd ones reduce to argmax, as documented
        assert outputs[f"r{i}"] == reference_generate(tiny.model, prompt, 6)


def test_a_request_whose_logits_are_nan_fails_alone(tiny):
    prompts = random_prompts([6, 9], seed=22)
    good = Request("good", tuple(prompts[0]), SamplingParams(max_tokens=5, ignore_eos=True))
    bad = Request("bad", tuple(prompts[1]), SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    engine = Engine(tiny, CONFIG)
    execute = engine.runner.execute

    def poisoned(batch, hook=None):
        logits = execute(batch, hook).clone()  # an inference tensor cannot be edited
        rows = [s.request_id for i, s in enumerate(batch.requests) if batch.completes(i)]
        if "bad" in rows:
            logits[rows.index("bad")] = float("nan")
        return logits

    engine.runner.execute = poisoned
    outputs, failed = generate(engine, [good, bad])
    assert [rid for rid, _ in failed] == ["bad"] and "sampling failed" in failed[0][1]
    assert outputs["bad"] == []
    assert outputs["good"] == reference_generate(tiny.model, prompts[0], 5)
    assert engine.is_empty()


@pytest.fixture(scope="module")
def seeded_workload():
    prompts = random_prompts([4, 9, 13], seed=23)
    return [(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=8, temperature=1.0, seed=123,
                                                       ignore_eos=True)), 0.01 * i)
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("placement,granularity", [
    ("colocated:1", "request"), ("disagg:1p1d", "request"), ("disagg:1p1d", "layer")])
def test_seeded_sampling_is_placement_invariant(tiny, seeded_workload, placement, granularity):
    expected = Engine(tiny, ENGINE).generate([r for r, _ in seeded_workload])
    for request, _ in seeded_workload:  # really sampled, not argmax
        greedy = reference_generate(tiny.model, list(request.prompt_token_ids), 8)
        assert expected[request.request_id] != greedy
    with Deployment(PlacementConfig(placement, "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", granularity=granularity,
                                   layers_per_chunk=1, timeout_s=5.0), local=True) as deployment:
        records = deployment.run(seeded_workload)
        assert_clean(deployment)
    assert {r.request_id: r.output_token_ids for r in records} == expected
