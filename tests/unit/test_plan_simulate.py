"""The simulator on hand-built traces with constant step times: TTFT, TPOT and every stamp
equal the values computed by hand (planner.simulate)."""

from __future__ import annotations

import pytest

from engine import metrics as m
from engine.config import ConditionalConfig, EngineConfig
from engine.request import Request, SamplingParams
from experiments import analysis
from planner.latency import TransferModel
from planner.simulate import Simulator

ENGINE = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
ONE_S = lambda *features: 1.0  # noqa: E731  every step takes 1 s
HALF_S_TRANSFER = TransferModel(latency_s=0.5, bandwidth_bytes_s=float("inf"))  # put 0.25 + get 0.25


def _req(name: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(name, tuple(range(3, 3 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_colocated_trace_matches_hand_computed_times():
    # r0 (10 tokens, 3 out) at 0 s, r1 at 0.5 s. Steps of 1 s:
    #   0-1  r0 prefill            -> r0 token 1 at 1
    #   1-2  r0 decode + r1 prefill -> r0 token 2, r1 token 1 at 2
    #   2-3  r0, r1 decode          -> r0 token 3 (done), r1 token 2 at 3
    #   3-4  r1 decode              -> r1 token 3 at 4
    res = Simulator("colocated:1", ENGINE, ONE_S).run(
        [(_req("r0", 10, 3), 0.0), (_req("r1", 10, 3), 0.5)], collect_steps=True)
    r0, r1 = res.records
    assert r0.token_times_s == [1.0, 2.0, 3.0] and r1.token_times_s == [2.0, 3.0, 4.0]
    assert (m.ttft_s(r0), m.tpot_s(r0), m.e2e_s(r0)) == (1.0, 1.0, 3.0)
    assert (m.ttft_s(r1), m.tpot_s(r1), m.e2e_s(r1)) == (1.5, 1.0, 3.5)
    assert r1.timeline[m.PREFILL_STARTED] == 1.0 and m.prefill_queue_s(r1) == 0.5
    assert [(s["start_s"], s["num_prefill_tokens"], s["num_decode_tokens"]) for s in res.steps] == [
        (0.0, 10, 0), (1.0, 10, 1), (2.0, 0, 2), (3.0, 0, 1)]
    assert res.duration_s == 4.0 and r0.finish_reason == "length" and len(r0.output_token_ids) == 3


def test_disaggregated_trace_times_the_transfer_as_a_stage():
    # the first token leaves at the prefill's end; put 0.25 s then holds the prefill worker
    # and precedes the hand-over; get 0.25 s starts when the decode worker reserved the slot
    # (after the step that reserved it).
    #   prefill-0: 0-1 r0 (TTFT 1.0), put to 1.25; 1.25-2.25 r1 (TTFT 1.75), put to 2.5
    #   decode-0:  1.25 reserve r0, fetch to 1.5; 1.5-2.5 r0 -> token 2; 2.5-3.5 r0 (reserves
    #              r1 too) -> token 3; r1 fetch 3.5-3.75; 3.75-4.75, 4.75-5.75 r1 tokens 2, 3
    res = Simulator("disagg:1p1d", ENGINE, ONE_S, HALF_S_TRANSFER, kv_bytes_per_token=100).run(
        [(_req("r0", 10, 3), 0.0), (_req("r1", 10, 3), 0.5)], collect_steps=True)
    r0, r1 = res.records
    assert r0.token_times_s == r0.token_worker_times_s == [1.0, 2.5, 3.5]
    assert r1.token_times_s == r1.token_worker_times_s == [2.25, 4.75, 5.75]
    assert (m.ttft_s(r0), m.tpot_s(r0)) == (1.0, 1.25)
    assert (m.ttft_s(r1), m.tpot_s(r1)) == (1.75, 1.75)
    assert [r0.timeline[s] for s in (m.PREFILL_FINISHED, m.KV_PUT, m.KV_GOT)] == [1.0, 1.25, 1.5]
    assert (r0.kv_put_s, r0.kv_get_s, m.kv_transfer_s(r0), r0.kv_bytes) == (0.25, 0.25, 0.5, 1000)
    assert (r1.timeline[m.KV_PUT], r1.timeline[m.KV_GOT], r1.timeline[m.DECODE_ADMITTED]) == (2.5, 3.75, 3.75)
    assert (r0.prefill_worker, r0.decode_worker, r0.prefill_path) == ("prefill-0", "decode-0", "remote")
    assert [t["request_id"] for t in res.transfers] == ["r0", "r1"]


def test_router_policy_decides_the_worker():
    # loads at r2's arrival: colocated-0 holds r0 (20 + 3 tokens), colocated-1 r1 (10 + 3)
    work = [(_req("r0", 20, 3), 0.0), (_req("r1", 10, 3), 0.0), (_req("r2", 5, 3), 0.1)]
    least = Simulator("colocated:2", ENGINE, ONE_S).run(work).records
    robin = Simulator("colocated:2", ENGINE, ONE_S, policy="round_robin").run(work).records
    assert [r.prefill_worker for r in least] == ["colocated-0", "colocated-1", "colocated-1"]
    assert [r.prefill_worker for r in robin] == ["colocated-0", "colocated-1", "colocated-0"]


def test_conditional_prefills_short_prompts_on_the_decode_worker():
    sim = Simulator("conditional:1p1d", ENGINE, ONE_S, HALF_S_TRANSFER,
                    conditional=ConditionalConfig(max_local_prefill_length=15))
    short, long_ = sim.run([(_req("s", 10, 2), 0.0), (_req("l", 20, 2), 0.0)]).records
    assert (short.prefill_path, short.prefill_worker, short.kv_bytes) == ("local", "decode-0", 0)
    assert (long_.prefill_path, long_.prefill_worker) == ("remote", "prefill-0")
    assert m.ttft_s(short) == m.ttft_s(long_) == 1.0  # a remote first token leaves before the put


def test_kv_capacity_holds_requests_back_and_bad_requests_fail_alone():
    small = EngineConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64)
    res = Simulator("colocated:1", small, ONE_S).run(
        [(_req("a", 10, 2), 0.0), (_req("b", 10, 2), 0.0), (_req("big", 60, 10), 0.0)])
    a, b, big = res.records
    assert a.token_times_s == [1.0, 2.0] and b.token_times_s == [3.0, 4.0]  # one slot: b waits
    assert big.error is not None and "exceeds the context length 64" in big.error and m.failed(big)


def test_records_feed_the_analysis_unchanged():
    work = [(_req(f"r{i}", 10, 3), 0.5 * i) for i in range(4)]
    res = Simulator("colocated:1", ENGINE, ONE_S).run(work)
    slo = m.SLO(ttft_s=1.6, tpot_s=1.0)
    row = analysis.seed_table([analysis.Run("colocated:1", 2.0, res.records, 0, res.duration_s)],
                              slo).iloc[0]
    assert row["slo_attainment"] == pytest.approx(m.slo_attainment(res.records, slo))
    assert row["num_requests"] == 4 and row["num_failed"] == 0


def test_disaggregation_needs_a_transfer_model_and_ids_are_unique():
    with pytest.raises(ValueError, match="transfer model"):
        Simulator("disagg:1p1d", ENGINE, ONE_S)
    with pytest.raises(ValueError, match="policy"):
        Simulator("colocated:1", ENGINE, ONE_S, policy="random")
    with pytest.raises(ValueError, match="unique"):
        Simulator("colocated:1", ENGINE, ONE_S).run([(_req("x", 4, 2), 0.0), (_req("x", 4, 2), 1.0)])


def test_the_simulator_and_search_import_no_torch():
    """The hot loop stays torch-free (thousands of requests per second of wall time)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; import planner.search, planner.simulate; "
            "bad = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def _linear_step_s(n_pre: int, q_pre: int, num_decode: int, sum_ctx: int) -> float:
    """A step model shaped like the fitted one (intercept, per token, per context token),
    with slopes that make every step time distinct (so any reordering shows)."""
    if not n_pre and not num_decode:
        return 0.0
    return 0.013 + 0.0007 * n_pre + 3e-7 * q_pre + 0.0011 * num_decode + 2.3e-5 * sum_ctx


def _poisson_workload(n: int, rate: float, seed: int, stop_zero: int = -1):
    import random

    rng = random.Random(seed)
    t, work = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        stop = (0,) if i == stop_zero else ()  # 0 is the simulator's fake token: stops at once
        work.append((Request(f"w{i}", tuple(range(3, 3 + rng.randint(2, 40))),
                             SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True,
                                            stop_token_ids=stop)), t))
    return work


@pytest.mark.parametrize("placement,engine", [
    ("colocated:2", EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=24)),
    ("colocated-nochunk:1", EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64)),
    ("disagg:1p1d", EngineConfig(max_num_seqs=3, max_model_len=128, max_num_batched_tokens=32)),
    ("disagg:2p1d", EngineConfig(max_num_seqs=5, max_model_len=128, max_num_batched_tokens=32)),
    ("disagg:1p2d", EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=48)),
    ("conditional:1p1d", EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32)),
])
@pytest.mark.parametrize("rate", [0.5, 8.0, 60.0])
def test_fast_forward_gives_the_records_of_the_step_by_step_run(placement, engine, rate):
    """Same workload both ways: every record, step and transfer equal to the last bit; few
    slots (max_num_seqs 3-8) so requests wait for KV room while others decode, a stop token
    that ends a request on its first decode, and rates from sparse to saturating."""
    work = _poisson_workload(80, rate, seed=int(rate * 10), stop_zero=7)
    transfer = TransferModel(latency_s=0.004, bandwidth_bytes_s=2e6)
    cond = ConditionalConfig(max_local_prefill_length=20)
    results = [Simulator(placement, engine, _linear_step_s, transfer, 100, conditional=cond,
                         fast_forward=ff).run(work, collect_steps=True, collect_batches=True)
               for ff in (False, True)]
    plain, fast = results
    assert [r.to_dict() for r in fast.records] == [r.to_dict() for r in plain.records]
    assert fast.steps == plain.steps and fast.transfers == plain.transfers
    assert fast.duration_s == plain.duration_s
    for worker in {w for w, _ in plain.batches}:
        assert [b for w, b in fast.batches if w == worker] == [b for w, b in plain.batches if w == worker]
    assert plain.num_fast_forwarded_steps == 0 and fast.num_fast_forwarded_steps > 0
    assert fast.records[7].output_token_ids == [0] and fast.records[7].finish_reason == "length"


@pytest.mark.parametrize("placement", ["colocated:1", "disagg:1p1d"])
def test_fast_forward_equals_the_step_by_step_run_with_preemptions_and_prefix_hits(placement):
    """10 KV blocks of 16 for 80 requests of up to 70 tokens sharing their first tokens:
    blocks come on demand and run out, so running requests are preempted and recomputed,
    and prompts hit each other's cached blocks. The fast-forward stops before a step that
    would preempt and makes the blocks and cache entries its skipped steps would have:
    records, steps and batches equal the step-by-step run's."""
    engine = EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32,
                          kv_capacity_tokens=160)
    work = _poisson_workload(80, 30.0, seed=5)
    transfer = TransferModel(latency_s=0.004, bandwidth_bytes_s=2e6)
    plain, fast = [Simulator(placement, engine, _linear_step_s, transfer, 100,
                             fast_forward=ff).run(work, collect_steps=True, collect_batches=True)
                   for ff in (False, True)]
    assert [r.to_dict() for r in fast.records] == [r.to_dict() for r in plain.records]
    assert fast.steps == plain.steps and fast.batches == plain.batches
    assert fast.num_fast_forwarded_steps > 0
    assert sum(r.num_preemptions for r in plain.records) > 0
    assert sum(r.num_cached_prompt_tokens for r in plain.records) > 0
    wanted = {req.request_id: req.sampling.max_tokens for req, _ in work}
    assert all(len(r.output_token_ids) == wanted[r.request_id] and r.error is None
               for r in plain.records)


def test_fast_forward_stops_before_a_finish_and_at_the_next_arrival():
    # r0: 10-token prompt, 6 tokens; 1 s steps. Prefill 0-1 (token 1); decodes end at 2..6.
    # Alone, steps 1-2 .. 4-5 are completed ahead (tokens 2-5), 5-6 (its last) runs as usual.
    # r1 arriving at 3.5 bounds the skip: only the decode steps ending before 3.5 are skipped.
    alone = Simulator("colocated:1", ENGINE, ONE_S).run([(_req("r0", 10, 6), 0.0)])
    assert alone.records[0].token_times_s == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert alone.num_fast_forwarded_steps == 4  # the steps ending at 2, 3, 4 and 5
    two = Simulator("colocated:1", ENGINE, ONE_S).run(
        [(_req("r0", 10, 6), 0.0), (_req("r1", 10, 2), 3.5)], collect_steps=True)
    assert two.records[0].token_times_s == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert two.records[1].token_times_s == [5.0, 6.0]  # prefilled in the step 4-5
    assert [s["num_prefill_tokens"] for s in two.steps] == [10, 0, 0, 0, 10, 0]
    assert two.num_fast_forwarded_steps == 2  # steps ending at 2 and 3 (< 3.5)


# ---- speed trace (the drift replay's hook) -------------------------------------------------
def test_a_constant_speed_factor_scales_every_time_exactly():
    # the colocated trace above with every step 1.5x as long and the arrival 1.5x later: every
    # stamp is 1.5x the hand-computed one (1.5 and its multiples are exact floats)
    k = 1.5
    res = Simulator("colocated:1", ENGINE, ONE_S, speed_trace=lambda worker, t: k).run(
        [(_req("r0", 10, 3), 0.0), (_req("r1", 10, 3), 0.5 * k)], collect_steps=True)
    r0, r1 = res.records
    assert r0.token_times_s == [1.5, 3.0, 4.5] and r1.token_times_s == [3.0, 4.5, 6.0]
    assert (m.ttft_s(r0), m.tpot_s(r0)) == (1.0 * k, 1.0 * k)
    assert (m.ttft_s(r1), m.tpot_s(r1), m.e2e_s(r1)) == (1.5 * k, 1.0 * k, 3.5 * k)
    assert [s["duration_s"] for s in res.steps] == [k] * 4 and res.duration_s == 4.0 * k


@pytest.mark.parametrize("fast_forward", [False, True])
def test_the_factor_is_the_one_at_each_step_start(fast_forward):
    # factor 1 before 2 s, 3 from then on: steps 0-1 (prefill), 1-2, then 2-5 and 5-8
    trace = lambda worker, t: 1.0 if t < 2.0 else 3.0  # noqa: E731
    res = Simulator("colocated:1", ENGINE, ONE_S, speed_trace=trace,
                    fast_forward=fast_forward).run([(_req("r0", 10, 4), 0.0)])
    assert res.records[0].token_times_s == [1.0, 2.0, 5.0, 8.0]
    assert res.num_fast_forwarded_steps == (2 if fast_forward else 0)


def test_the_trace_is_read_per_worker():
    # prefill-0 twice as slow as its model, decode-0 as modelled
    trace = lambda worker, t: 2.0 if worker == "prefill-0" else 1.0  # noqa: E731
    res = Simulator("disagg:1p1d", ENGINE, ONE_S, HALF_S_TRANSFER, kv_bytes_per_token=100,
                    speed_trace=trace).run([(_req("r0", 10, 3), 0.0), (_req("r1", 10, 3), 0.5)],
                                           collect_steps=True)
    durations = {(s["worker"], s["duration_s"]) for s in res.steps}
    assert durations == {("prefill-0", 2.0), ("decode-0", 1.0)}
    assert m.ttft_s(res.records[0]) == 2.0  # the 2 s prefill; the 0.25 s put follows it


@pytest.mark.parametrize("placement,engine", [
    ("colocated:2", EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=24)),
    ("disagg:1p2d", EngineConfig(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=48)),
    ("conditional:1p1d", EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32)),
])
def test_fast_forward_gives_the_records_of_the_step_by_step_run_with_a_trace(placement, engine):
    """A trace whose 0.7 s windows change the speed many times within fast-forwarded runs
    (and differ per worker): both ways give the same records to the last bit."""
    from planner.drift import SpeedTrace

    work = _poisson_workload(80, 8.0, seed=3, stop_zero=7)
    transfer = TransferModel(latency_s=0.004, bandwidth_bytes_s=2e6)
    factors = tuple(0.8 + 0.05 * ((7 * i) % 11) for i in range(40))
    trace = SpeedTrace(0.7, {name: factors[j:] for j, name in enumerate(
        ["colocated-0", "colocated-1", "prefill-0", "decode-0", "decode-1"])})
    cond = ConditionalConfig(max_local_prefill_length=20)
    plain, fast = [Simulator(placement, engine, _linear_step_s, transfer, 100, conditional=cond,
                             fast_forward=ff, speed_trace=trace).run(work, collect_steps=True)
                   for ff in (False, True)]
    assert [r.to_dict() for r in fast.records] == [r.to_dict() for r in plain.records]
    assert fast.steps == plain.steps and fast.duration_s == plain.duration_s
    assert fast.num_fast_forwarded_steps > 0
    untraced = Simulator(placement, engine, _linear_step_s, transfer, 100, conditional=cond).run(work)
    assert [r.token_times_s for r in untraced.records] != [r.token_times_s for r in fast.records]
