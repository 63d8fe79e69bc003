"""``conditional:xPyD`` (NVIDIA Dynamo's conditional disaggregation) in one process: a prompt
longer than ``max_local_prefill_length`` prefills on a prefill worker while the prefill
queue is shorter than ``max_prefill_queue_size``, every other prefills on its decode worker;
outputs equal generate() either way, and nothing leaks."""

from __future__ import annotations

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import ENGINE, assert_clean, assert_outputs, mixed_workload

import pandas as pd

from engine.config import ConditionalConfig, ModelConfig, PlacementConfig, TransferConfig, \
    parse_placement
from engine.request import Request, SamplingParams
from engine.metrics import SLO
from experiments.replay import RunResult
from experiments.results import _write_hindsight
from deployment.placement import Deployment

TINY = ModelConfig("tiny-random-llama")


def deploy(conditional: ConditionalConfig) -> Deployment:
    return Deployment(PlacementConfig("conditional:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                      TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                      conditional=conditional)


def test_placement_parses_like_disagg():
    assert parse_placement("Conditional:2P1D") == ("conditional", 2, 1)
    with pytest.raises(ValueError, match="conditional:xPyD needs x, y >= 1"):
        parse_placement("conditional:0p1d")


@pytest.mark.parametrize("length,queued,remote", [
    (16, 0, False),  # not longer than the threshold: local
    (17, 0, True),
    (17, 2, True),
    (17, 3, False),  # the prefill queue is full: local
])
def test_rule(length, queued, remote):
    rule = ConditionalConfig(max_local_prefill_length=16, max_prefill_queue_size=3)
    assert rule.remote(length, queued) is remote


def test_prompts_route_by_length_and_match_generate(tiny, tmp_path):
    workload, expected = mixed_workload(tiny)  # prompt lengths 1..40, spaced 10 ms apart
    with deploy(ConditionalConfig(max_local_prefill_length=16, max_prefill_queue_size=100)) as dep:
        records = dep.run(workload)
        assert_outputs(records, expected)
        assert_clean(dep)
        steps = dep.step_records()
    # compare writes the hindsight table of every conditional run
    run = RunResult("conditional:1p1d", 1.0, records, steps, [], 1.0)
    text = _write_hindsight(tmp_path, [run], SLO(ttft_s=10.0, tpot_s=10.0))
    table = pd.read_csv(tmp_path / "hindsight.csv")
    assert sorted(table["request_id"]) == sorted(r.request_id for r in records)
    assert table["met_slo"].all() and not table["regret"].any()
    assert "conditional:1p1d @ 1 req/s hindsight:" in text
    paths = {r.num_prompt_tokens: r.prefill_path for r in records}
    assert {n for n, p in paths.items() if p == "remote"} == {n for n in paths if n > 16}
    assert {n for n, p in paths.items() if p == "local"} == {n for n in paths if n <= 16}
    for r in records:
        assert r.placement == "conditional:1p1d" and r.decode_worker == "decode-0"
        assert r.prefill_worker == ("prefill-0" if r.prefill_path == "remote" else "decode-0")
        assert (r.kv_bytes > 0) == (r.prefill_path == "remote")


def test_full_prefill_queue_keeps_long_prompts_local(tiny):
    """Three long prompts arriving at once with a queue limit of 1: the first goes remote,
    the two others find one request in the prefill queue and prefill locally."""
    prompts = random_prompts([30, 31, 32], seed=5)
    workload = [(Request(f"q{i}", tuple(p), SamplingParams(max_tokens=6)), 0.0)
                for i, p in enumerate(prompts)]
    expected = {f"q{i}": reference_generate(tiny.model, p, 6) for i, p in enumerate(prompts)}
    with deploy(ConditionalConfig(max_local_prefill_length=16, max_prefill_queue_size=1)) as dep:
        records = dep.run(workload)
        assert_outputs(records, expected)
        assert_clean(dep)
    assert [r.prefill_path for r in records] == ["remote", "local", "local"]
