"""Scheduler policy, pure Python: decode-first, token budget, chunked prefill, admission by KV
blocks, FCFS, block reuse, stop conditions. No torch, no model: tokens are "sampled" by hand."""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.request import Request, RequestState, RequestStatus, SamplingParams
import pytest

from engine.scheduler import BlockAllocator, ScheduledBatch, Scheduler

EOS = 2
TOKEN = 9  # a token that is neither EOS nor a stop token


def state(rid: str, num_prompt: int, max_tokens: int = 4, prefill_only: bool = False,
          **params) -> RequestState:
    request = Request(rid, tuple(range(10, 10 + num_prompt)),
                      SamplingParams(max_tokens=max_tokens, **params))
    return RequestState(request, prefill_only=prefill_only)


def make(budget=16, seqs=4, chunked=True, model_len=128, capacity=None,
         block_size=16, caching=False, reservation="full") -> Scheduler:
    """A scheduler; by default the reserve-at-admission one without prefix caching (the
    behaviour the first tests pin down; the prompts of ``state`` share their first tokens,
    so caching would change them): prefix caching and on-demand blocks have their own
    tests below."""
    return Scheduler(EngineConfig(max_num_seqs=seqs, max_model_len=model_len,
                                  max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                  kv_capacity_tokens=capacity, block_size=block_size,
                                  enable_prefix_caching=caching, kv_reservation=reservation),
                     eos_token_ids=(EOS,))


def all_free(sched: Scheduler) -> bool:
    """Every block free or cached with no reference, nobody holding any."""
    cap = sched.capacity
    return (sched.reserved_tokens == 0 and sched.num_used_seqs == 0
            and cap.num_free_blocks == cap.num_blocks and not any(cap.ref_cnt))


def entries(batch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.requests, batch.num_new_tokens)]


def step(sched: Scheduler, token: int = TOKEN):
    """Schedule, "sample" ``token`` for every entry that completes, update. Returns the batch
    entries (as scheduled) and the produced states."""
    batch = sched.schedule()
    scheduled = entries(batch)
    sampled = {i: token for i in range(len(batch.requests)) if batch.completes(i)}
    produced = sched.update(batch, sampled)
    return scheduled, produced


def test_decodes_go_first_then_part_way_prompts_then_new():
    sched = make(budget=16)
    a = state("a", 4, max_tokens=10)
    sched.add(a)
    assert step(sched)[0] == [("a", 4)]  # a prefilled, first token sampled
    assert a.status == RequestStatus.RUNNING and not a.is_prefilling
    b = state("b", 30, max_tokens=10)
    sched.add(b)
    assert step(sched)[0] == [("a", 1), ("b", 15)]  # decode first, b takes the rest
    c = state("c", 5, max_tokens=10)
    sched.add(c)
    # a decodes, b (part-way) continues before c is admitted: b's remaining 15 fill the budget
    assert step(sched)[0] == [("a", 1), ("b", 15)]
    assert c.status == RequestStatus.WAITING and c.block_ids is None
    # now a and b decode, then c's prompt
    assert step(sched)[0] == [("a", 1), ("b", 1), ("c", 5)]


def test_token_budget_respected_every_step_until_all_finish():
    rng = random.Random(0)
    for chunked in (True, False):
        budget = 16
        sched = make(budget=budget, seqs=3, chunked=chunked, model_len=64)
        states = [state(f"r{i}", rng.randint(1, budget), max_tokens=rng.randint(1, 6))
                  for i in range(12)]
        for s in states:
            sched.add(s)
        num_steps = 0
        while sched.has_work():
            batch = sched.schedule()
            assert batch.num_tokens <= budget
            assert sum(batch.num_new_tokens) == batch.num_tokens
            assert len(batch.requests) <= 3 and len({id(s) for s in batch.requests}) == len(batch.requests)
            assert all(n >= 1 for n in batch.num_new_tokens)
            assert sched.num_used_seqs <= 3
            sched.update(batch, {i: TOKEN for i in range(len(batch.requests)) if batch.completes(i)})
            num_steps += 1
            assert num_steps < 200
        for s in states:
            assert s.status == RequestStatus.FINISHED_LENGTH
            assert s.num_output_tokens == s.sampling.max_tokens
            assert s.num_computed_tokens == s.num_prompt_tokens + s.sampling.max_tokens - 1
        assert all_free(sched) and not sched.running and not sched.waiting


def test_chunked_prefill_splits_40_into_16_16_8():
    sched = make(budget=16)
    a = state("a", 40, max_tokens=3)
    sched.add(a)
    chunks = []
    for _ in range(3):
        batch = sched.schedule()
        chunks.append(entries(batch))
        completes = [batch.completes(i) for i in range(len(batch.requests))]
        sched.update(batch, {i: TOKEN for i, c in enumerate(completes) if c})
        chunks[-1].append(completes)
    assert chunks == [[("a", 16), [False]], [("a", 16), [False]], [("a", 8), [True]]]
    assert a.num_computed_tokens == 40 and a.output_token_ids == [TOKEN]
    assert step(sched)[0] == [("a", 1)]  # then it decodes


def test_chunking_off_runs_whole_prompts_and_waits_for_room():
    sched = make(budget=16, chunked=False)
    a, b = state("a", 10, max_tokens=5), state("b", 10, max_tokens=5)
    sched.add(a)
    sched.add(b)
    scheduled, _ = step(sched)
    assert scheduled == [("a", 10)]  # b needs 10 > 6 left: waits, not chunked
    assert b.status == RequestStatus.WAITING and b.block_ids is None and list(sched.waiting) == [b]
    scheduled, _ = step(sched)
    assert scheduled == [("a", 1), ("b", 10)]  # 1 + 10 <= 16: whole prompt
    assert b.num_computed_tokens == 10 and b.num_output_tokens == 1


def test_chunking_off_prompt_of_exactly_the_budget_runs_whole():
    sched = make(budget=16, chunked=False)
    sched.add(state("a", 16))
    assert step(sched)[0] == [("a", 16)]


def test_admission_by_kv_capacity_waits_until_release():
    sched = make(budget=64, capacity=50)  # ceil(50 / 16) = 4 blocks
    assert sched.capacity.num_blocks == 4
    a = state("a", 30, max_tokens=10)  # reserves 40 tokens = 3 blocks
    b = state("b", 20, max_tokens=10)  # reserves 30 = 2 blocks: 3 + 2 > 4
    sched.add(a)
    sched.add(b)
    assert step(sched)[0] == [("a", 30)]
    assert sched.reserved_tokens == 40 and a.block_ids == [0, 1, 2]
    assert b.status == RequestStatus.WAITING and b.block_ids is None
    for _ in range(8):  # a decodes; b still waits (budget is plenty, capacity is not)
        scheduled, _ = step(sched)
        assert scheduled == [("a", 1)]
    scheduled, produced = step(sched)
    assert scheduled == [("a", 1)] and a.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 10 and a.block_ids is None
    assert all_free(sched)
    assert step(sched)[0] == [("b", 20)]
    assert sched.reserved_tokens == 30 and b.block_ids == [0, 1]
    assert sched.capacity.num_used_blocks == 2


def test_fcfs_head_of_line_blocks_smaller_later_request():
    sched = make(budget=64, capacity=50)
    a, b, c = state("a", 30, 10), state("b", 20, 10), state("c", 3, 2)  # 3, 2, 1 blocks of 4
    for s in (a, b, c):
        sched.add(s)
    assert step(sched)[0] == [("a", 30)]
    # c (1 block) would fit (3 + 1 <= 4) but b is first in line
    assert list(sched.waiting) == [b, c] and c.block_ids is None
    assert step(sched)[0] == [("a", 1)]
    sched.release(a)
    scheduled, _ = step(sched)
    assert scheduled == [("b", 20), ("c", 3)]  # 2 + 1 <= 4 blocks, in arrival order


def test_blocks_reused_lowest_first():
    sched = make(budget=64, seqs=4)
    states = {rid: state(rid, 2, max_tokens=8) for rid in "abc"}
    for s in states.values():
        sched.add(s)
    step(sched)
    assert [states[r].block_ids for r in "abc"] == [[0], [1], [2]]
    sched.release(states["b"])
    sched.release(states["a"])
    assert states["a"].block_ids is None and states["b"].block_ids is None
    d, e, f = state("d", 2), state("e", 2), state("f", 2)
    for s in (d, e, f):
        sched.add(s)
    step(sched)
    assert (d.block_ids, e.block_ids, f.block_ids) == ([0], [1], [3])
    # a request of 3 blocks takes the lowest run of 3 free blocks (first fit), not the hole
    sched.release(d)
    sched.release(f)
    g = state("g", 40, max_tokens=8)  # 48 tokens = 3 blocks; free: 0, 3, 4, 5, ...
    sched.add(g)
    step(sched)
    assert g.block_ids == [3, 4, 5]


def test_block_allocator_unit():
    cap = BlockAllocator(num_blocks=4, block_size=4)
    assert cap.fits_ever(16) and not cap.fits_ever(17)
    a = cap.allocate(6)  # 2 blocks
    assert a == [0, 1] and cap.ref_cnt == [1, 1, 0, 0]
    assert cap.num_used_blocks == 2 and cap.num_free_blocks == 2
    b = cap.allocate(1)
    assert b == [2] and cap.num_free_blocks == 1
    cap.free(a)  # free: 0, 1, 3: no run of 3, so the lowest three, scattered
    assert cap.allocate(9) == [0, 1, 3] and cap.num_free_blocks == 0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks"):
        cap.allocate(1)
    cap.free(b)
    with pytest.raises(ValueError, match=r"blocks \[2\] are not allocated here"):
        cap.free(b)  # a double free: refused, and nothing changes
    assert cap.ref_cnt == [1, 1, 0, 1] and cap.num_free_blocks == 1


@pytest.mark.parametrize("num_tokens,num_blocks", [(15, 1), (16, 1), (17, 2), (31, 2), (32, 2),
                                                    (33, 3)])
def test_reservation_rounds_up_to_whole_blocks_and_frees_all(num_tokens, num_blocks):
    sched = make(budget=64, seqs=2, capacity=64)
    s = state("a", num_tokens - 3, max_tokens=3)
    sched.add(s)
    step(sched)
    assert len(s.block_ids) == num_blocks == sched.capacity.num_used_blocks
    while sched.has_work():
        step(sched)
    assert s.status == RequestStatus.FINISHED_LENGTH and s.block_ids is None and all_free(sched)


def test_request_larger_than_the_cache_is_refused_at_add_and_blocks_nothing():
    sched = make(budget=64, capacity=32)  # 2 blocks of 16
    big = state("big", 30, max_tokens=3)  # 33 tokens = 3 blocks
    with pytest.raises(ValueError, match=r"big: needs 33 KV tokens \(3 blocks of 16\).*"
                                         r"2 blocks = 32 tokens"):
        sched.add(big)
    assert not sched.waiting and big.block_ids is None
    ok = state("ok", 29, max_tokens=3)  # 32 tokens: exactly the cache
    sched.add(ok)
    while sched.has_work():
        step(sched)
    assert ok.status == RequestStatus.FINISHED_LENGTH and all_free(sched)


def test_max_num_seqs_limits_admission_even_with_free_blocks():
    sched = make(budget=64, seqs=2)
    states = [state(r, 2, max_tokens=4) for r in "abc"]
    for s in states:
        sched.add(s)
    assert [r for r, _ in step(sched)[0]] == ["a", "b"]
    assert states[2].block_ids is None and sched.capacity.num_free_blocks > 0


def test_imported_request_joins_as_decode_once_its_kv_arrived():
    sched = make(budget=8)
    s = state("imp", 20, max_tokens=3)  # prompt larger than the budget: no prefill needed
    s.token_ids.append(TOKEN)
    s.num_computed_tokens = 20
    s.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.add(s)
    batch = sched.schedule()
    assert batch.is_empty and batch.kv_reserved == [s] and sched.receiving == [s]
    assert sched.reserved_tokens == 23  # full reservation: prompt + max_tokens
    sched.kv_arrived(s)
    batch = sched.schedule()
    assert entries(batch) == [("imp", 1)] and batch.completes(0)
    assert batch.num_prefill_tokens == 0


# ---- update(): stop conditions and release --------------------------------------------------

def run_first_token(sched, s, token):
    sched.add(s)
    batch = sched.schedule()
    assert batch.completes(0)
    return sched.update(batch, {0: token})


def test_stop_token_finishes_and_frees():
    sched = make()
    s = state("a", 3, max_tokens=10, stop_token_ids=(7,))
    assert run_first_token(sched, s, 7) == [s]
    assert s.status == RequestStatus.FINISHED_STOPPED and s.output_token_ids == [7]
    assert s.block_ids is None and all_free(sched) and not sched.running


def test_eos_finishes_unless_ignore_eos():
    sched = make()
    s = state("a", 3, max_tokens=10)
    run_first_token(sched, s, EOS)
    assert s.status == RequestStatus.FINISHED_STOPPED and s.block_ids is None
    assert sched.reserved_tokens == 0
    t = state("b", 3, max_tokens=10, ignore_eos=True)
    run_first_token(sched, t, EOS)
    assert t.status == RequestStatus.RUNNING and t.block_ids == [0]
    assert sched.reserved_tokens == 13
    # a stop token still stops an ignore_eos request
    u = state("c", 3, max_tokens=10, ignore_eos=True, stop_token_ids=(EOS,))
    run_first_token(make(), u, EOS)
    assert u.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_gives_finished_length():
    sched = make()
    one = state("one", 3, max_tokens=1)
    run_first_token(sched, one, TOKEN)
    assert one.status == RequestStatus.FINISHED_LENGTH and one.block_ids is None
    three = state("three", 3, max_tokens=3)
    sched.add(three)
    statuses = []
    for _ in range(3):
        step(sched)
        statuses.append(three.status)
    assert statuses == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH]
    assert three.output_token_ids == [TOKEN] * 3
    assert sched.reserved_tokens == 0 and not sched.has_work()


def test_prefill_only_becomes_prefilled_and_keeps_blocks():
    sched = make()
    s = state("p", 5, max_tokens=8, prefill_only=True)
    run_first_token(sched, s, TOKEN)
    assert s.status == RequestStatus.PREFILLED and not s.status.is_finished
    assert s.block_ids == [0] and sched.reserved_tokens == 6  # prompt + 1, not + max_tokens
    assert not sched.has_work()  # a PREFILLED request is not scheduled again
    assert sched.schedule().is_empty
    sched.release(s)
    assert all_free(sched) and s.block_ids is None and not sched.running
    sched.release(s)  # idempotent
    # a prefill-only request that ends with its first token is finished, not PREFILLED
    t = state("q", 5, max_tokens=1, prefill_only=True)
    run_first_token(sched, t, TOKEN)
    assert t.status == RequestStatus.FINISHED_LENGTH and t.block_ids is None


def test_update_counts_only_sampled_entries_and_releases_finished_from_running():
    sched = make(budget=16)
    a, b = state("a", 4, max_tokens=1), state("b", 30, max_tokens=4)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert entries(batch) == [("a", 4), ("b", 12)]
    produced = sched.update(batch, {0: TOKEN})
    assert produced == [a] and a.status == RequestStatus.FINISHED_LENGTH
    assert sched.running == [b] and b.num_computed_tokens == 12 and b.output_token_ids == []
    assert sched.reserved_tokens == 34


def test_free_keeps_the_free_list_sorted_for_runs_and_scattered_tables():
    """``free`` inserts a consecutive table in place (no sort): the free list equals
    ``sorted`` of everything free, for runs, for fragmented (scattered) tables, and for a
    random admit/free sequence; blocks are handed out lowest first as before."""
    alloc = BlockAllocator(num_blocks=12, block_size=4)
    a, b, c, f = alloc.allocate(8), alloc.allocate(12), alloc.allocate(8), alloc.allocate(8)
    assert (a, b, c, f) == ([0, 1], [2, 3, 4], [5, 6], [7, 8])
    alloc.free(a)
    alloc.free(c)  # runs inserted where they go
    assert alloc._free == [0, 1, 5, 6, 9, 10, 11]
    d = alloc.allocate(20)  # 5 blocks, no run of 5 free: the lowest ones, scattered
    assert d == [0, 1, 5, 6, 9] and alloc._free == [10, 11]
    alloc.free(d)  # a scattered table
    assert alloc._free == [0, 1, 5, 6, 9, 10, 11]
    alloc.free(b)
    assert alloc._free == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
    alloc.free(f)
    assert alloc._free == list(range(12)) and alloc.allocate(4) == [0]

    rng, held = random.Random(3), []
    alloc = BlockAllocator(num_blocks=64, block_size=1)
    for _ in range(400):
        if held and (rng.random() < 0.5 or alloc.num_free_blocks < 8):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.allocate(rng.randint(1, 8)))
        taken = sorted(b for table in held for b in table)
        assert alloc._free == sorted(set(range(64)) - set(taken))


def test_release_of_a_waiting_request_drops_it_from_the_queue():
    sched = Scheduler(EngineConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64))
    a, b = (RequestState(Request(n, (3, 4, 5), SamplingParams(max_tokens=2))) for n in "ab")
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a admitted (holds blocks), b waits: one slot
    sched.release(b)
    assert not sched.waiting and sched.running == [a]
    sched.release(a)
    assert not sched.running and sched.capacity.num_used_blocks == 0


# ---- prefix caching and on-demand blocks with preemption ----------------------------------

def cached(**kw) -> Scheduler:
    """Prefix caching on, blocks on demand: the engine's defaults."""
    return make(caching=True, reservation="on_demand", **kw)


def prompt_state(rid: str, tokens, max_tokens: int = 4, prefill_only: bool = False) -> RequestState:
    return RequestState(Request(rid, tuple(tokens), SamplingParams(max_tokens=max_tokens)),
                        prefill_only=prefill_only)


def run_to_end(sched: Scheduler, limit: int = 500) -> int:
    """Step until nothing is left; returns the steps taken."""
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < limit
    return steps


def remote_state(rid: str, tokens, max_tokens: int = 4, kv_token_start: int = 0) -> RequestState:
    """As ``Engine.add_remote`` builds it: prompt computed elsewhere, first token appended."""
    s = prompt_state(rid, tokens, max_tokens)
    s.token_ids.append(TOKEN)
    s.num_computed_tokens = s.num_prompt_tokens
    s.first_output_index = 1
    s.kv_token_start = kv_token_start
    s.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    return s


def test_prefix_hit_skips_the_cached_blocks_and_always_computes_the_last_token():
    sched = cached(budget=64)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = prompt_state("a", prompt, max_tokens=2)
    sched.add(a)
    run_to_end(sched)
    assert all_free(sched) and sched.capacity.num_cached_blocks == 2  # a's prompt blocks
    b = prompt_state("b", prompt, max_tokens=2)  # the same 40 tokens: 2 blocks hit
    c = prompt_state("c", prompt[:32], max_tokens=2)  # 2 full blocks, but the last token
    d = prompt_state("d", prompt[:32] + [7], max_tokens=2)  # must compute: 1 block hit
    for s in (b, c, d):
        sched.add(s)
    scheduled, _ = step(sched)
    assert scheduled == [("b", 8), ("c", 16), ("d", 1)]  # d: a full hit computes one token
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (32, 16, 32)
    assert b.block_ids[:2] == c.block_ids[:1] + [b.block_ids[1]] == d.block_ids[:2]
    shared0, shared1 = b.block_ids[:2]
    assert sched.capacity.ref_cnt[shared0] == 3 and sched.capacity.ref_cnt[shared1] == 2
    # c recomputed block 1 into a block of its own (the same hash stays registered once)
    assert c.block_ids[1] != shared1 and sched.capacity.block_hash[c.block_ids[1]] is None
    stats = sched.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (4, 40 + 40 + 32 + 33, 32 + 16 + 32)
    run_to_end(sched)
    assert all_free(sched)


def test_blocks_registered_this_step_are_shared_in_it_and_forgotten_if_it_fails():
    sched = cached(budget=128)
    prompt = list(range(200, 240))
    a, b = prompt_state("a", prompt), prompt_state("b", prompt)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert entries(batch) == [("a", 40), ("b", 8)]  # b shares the blocks a computes now
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 32
    sched.step_failed()  # the forward failed: those blocks hold no KV
    sched.release(a)
    sched.release(b)
    assert all_free(sched) and sched.capacity.num_cached_blocks == 0
    c = prompt_state("c", prompt)
    sched.add(c)
    assert entries(sched.schedule()) == [("c", 40)]  # nothing stale was hit


def test_newest_running_request_is_preempted_and_recomputes_prompt_and_outputs():
    # 3 blocks of 16; three 16-token prompts fill them; their first decode needs a block each
    sched = make(budget=64, capacity=48, reservation="on_demand")
    states = [prompt_state(r, range(16 * i, 16 * i + 16), max_tokens=8) for i, r in
              enumerate("abc")]
    for s in states:
        sched.add(s)
    a, b, c = states
    assert step(sched)[0] == [("a", 16), ("b", 16), ("c", 16)]
    assert sched.capacity.num_free_blocks == 0 and [len(s.block_ids) for s in states] == [1, 1, 1]
    # a's token 16 needs a block: c (the newest) is preempted for it; then b's needs one,
    # and b is the newest left, so b preempts itself
    batch = sched.schedule()
    assert entries(batch) == [("a", 1)] and batch.preempted == [c, b]
    assert c.status == RequestStatus.WAITING and c.block_ids is None and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.token_ids == list(range(32, 48)) + [TOKEN]
    assert list(sched.waiting) == [b, c] and sched.num_preemptions == 2
    sched.update(batch, {0: TOKEN})
    run_to_end(sched)
    for s in states:
        assert s.status == RequestStatus.FINISHED_LENGTH and s.num_output_tokens == 8
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert all_free(sched)


def test_a_victim_already_scheduled_this_step_is_taken_out_of_the_batch():
    """A part-way prompt (older) needs a block; the newest running request is a remote one
    that already decodes in this step: it is unscheduled, preempted, and later recomputes
    its prompt + first token locally (a preempted request in a disaggregated placement
    recomputes on its decode worker, no second transfer)."""
    sched = make(budget=17, capacity=48, reservation="on_demand")
    p = prompt_state("p", range(100, 140), max_tokens=4)  # 40 + 4 tokens: 3 blocks at most
    d = remote_state("d", range(0, 15), max_tokens=3)  # 15 + 1 tokens: 1 block
    sched.add(p)
    sched.add(d)
    batch = sched.schedule()
    assert entries(batch) == [("p", 17)] and batch.kv_reserved == [d]
    sched.update(batch, {})
    sched.kv_arrived(d)
    assert sched.running == [p, d] and sched.capacity.num_free_blocks == 0
    batch = sched.schedule()  # d decodes first, then p's chunk needs its 3rd block
    assert entries(batch) == [("p", 16)] and batch.preempted == [d]
    assert d.status == RequestStatus.WAITING and d.block_ids is None and list(sched.waiting) == [d]
    sched.update(batch, {})
    assert step(sched)[0] == [("p", 7)]  # p completes; d waits for blocks
    run_to_end(sched)
    assert d.token_ids[:16] == list(range(0, 15)) + [TOKEN] and d.num_output_tokens == 3
    assert p.num_output_tokens == 4 and all_free(sched)


def test_prefilled_and_receiving_requests_are_never_preempted():
    sched = make(budget=64, capacity=48, reservation="on_demand")
    held = prompt_state("held", range(0, 17), prefill_only=True)  # 2 blocks, awaiting export
    sched.add(held)
    step(sched)
    assert held.status == RequestStatus.PREFILLED and len(held.block_ids) == 2
    remote = remote_state("remote", range(50, 56))  # 7 tokens: its last free block
    sched.add(remote)
    batch = sched.schedule()
    assert batch.kv_reserved == [remote] and sched.capacity.num_free_blocks == 0
    local = prompt_state("local", range(70, 75), max_tokens=4)
    sched.add(local)
    assert sched.schedule().is_empty  # no block for it, nobody it may preempt: it waits
    assert local.status == RequestStatus.WAITING and sched.num_preemptions == 0
    sched.kv_arrived(remote)
    for _ in range(2):
        step(sched)  # the remote request decodes (tokens 7, 8 fit its block)
    assert held.status == RequestStatus.PREFILLED and len(held.block_ids) == 2
    sched.release(held)  # exported: now local fits
    run_to_end(sched)
    assert local.num_output_tokens == 4 and remote.num_output_tokens == 4 and all_free(sched)


def test_refcounts_after_abort_preemption_and_finish():
    sched = cached(budget=128, capacity=96)  # 6 blocks
    prompt = list(range(300, 333))  # 33 tokens: 2 full blocks
    a, b = prompt_state("a", prompt, max_tokens=8), prompt_state("b", prompt, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    ref = sched.capacity.ref_cnt
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared and [ref[x] for x in shared] == [2, 2]
    sched.release(a)  # abort: its own block free, the shared ones still b's
    assert [ref[x] for x in shared] == [1, 1] and sched.capacity.num_used_blocks == 3
    batch = ScheduledBatch()
    sched._preempt(b, batch)  # preemption: b holds nothing, the full blocks stay cached
    assert [ref[x] for x in shared] == [0, 0] and all_free(sched)
    assert sched.capacity.num_cached_blocks == 2 and list(sched.waiting) == [b]
    step(sched)  # b comes back through the cache: 32 of its 34 tokens (prompt + 1 output)
    assert b.num_computed_tokens == 34 and b.block_ids[:2] == shared
    assert sched.prefix_cache_stats.preempted_hits == 32
    run_to_end(sched)  # finish
    assert b.block_ids is None and all_free(sched) and not any(ref)


def test_a_preempted_request_whose_prefix_was_evicted_meanwhile_recomputes_all_of_it():
    sched = cached(budget=64, capacity=64)  # 4 blocks
    a = prompt_state("a", range(0, 32), max_tokens=4)  # 2 full blocks
    sched.add(a)
    step(sched)
    sched._preempt(a, ScheduledBatch())  # its 2 full blocks stay cached, evictable
    assert sched.capacity.num_cached_blocks == 2
    sched.waiting.remove(a)  # (held aside while another request takes every block)
    filler = prompt_state("filler", range(500, 560), max_tokens=2)  # 60 + 2 tokens: 4 blocks
    sched.add(filler)
    run_to_end(sched)
    assert sched.capacity.num_cached_blocks == 3  # the filler's; a's blocks were evicted
    sched.waiting.append(a)
    scheduled, _ = step(sched)
    assert scheduled == [("a", 33)] and sched.prefix_cache_stats.preempted_hits == 0
    run_to_end(sched)
    assert a.num_output_tokens == 4 and all_free(sched)


def test_remote_request_shares_cached_prompt_blocks_or_recomputes_if_its_prefix_is_gone():
    sched = cached(budget=64)
    prompt = list(range(400, 440))
    local = prompt_state("local", prompt, max_tokens=1)
    sched.add(local)
    step(sched)
    assert sched.capacity.num_cached_blocks == 2
    r1 = remote_state("r1", prompt, kv_token_start=32)  # its KV comes from token 32 on
    sched.add(r1)
    batch = sched.schedule()
    assert batch.kv_reserved == [r1] and r1.num_cached_tokens == 32
    assert len(r1.block_ids) == 3 and r1.num_reserved_tokens == 41  # prompt + 1
    stats = sched.prefix_cache_stats
    assert (stats.transfer_queries, stats.transfer_hits) == (40, 32)
    sched.kv_arrived(r1)
    run_to_end(sched)
    r2 = remote_state("r2", list(range(600, 640)), kv_token_start=16)  # nothing cached
    sched.add(r2)
    batch = sched.schedule()
    assert batch.kv_dropped == [r2] and not batch.kv_reserved
    assert entries(batch) == [("r2", 41)]  # recomputes prompt + first token here
    assert r2.status == RequestStatus.RUNNING and r2.kv_token_start == 0
    run_to_end(sched)
    assert r2.num_output_tokens == 4 and all_free(sched)
