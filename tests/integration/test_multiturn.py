"""Multi-turn conversations replayed closed-loop, tiny model: each turn is sent
a think time after the previous answer ended, its prompt the history plus its new tokens;
greedy output equals generate() on that prompt through ``colocated:2 --policy cache_aware``
and ``disagg:1p1d``; the prefix hits are the hand-computed ones; a reset between runs
leaves no hit behind; the planner's simulator chains the same turns, sees the same hits and
takes ``conditional``'s local/remote decision on the prompt minus its prefix hit."""

from __future__ import annotations

import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import assert_clean

from engine.config import ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import ARRIVED, FINISHED
from experiments import workloads as w
from deployment.placement import Deployment
from experiments.workload_spec import ClosedLoop
from planner.latency import TransferModel
from planner.simulate import Simulator

TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=64)
THINK_S = 0.05
OUT = 6
# 3 conversations x 3 turns: 40 tokens, then 10 new tokens per turn, 6 answered each turn.
# A turn's prompt: turn 0: 40; turn 1: 40 + 6 + 10 = 56; turn 2: 56 + 6 + 10 = 72 tokens.
# Hits (16-token blocks) colocated: the KV computed so far is the last prompt + its
# answer but the last token: 45 -> 2 blocks = 32 tokens; 61 -> 3 blocks = 48 tokens.
# Disaggregated prefill worker (prompts only): 40 -> 32; 56 -> 48. The same numbers.
HITS = [0, 32, 48]


def conversations(seed: int = 0) -> list[w.Conversation]:
    news = random_prompts([40, 10, 10] * 3, seed=seed)
    convs = [w.Conversation(f"c{c}", tuple(
        w.Turn(tuple(news[3 * c + k]), OUT, THINK_S if k else 0.0) for k in range(3)), "test")
        for c in range(3)]
    return w.with_conversation_arrivals(convs, rate=20.0, seed=seed)


def check_chained(tiny, records, convs) -> None:
    """Turn k's prompt is turn k-1's prompt + its answer + turn k's new tokens, its output
    equals generate() on it, and it arrived a think time after turn k-1 ended."""
    by_id = {r.request_id: r for r in records}
    assert len(records) == 9
    for c, conv in enumerate(convs):
        prompt: list[int] = []
        for k, turn in enumerate(conv.turns):
            record = by_id[f"t-c{c}-t{k}"]
            assert record.error is None, record.error
            prompt = prompt + list(turn.new_token_ids)
            assert record.num_prompt_tokens == len(prompt)
            assert record.output_token_ids == reference_generate(tiny.model, prompt, OUT)
            if k:
                before = by_id[f"t-c{c}-t{k - 1}"]
                assert record.timeline[ARRIVED] >= before.timeline[FINISHED] + THINK_S - 1e-6
            prompt = prompt + record.output_token_ids


def hits(records) -> list[list[int]]:
    by_id = {r.request_id: r for r in records}
    return [[by_id[f"t-c{c}-t{k}"].num_cached_prompt_tokens for k in range(3)] for c in range(3)]


def test_cache_aware_colocated_chains_turns_hits_their_prefix_and_resets(tiny):
    convs = conversations()
    with Deployment(PlacementConfig("colocated:2", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), policy="cache_aware",
                    local=True) as d:
        first = d.run(ClosedLoop(convs, "t"))
        assert_clean(d)
        d.reset_prefix_cache()
        again = d.run(ClosedLoop(convs, "t"))
        inherited = d.run(ClosedLoop(convs, "t"))  # no reset: turn 0 finds its prompt
        assert_clean(d)
    check_chained(tiny, first, convs)
    assert hits(first) == [HITS] * 3
    for records in (first, again):  # every turn of a conversation on its first turn's worker
        by_id = {r.request_id: r for r in records}
        for c in range(3):
            assert len({by_id[f"t-c{c}-t{k}"].prefill_worker for k in range(3)}) == 1
    assert hits(again) == [HITS] * 3  # the reset left nothing to hit
    assert [h[0] for h in hits(inherited)] == [32] * 3  # 40 tokens cached: 2 blocks


def test_disagg_chains_turns_and_hits_on_the_prefill_worker(tiny):
    convs = conversations(seed=1)
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as d:
        records = d.run(ClosedLoop(convs, "t"))
        assert_clean(d)
    check_chained(tiny, records, convs)
    assert hits(records) == [HITS] * 3


def simulate(placement: str, policy: str, conditional: ConditionalConfig | None = None):
    sim = Simulator(placement, ENGINE, lambda *features: 0.01, TransferModel(0.0, 1e9),
                    kv_bytes_per_token=64, policy=policy, conditional=conditional)
    return sim.run(ClosedLoop(conversations(), "t")).records


def test_simulator_chains_the_same_turns_and_sees_the_hits():
    records = simulate("colocated:2", "cache_aware")
    by_id = {r.request_id: r for r in records}
    assert len(records) == 9 and all(r.error is None for r in records)
    for c in range(3):
        for k in (1, 2):
            turn, before = by_id[f"t-c{c}-t{k}"], by_id[f"t-c{c}-t{k - 1}"]
            assert turn.timeline[ARRIVED] == pytest.approx(before.timeline[FINISHED] + THINK_S)
            assert turn.prefill_worker == before.prefill_worker
    assert [r.num_prompt_tokens for r in records if r.request_id.endswith("t2")] == [72] * 3
    assert hits(records) == [HITS] * 3


def test_conditional_prefills_later_turns_locally_once_their_prefix_is_cached():
    # 40 > 30: turn 0 remote; turn 1: 56 - 32 credited to decode-0 = 24 <= 30: local;
    # turn 2: 72 - 48 = 24: local
    records = simulate("conditional:1p1d", "least_loaded",
                       ConditionalConfig(max_local_prefill_length=30, max_prefill_queue_size=4))
    by_id = {r.request_id: r for r in records}
    assert [[by_id[f"t-c{c}-t{k}"].prefill_path for k in range(3)] for c in range(3)] == \
        [["remote", "local", "local"]] * 3
