"""Prefix caching and on-demand KV blocks with preemption, tiny model: greedy
output equals generate() on shared-prefix and multi-turn prompts, colocated and through
``disagg:1p1d`` over in-process and shm transports, whole and layer-wise; the records carry
the prefix hits (hand-computed) and the preemptions; a decode worker that caches a prefix
receives only the rest of the KV; a failed step leaves no stale block cached; at the end
every block is free or cached with no reference and the transports hold nothing."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from conftest import random_prompts, reference_generate
from placement_helpers import assert_clean, assert_outputs, collect_events

from decode_worker import DecodeWorker
from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.engine import Engine
from engine.events import KV_GOT, PREFILLED, TOKEN
from engine.request import Request, SamplingParams
from deployment.placement import Deployment
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.shm import SharedMemoryTransport
from prefill_worker import PrefillWorker
from router.calls import LocalCalls
from router.router import Router, WorkerRef

TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=24)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # 2 * layers * kv_heads * head_dim * fp32 itemsize
B = 16  # block size
MAX_TOKENS = 6


@dataclasses.dataclass
class Case:
    """Two rounds of requests (the second after the first finished) and, per request, its
    generate() output and the prompt tokens its prefill worker finds cached."""

    rounds: list[list[tuple[Request, float]]]
    expected: dict[str, list[int]]
    hits_prefill: dict[str, int]  # disaggregated: the prefill worker computed prompts only
    hits_colocated: dict[str, int]  # colocated: prompts and outputs (but the last) computed
    hits_decode: dict[str, int]  # second turns: what their decode worker already holds


@pytest.fixture(scope="module")
def case(tiny) -> Case:
    """Round 1: 2 system prompts of 40 tokens x 3 questions (vLLM's prefix_repetition shape)
    and the first turns of 2 conversations; round 2: their second turns, each the first
    turn's prompt + its answer + a new user message."""
    systems = random_prompts([40, 40], seed=41)
    questions = random_prompts([5, 9, 13, 7, 3, 11], seed=42)
    first_turns = random_prompts([28, 45], seed=43)  # answers cross a block end
    follow_ups = random_prompts([6, 19], seed=44)
    expected, hits_p, hits_c, hits_d, round1, round2 = {}, {}, {}, {}, [], []
    for i, system in enumerate(systems):
        for j in range(3):
            rid, prompt = f"s{i}q{j}", system + questions[3 * i + j]
            round1.append((Request(rid, tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS)),
                           0.005 * len(round1)))
            expected[rid] = reference_generate(tiny.model, prompt, MAX_TOKENS)
            # the first question of a system prompt misses; the others share its 2 full blocks
            hits_p[rid] = hits_c[rid] = 0 if j == 0 else 32
    for k, (first, follow) in enumerate(zip(first_turns, follow_ups)):
        rid1, rid2 = f"c{k}t0", f"c{k}t1"
        answer = reference_generate(tiny.model, first, MAX_TOKENS)
        second = first + answer + follow
        expected[rid1], expected[rid2] = answer, reference_generate(tiny.model, second, MAX_TOKENS)
        round1.append((Request(rid1, tuple(first), SamplingParams(max_tokens=MAX_TOKENS)),
                       0.005 * len(round1)))
        round2.append((Request(rid2, tuple(second), SamplingParams(max_tokens=MAX_TOKENS)),
                       0.005 * len(round2)))
        hits_p[rid1] = hits_c[rid1] = 0
        cap = (len(second) - 1) // B * B  # the last prompt token is always computed
        hits_p[rid2] = min(len(first) // B * B, cap)  # KV of the first prompt only
        computed = len(first) + len(answer) - 1  # KV of the first turn (its last token: none)
        hits_c[rid2] = min(computed // B * B, cap)  # and of its answer
        hits_d[rid2] = min(computed // B, len(second) // B) * B  # no token left to compute
    return Case([round1, round2], expected, hits_p, hits_c, hits_d)


def run_rounds(runner, case: Case) -> list:
    records = []
    for workload in case.rounds:
        records += runner(workload)
    return records


def test_case_exercises_what_it_claims(case):
    """The hand-computed hits differ between the placements (the answer blocks), so the
    records below tell them apart."""
    assert all(case.hits_colocated[r] > case.hits_prefill[r] > 0 for r in ("c0t1", "c1t1"))
    assert sum(case.hits_prefill.values()) == 4 * 32 + case.hits_prefill["c0t1"] + 32


def test_colocated_engine_with_caching_equals_generate(tiny, case):
    engine = Engine(tiny, ENGINE, quiet=True)
    outputs, hits = {}, {}
    for workload in case.rounds:
        for request, _ in workload:
            engine.add_request(request)
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out.token_id)
                if out.index == 0:
                    hits[out.request_id] = out.num_cached_tokens
    assert outputs == case.expected and hits == case.hits_colocated
    stats = engine.scheduler.prefix_cache_stats
    assert stats.hits == sum(case.hits_colocated.values())
    assert stats.queries == sum(r.num_prompt_tokens for w in case.rounds for r, _ in w)
    blocks = engine.scheduler.capacity
    assert engine.is_empty() and blocks.num_cached_blocks > 0 and not any(blocks.ref_cnt)
    # the prefill it skipped, in the step records: every prompt token minus the hits
    assert sum(r.num_prefill_tokens for r in engine.step_records) == stats.queries - stats.hits


def test_colocated_placement_records_the_hits(tiny, case):
    with Deployment(PlacementConfig("colocated:1", "cpu:0"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as d:
        records = run_rounds(d.run, case)
        assert_clean(d)
    assert_outputs(records, case.expected)
    assert {r.request_id: r.num_cached_prompt_tokens for r in records} == case.hits_colocated
    assert all(r.num_preemptions == 0 and r.kv_bytes_saved == 0 for r in records)


@contextlib.contextmanager
def disagg(transport: str, granularity: str, engine: EngineConfig = ENGINE,
           policy: str = "least_loaded"):
    """A prefill and a decode worker as plain objects over ``transport`` and a router."""
    transfer = TransferConfig(transport=transport, granularity=granularity, layers_per_chunk=1,
                              timeout_s=5.0)
    shared = InProcessTransport()
    workers = []
    try:
        for role in ("prefill", "decode"):
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            own = shared if transport == "inprocess" else SharedMemoryTransport(num_slots=16)
            workers.append(cls(f"{role}-0", TINY, engine, transfer, transport=own, bind=False))
        calls = LocalCalls()
        router = Router([WorkerRef(w.name, w.role, w, rank) for rank, w in enumerate(workers)],
                        calls, "disagg:1p1d", policy, deadline_s=30.0)
        yield router, workers
    finally:
        for worker in workers:
            worker.shutdown()


def assert_all_freed(router, workers) -> None:
    for worker in workers:
        status = worker.status()
        assert status["engine_empty"] and status["transport_held"] == 0, status
    assert set(router.loads.values()) == {0}


@pytest.mark.parametrize("transport,granularity", [
    ("inprocess", "request"), ("inprocess", "layer"), ("shm", "request"), ("shm", "layer")])
def test_disagg_with_caching_equals_generate(tiny, case, transport, granularity):
    with disagg(transport, granularity) as (router, workers):
        records = router.run(case.rounds[0])
        before = workers[1].kv_cache_stats()
        records += router.run(case.rounds[1])
        after = workers[1].kv_cache_stats()
        assert_all_freed(router, workers)
    assert_outputs(records, case.expected)
    assert {r.request_id: r.num_cached_prompt_tokens for r in records} == case.hits_prefill
    for r in records:  # the whole prompt's KV still travels (its router sent no start)
        assert r.kv_bytes == KV_BYTES_PER_TOKEN * r.num_prompt_tokens and r.kv_bytes_saved == 0
    # the decode worker computed the first turns' answers: it shares those blocks (and the
    # first prompts') with the second turns instead of storing their KV again
    hits = sum(case.hits_decode.values())
    assert after["transfer_hits"] - before["transfer_hits"] == hits > 0
    assert after["transfer_queries"] - before["transfer_queries"] == sum(
        r.num_prompt_tokens for r, _ in case.rounds[1])


@pytest.mark.parametrize("transport,granularity", [("inprocess", "layer"), ("shm", "request")])
def test_cache_aware_router_sends_only_the_blocks_decode_lacks(tiny, case, transport,
                                                                granularity):
    """Under ``cache_aware`` a second turn's decode worker already holds its first prompt's
    KV (it landed there in round 1): only the rest of the prompt travels, the record says
    how many bytes that saved, and the outputs still equal generate()."""
    with disagg(transport, granularity, policy="cache_aware") as (router, workers):
        records = router.run(case.rounds[0])
        records += router.run(case.rounds[1])
        assert_all_freed(router, workers)
    assert_outputs(records, case.expected)
    by_id = {r.request_id: r for r in records}
    for rid in ("c0t1", "c1t1"):  # the first turn's full prompt blocks stayed on decode-0
        r = by_id[rid]
        assert r.kv_bytes_saved == KV_BYTES_PER_TOKEN * case.hits_prefill[rid] > 0
        assert r.kv_bytes == KV_BYTES_PER_TOKEN * (r.num_prompt_tokens - case.hits_prefill[rid])
    for r in case.rounds[0]:  # a shared system prompt: skipped only once its KV had landed
        saved = by_id[r[0].request_id].kv_bytes_saved
        assert saved in (0, 32 * KV_BYTES_PER_TOKEN), (r[0].request_id, saved)


# ---- preemption: recompute equals generate() ------------------------------------------------

TIGHT = dataclasses.replace(ENGINE, kv_capacity_tokens=96)  # 6 blocks of 16


@pytest.fixture(scope="module")
def crowded(tiny):
    """8 requests of 20-47 prompt tokens + 12 output tokens (each fits the 96-token cache
    alone, a few at once do not), 4 of them sharing a 32-token prefix."""
    shared = random_prompts([32], seed=51)[0]
    tails = random_prompts([3, 9, 15, 5], seed=52)
    prompts = [shared + t for t in tails] + random_prompts([20, 31, 26, 40], seed=53)
    requests = [Request(f"p{i}", tuple(p), SamplingParams(max_tokens=12))
                for i, p in enumerate(prompts)]
    return requests, {r.request_id: reference_generate(tiny.model, list(r.prompt_token_ids), 12)
                      for r in requests}


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_recompute_exactly_and_free_everything(tiny, crowded, caching):
    requests, expected = crowded
    engine = Engine(tiny, dataclasses.replace(TIGHT, enable_prefix_caching=caching), quiet=True)
    for request in requests:
        engine.add_request(request)
    outputs, preemptions = {r.request_id: [] for r in requests}, {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
            if out.finished:
                preemptions[out.request_id] = out.num_preemptions
    assert outputs == expected
    assert sum(preemptions.values()) == engine.scheduler.num_preemptions > 0
    assert engine.is_empty() and not any(engine.scheduler.capacity.ref_cnt)


def test_disagg_preemption_recomputes_on_its_decode_worker(tiny, crowded):
    """Tight KV on both workers: the decode worker preempts requests whose KV it received
    and recomputes their prompt + outputs itself (no second transfer: one put and one get
    per request)."""
    requests, expected = crowded
    workload = [(r, 0.0) for r in requests]  # all at once: the decode worker fills up
    with disagg("inprocess", "request", TIGHT) as (router, workers):
        records = router.run(workload)
        assert_all_freed(router, workers)
        decode_stats = workers[1].kv_cache_stats()
        transfers = workers[1].transfer_records()
    assert_outputs(records, expected)
    assert decode_stats["num_preemptions"] > 0
    assert sum(r.num_preemptions for r in records) >= decode_stats["num_preemptions"]
    assert sorted(t["request_id"] for t in transfers) == sorted(expected)  # once each


# ---- a failed step leaves no stale block in the cache ---------------------------------------

def test_blocks_of_a_failed_step_leave_the_cache(tiny, monkeypatch):
    engine = Engine(tiny, ENGINE, quiet=True)
    prompt = random_prompts([40], seed=61)[0]
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("device lost")))
    engine.add_request(Request("doomed", tuple(prompt), SamplingParams(max_tokens=4)))
    step = engine.step()
    assert list(step) == [] and step.failed[0].request_id == "doomed"
    assert engine.scheduler.capacity.num_cached_blocks == 0 and engine.is_empty()
    monkeypatch.setattr(engine.runner, "execute", real)
    out = engine.generate([Request("after", tuple(prompt), SamplingParams(max_tokens=4))])
    assert out["after"] == reference_generate(tiny.model, prompt, 4)
    assert engine.scheduler.prefix_cache_stats.hits == 0  # it recomputed; nothing stale hit


# ---- a decode worker that caches the prefix is sent only the missing blocks ----------------

def test_only_the_blocks_past_the_decode_workers_cached_prefix_travel(tiny):
    """r1 (40-token prompt) goes through whole: the decode worker then caches its first 2
    blocks. r2 shares those 32 tokens: its prefill worker puts only tokens [32, 45)
    (``kv_token_start``, what a cache-aware router would pass) and the decode worker writes
    them past its own cached blocks. r3 claims a cached prefix the decode worker does not
    hold: it recomputes there, its handles freed unfetched. All equal generate()."""
    transfer = TransferConfig(transport="inprocess", timeout_s=5.0)
    shared = InProcessTransport()
    prefill = PrefillWorker("prefill-0", TINY, ENGINE, transfer, transport=shared, bind=False)
    decode = DecodeWorker("decode-0", TINY, ENGINE, transfer, transport=shared, bind=False)
    base, tail, other = random_prompts([40, 13, 40], seed=71)
    try:
        def serve(rid, prompt, start):
            request = Request(rid, tuple(prompt), SamplingParams(max_tokens=5))
            prefill.submit(request, None, start)
            first = collect_events(prefill, lambda es: any(e.kind == PREFILLED for e in es))[-1]
            decode.admit(request, first.token_id, first.kv_handles, start)
            events = collect_events(decode, lambda es: any(e.finish_reason for e in es))
            got = next(e for e in events if e.kind == KV_GOT)
            tokens = [first.token_id] + [e.token_id for e in events if e.kind == TOKEN]
            assert tokens == reference_generate(tiny.model, prompt, 5), rid
            return first, got

        first, got = serve("r1", base, 0)
        assert first.kv_bytes == got.kv_bytes == 40 * KV_BYTES_PER_TOKEN
        assert first.kv_bytes_saved == 0
        first, got = serve("r2", base[:32] + tail, 32)
        assert first.kv_bytes == got.kv_bytes == 13 * KV_BYTES_PER_TOKEN  # tokens [32, 45)
        assert first.kv_bytes_saved == 32 * KV_BYTES_PER_TOKEN
        assert first.num_cached_prompt_tokens == 32  # the prefill worker's own cache, too
        first, got = serve("r3", other, 16)  # decode-0 holds no block of it
        assert got.kv_bytes == 0 and decode.kv_cache_stats()["transfer_hits"] == 32
        assert [t.num_bytes for t in shared.records] == [40 * KV_BYTES_PER_TOKEN,
                                                         13 * KV_BYTES_PER_TOKEN]  # r3: never got
        for worker in (prefill, decode):
            assert worker.status()["engine_empty"]
        assert shared.num_held() == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_bad_kv_token_start_is_refused_in_one_line(tiny):
    engine = Engine(tiny, ENGINE, quiet=True)
    request = Request("x", tuple(range(3, 43)), SamplingParams(max_tokens=3))
    for start in (8, 48, -16):
        with pytest.raises(ValueError, match=r"kv_token_start must be a multiple of 16 in "
                                             r"\[0, 40\), got"):
            engine.add_remote(request, 5, start)
    assert engine.is_empty()
    kv = torch.zeros(tiny.kv_spec.kv_shape(24))
    engine.add_remote(request, 5, 16)
    step = engine.step()
    assert step.kv_reserved == () and step.kv_dropped == ("x",)  # nothing cached: recompute
    with pytest.raises(KeyError):
        engine.finish_remote("x", kv)
    engine.abort("x")
    assert engine.is_empty()
