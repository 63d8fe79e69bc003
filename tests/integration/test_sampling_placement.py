"""Sampling through the engine and through placements: a request whose sampling
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
from deployment.placement import Deployment

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


# ---- vLLM's extensions through the engine: exact against transformers ---------------------

class OpenAIPenalties:
    """An independent reference for presence / frequency penalties as a transformers logits
    processor: OpenAI's formula over the *generated* tokens (``input_ids`` past the prompt),
    one token at a time in plain Python."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids, scores):
        import collections
        scores = scores.clone()
        for token, count in collections.Counter(input_ids[0, self.num_prompt_tokens:].tolist()).items():
            scores[0, token] = scores[0, token] - self.frequency * count - self.presence
        return scores


def test_penalties_equal_transformers_generate_and_spare_step_mates(tiny):
    """Greedy with repetition_penalty equals generate(repetition_penalty=...) (prompt +
    output count); presence / frequency equal generate() with the OpenAI-formula processor
    above (output only); a plain greedy request in the same steps keeps its own output."""
    from transformers import LogitsProcessorList

    prompts = random_prompts([7, 11, 5, 9], seed=24)
    n = 12
    params = [SamplingParams(max_tokens=n, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=n, ignore_eos=True, repetition_penalty=0.6),
              SamplingParams(max_tokens=n, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=1.0, repetition_penalty=1.2),
              SamplingParams(max_tokens=n, ignore_eos=True)]
    requests = [Request(f"p{i}", tuple(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine = Engine(tiny, CONFIG)
    outputs, failed = generate(engine, requests)
    assert failed == [] and engine.is_empty()
    assert all(s.num_requests == 4 for s in engine.step_records)  # they shared every step
    want = [reference_generate(tiny.model, prompts[0], n, repetition_penalty=1.5),
            reference_generate(tiny.model, prompts[1], n, repetition_penalty=0.6),
            reference_generate(tiny.model, prompts[2], n, repetition_penalty=1.2,
                               logits_processor=LogitsProcessorList(
                                   [OpenAIPenalties(len(prompts[2]), 1.5, 1.0)])),
            reference_generate(tiny.model, prompts[3], n)]
    assert [outputs[f"p{i}"] for i in range(4)] == want
    for i in range(3):  # each penalty really changed the output
        assert want[i] != reference_generate(tiny.model, prompts[i], n), i


def test_min_tokens_equals_transformers_min_new_tokens(tiny):
    """A stop id the plain greedy run emits as its 2nd token is masked until min_tokens
    outputs exist (as generate(min_new_tokens=...) masks its eos ids), then it stops there
    when it comes again; min_tokens also masks the model's EOS."""
    prompt = random_prompts([9], seed=25)[0]
    plain = reference_generate(tiny.model, prompt, 10)
    stop = plain[1]
    engine = Engine(tiny, CONFIG)
    early = engine.generate([Request("e", tuple(prompt), SamplingParams(
        max_tokens=10, stop_token_ids=(stop,)))])["e"]
    assert early == plain[:2]
    late = engine.generate([Request("m", tuple(prompt), SamplingParams(
        max_tokens=10, stop_token_ids=(stop,), min_tokens=5))])["m"]
    want = reference_generate(tiny.model, prompt, 10, min_new_tokens=5,
                              eos_token_id=[stop, *tiny.eos_token_ids])
    assert late == want and stop not in late[:5] and len(late) >= 5
    assert engine.is_empty()


@pytest.fixture(scope="module")
def penalized_workload():
    """Seeded sampling and greedy with the extensions on. Negative presence / frequency and
    a repetition penalty < 1 favour the tokens already seen, so a decode worker whose history
    lacked the prompt or the first token would pick other tokens."""
    prompts = random_prompts([6, 10, 14, 3, 8], seed=26)
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.6)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=7, min_p=0.05, top_k=-1,
                             min_tokens=4, **penalties),
              SamplingParams(max_tokens=10, temperature=0.8, seed=8, top_p=0.9, min_tokens=4,
                             presence_penalty=-2.0),
              SamplingParams(max_tokens=10, temperature=0.5, seed=9, top_k=40, min_p=0.1,
                             repetition_penalty=0.3),
              SamplingParams(max_tokens=10, min_tokens=4, frequency_penalty=-1.0),
              SamplingParams(max_tokens=10, min_tokens=4, **penalties)]
    return [(Request(f"x{i}", tuple(p), sp), 0.01 * i)
            for i, (p, sp) in enumerate(zip(prompts, params))]


@pytest.mark.parametrize("placement,granularity", [
    ("colocated:1", "request"), ("disagg:1p1d", "request")])
def test_penalized_sampling_is_placement_invariant(tiny, penalized_workload, placement,
                                                   granularity):
    """The penalties read the history (prompt, the first token from the prefill worker, the
    decode worker's outputs): disaggregated gives the colocated engine's tokens."""
    expected = Engine(tiny, ENGINE).generate([r for r, _ in penalized_workload])
    plain = Engine(tiny, ENGINE).generate([Request(r.request_id, r.prompt_token_ids, SamplingParams(
        max_tokens=10, temperature=r.sampling.temperature, seed=r.sampling.seed,
        top_p=r.sampling.top_p, top_k=r.sampling.top_k)) for r, _ in penalized_workload])
    # the extensions really took part (the tiny model's flat logits let one seeded draw
    # land where it would have anyway, so not necessarily in every request)
    assert sum(plain[rid] != tokens for rid, tokens in expected.items()) >= 4
    with Deployment(PlacementConfig(placement, "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", granularity=granularity,
                                   timeout_s=5.0), local=True) as deployment:
        records = deployment.run(penalized_workload)
        assert_clean(deployment)
    assert {r.request_id: r.output_token_ids for r in records} == expected
