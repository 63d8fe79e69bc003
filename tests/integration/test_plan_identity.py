"""The simulator schedules with the engine's own Scheduler: on the same burst of requests,
its per-step batches equal the batches a real Engine (tiny model) schedules, step by step,
for a colocated engine and for a prefill worker's engine. If the simulator ever used another
scheduler (or the Engine did), these sequences would diverge."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from planner.latency import TransferModel
from planner.simulate import Simulator

# a small slot count and token budget, so admission waits and prompts are chunked
ENGINE = EngineConfig(max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16)
LENGTHS = [(20, 4), (5, 6), (30, 3), (8, 5), (12, 2), (3, 1)]  # (prompt, max_tokens)


def _requests(shared: bool = False) -> list[Request]:
    """The burst; ``shared``: every prompt starts with the same tokens (prefix cache hits),
    else each starts with its own token (no block is shared)."""
    return [Request(f"q{i}", (3 if shared else 3 + i,) + tuple(range(10, 9 + p)),
                    SamplingParams(max_tokens=g, ignore_eos=True))
            for i, (p, g) in enumerate(LENGTHS)]


def _engine_batches(engine: Engine, prefill_only: bool,
                    shared: bool = False) -> list[list[tuple[str, int]]]:
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        if not batch.is_empty:
            seen.append([(s.request_id, n) for s, n in zip(batch.requests, batch.num_new_tokens)])
        return batch

    engine.scheduler.schedule = spy
    for request in _requests(shared):
        engine.add_request(request, prefill_only=prefill_only)
    while engine.has_unfinished():
        for out in engine.step():
            if prefill_only and out.finish_reason is None:  # as the prefill worker exports it
                engine.finish_prefilled(out.request_id)
    assert engine.is_empty()
    return seen


@pytest.mark.parametrize("fast_forward", [False, True])
@pytest.mark.parametrize("placement,worker,prefill_only", [
    ("colocated:1", "colocated-0", False), ("disagg:1p1d", "prefill-0", True)])
def test_simulated_batches_equal_the_engines(tiny, placement, worker, prefill_only, fast_forward):
    """With fast-forward on too: the decode-only steps it completes without the Scheduler
    are recorded as batches, and they still equal the Engine's (on colocated:1 it skips
    the tail, where the burst's last requests decode alone)."""
    engine = Engine(tiny, ENGINE)
    sim = Simulator(placement, ENGINE, lambda *f: 0.01, TransferModel(0.001, 1e9), 64,
                    fast_forward=fast_forward)
    result = sim.run([(r, 0.0) for r in _requests()], collect_batches=True)
    if fast_forward and placement == "colocated:1":
        assert result.num_fast_forwarded_steps > 0
    assert type(engine.scheduler) is type(sim._instances[worker].scheduler)
    simulated = [batch for name, batch in result.batches if name == worker]
    real = _engine_batches(engine, prefill_only)
    assert len(real) >= 5 and any(len(b) > 1 for b in real)  # chunked, batched, queued
    assert simulated == real


@pytest.mark.parametrize("placement,worker,prefill_only", [
    ("colocated:1", "colocated-0", False), ("disagg:1p1d", "prefill-0", True)])
def test_simulated_prefix_cache_hits_equal_the_engines(tiny, placement, worker, prefill_only):
    """Prompts sharing their first blocks: the simulator's Scheduler skips the same cached
    prefixes as the Engine's (prefix caching is modelled by the same code)."""
    engine = Engine(tiny, ENGINE)
    sim = Simulator(placement, ENGINE, lambda *f: 0.01, TransferModel(0.001, 1e9), 64)
    result = sim.run([(r, 0.0) for r in _requests(shared=True)], collect_batches=True)
    simulated = [batch for name, batch in result.batches if name == worker]
    real = _engine_batches(engine, prefill_only, shared=True)
    assert engine.scheduler.prefix_cache_stats.hits > 0
    assert simulated == real


def test_simulated_kv_blocks_equal_the_engines(tiny):
    from engine import kv_cache
    from planner import simulate

    assert simulate.DEFAULT_CPU_KV_CACHE_GB == kv_cache.DEFAULT_CPU_KV_CACHE_GB
    for config in (ENGINE, EngineConfig(max_num_seqs=256, max_model_len=2048, kv_cache_memory_gb=0.001)):
        assert simulate.num_kv_blocks(config, tiny.kv_spec.bytes_per_token) == \
            kv_cache.kv_cache_num_blocks(config, tiny.kv_spec)
