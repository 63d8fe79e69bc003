"""The assignment core (``router.assignment``): its rules on their own, and the online router
and the planner's simulator driven by one event sequence, giving the same assignments and
the same loads after every event (before the core, the simulator charged decode loads in
tokens and the router in whole KV blocks, so under ``least_loaded`` they picked different
decode workers)."""

from __future__ import annotations

import pytest

from channel.local import open_local_port
from engine import events as ev
from engine.config import ConditionalConfig, EngineConfig
from engine.request import Request, SamplingParams
from planner.latency import TransferModel
from planner.simulate import Simulator
from router.assignment import Assigner
from router.router import Router, WorkerRef

BLOCK = 16
SPEC = {"model_fingerprint": "fake", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
        "dtype": "float32"}


# ---- the rules ------------------------------------------------------------------------------
def test_charges_count_whole_blocks_and_release_to_zero():
    a = Assigner([("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")],
                 "disagg", "least_loaded", kv_block_size=BLOCK)
    assert a.kv_tokens(12, 8) == 32 and a.kv_tokens(16, 16) == 32 and a.kv_tokens(1, 0) == 16
    first = a.assign("r0", 12, 8)
    assert (first.first, first.decode, first.remote) == ("prefill-0", "decode-0", True)
    assert a.loads == {"prefill-0": 12, "decode-0": 32, "decode-1": 0}
    assert a.num_queued_prefills == 1 and a.requests_needing("prefill-0") == ["r0"]
    a.prefilled("r0", "prefill-0")
    a.prefilled("r0", "prefill-0")  # once only
    assert a.loads == {"prefill-0": 0, "decode-0": 32, "decode-1": 0}
    assert a.num_queued_prefills == 0 and a.requests_needing("prefill-0") == []
    a.release("r0")
    a.release("r0")
    assert a.loads == dict.fromkeys(a.loads, 0)


def test_round_robin_keeps_one_counter_per_pool_and_skips_dead_workers():
    a = Assigner([("colocated-0", "colocated"), ("colocated-1", "colocated"),
                  ("colocated-2", "colocated")], "colocated", "round_robin")
    assert [a.assign(f"r{i}", 4, 4).first for i in range(4)] == \
        ["colocated-0", "colocated-1", "colocated-2", "colocated-0"]
    a.mark_dead("colocated-2")
    assert not a.is_live("colocated-2") and a.is_live("colocated-0")
    picks = [a.assign(f"s{i}", 4, 4).first for i in range(3)]
    assert "colocated-2" not in picks
    a.mark_dead("colocated-0")
    a.mark_dead("colocated-1")
    with pytest.raises(ValueError, match="no live worker"):
        a.assign("t", 4, 4)
    assert a.requests_needing("colocated-2") == ["r2"]  # charged before it died


def test_conditional_prefills_short_prompts_locally_by_dynamos_rule():
    rule = ConditionalConfig(max_local_prefill_length=8, max_prefill_queue_size=2)
    a = Assigner([("prefill-0", "prefill"), ("decode-0", "decode")], "conditional",
                 conditional=rule)
    assert not a.assign("short", 8, 4).remote  # <= max_local_prefill_length: local
    assert a.assign("long", 9, 4).remote
    assert a.num_queued_prefills == 1
    assert a.assign("long2", 9, 4).remote  # 1 queued, fewer than 2
    assert not a.assign("long3", 9, 4).remote  # 2 queued: local after all
    a.prefilled("long", "prefill-0")
    assert a.num_queued_prefills == 1 and a.assign("long4", 9, 4).remote
    assert a.loads == {"prefill-0": 18, "decode-0": 12 + 4 * 13}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="placement kind"):
        Assigner([("x", "colocated")], "mixed")
    with pytest.raises(ValueError, match="policy"):
        Assigner([("x", "colocated")], "colocated", "random")
    with pytest.raises(ValueError, match="needs a decode worker"):
        Assigner([("prefill-0", "prefill")], "disagg")
    a = Assigner([("x", "colocated")], "colocated")
    a.assign("r", 1, 1)
    with pytest.raises(ValueError, match="already assigned"):
        a.assign("r", 1, 1)


# ---- router and simulator, one event sequence -------------------------------------------------
# (event, request id, prompt tokens, max_tokens); r0 and r1 charge 20 and 17 tokens, one block
# pair (32) each: counted in tokens r2 goes to decode-1, in blocks to decode-0 (the tie's first).
EVENTS = [("arrive", "r0", 12, 8), ("arrive", "r1", 9, 8), ("prefilled", "r0"),
          ("arrive", "r2", 5, 3), ("prefilled", "r1"), ("finish", "r0"), ("prefilled", "r2"),
          ("finish", "r2"), ("finish", "r1")]


class ScriptedWorker:
    """A worker whose events are put on its outbox by the test (nothing happens by itself)."""

    def __init__(self, name: str) -> None:
        self.name, self.role = name, name.split("-")[0]
        self.outbox = _Outbox()

    def open_channel(self, endpoint) -> None:
        self.outbox.port = open_local_port(endpoint)

    def info(self) -> dict:
        return {"kv_spec": SPEC, "max_model_len": 128, "vocab_size": 256,
                "kv_block_size": BLOCK}

    def submit(self, request, dst_rank=None, kv_token_start=0) -> None:
        pass

    def admit(self, request, first_token, kv_handles, kv_token_start=0) -> None:
        pass

    def abort(self, request_id) -> None:
        pass

    def release(self, handles) -> None:
        pass



class _Outbox:
    """What the test appends leaves at once through the worker's channel port."""

    port = None

    def append(self, event: ev.WorkerEvent) -> None:
        self.port.send((event,))


class _Done:
    def __init__(self, value) -> None:
        self.value = value


class InstantCalls:
    """``Calls`` that run each call at once, in the router's thread."""

    def call(self, worker, method, *args):
        return _Done(getattr(worker, method)(*args))

    def ready(self, pending, timeout_s):
        return list(pending)

    def result(self, pending):
        return pending.value


def request(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, tuple(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens))


def test_router_and_simulator_assign_alike_event_by_event():
    names = ["prefill-0", "decode-0", "decode-1"]
    workers = {n: ScriptedWorker(n) for n in names}
    router = Router([WorkerRef(n, w.role, w) for n, w in workers.items()], InstantCalls(),
                    "disagg:1p2d", "least_loaded", poll_s=0.0)
    sim = Simulator("disagg:1p2d", EngineConfig(max_num_seqs=8, max_model_len=128,
                                                max_num_batched_tokens=64, block_size=BLOCK),
                    lambda *features: 0.01, TransferModel(0.0, 1e9), kv_bytes_per_token=64)
    sim.run([])  # an empty run leaves the simulator's state ready for its event handlers
    decode_of, router_loads, sim_loads = {}, [], []
    for t, (kind, rid, *lengths) in enumerate(EVENTS):
        if kind == "arrive":
            router.submit(request(rid, *lengths), sink=lambda event: None)
            sim._arrive(float(t), request(rid, *lengths))
        elif kind == "prefilled":
            workers["prefill-0"].outbox.append(ev.WorkerEvent(
                ev.PREFILLED, rid, "prefill-0", float(t), token_id=7, index=0, kv_handles=()))
            sim._hand_over(float(t), sim._flights[rid])
        else:
            decode = decode_of[rid]
            workers[decode].outbox.append(ev.WorkerEvent(
                ev.TOKEN, rid, decode, float(t), token_id=9, index=1, finish_reason="length"))
            sim._finish(sim._flights[rid], float(t))
        router._step(0.0)  # takes the submit or hears the event (sent before the step)
        if kind == "arrive":
            decode_of[rid] = router._flights[rid].record.decode_worker
            assert sim._flights[rid].decode == decode_of[rid], (kind, rid)
        router_loads.append(dict(router.loads))
        sim_loads.append(dict(sim._assigner.loads))
        assert router_loads[-1] == sim_loads[-1], (t, kind, rid)
    assert decode_of == {"r0": "decode-0", "r1": "decode-1", "r2": "decode-0"}
    assert router_loads[3] == {"prefill-0": 9 + 5, "decode-0": 32 + 16, "decode-1": 32}
    assert router_loads[-1] == dict.fromkeys(names, 0)


# ---- cache_aware and the prefix index --------------------------------------------------------
from engine.kv_blocks import block_hashes  # noqa: E402
from router.policy import cache_aware, imbalanced, pick  # noqa: E402
from router.prefix_index import PrefixIndex  # noqa: E402


def test_imbalance_needs_both_sglang_thresholds():
    # defaults abs 32, rel 1.0001 (SGLang's): 40 vs 7 differs by 33 > 32 and 40 > 7.0007
    assert imbalanced([40, 7])
    assert not imbalanced([39, 7])  # differs by 32: not > 32
    # relative threshold alone: 33 vs 0 passes both (33 > 0 * 1.0001)
    assert imbalanced([33, 0])
    # hand-set thresholds: abs 2, rel 1.5: 10 vs 7 differs by 3 > 2 but 10 < 10.5
    assert not imbalanced([10, 7], abs_threshold=2, rel_threshold=1.5)
    assert imbalanced([11, 7], abs_threshold=2, rel_threshold=1.5)  # 11 > 10.5
    assert not imbalanced([])


def test_cache_aware_takes_the_longest_match_until_the_pool_is_imbalanced():
    workers = ["w0", "w1", "w2"]
    loads = {"w0": 500, "w1": 100, "w2": 300}  # tokens
    matches = {"w0": 3, "w1": 0, "w2": 1}  # cached blocks
    balanced = {"w0": 10, "w1": 0, "w2": 5}  # requests: 10 - 0 <= 32
    assert cache_aware(workers, loads, matches, balanced) == "w0"  # best match, however loaded
    crowded = {"w0": 40, "w1": 0, "w2": 5}  # 40 - 0 > 32 and 40 > 0
    assert cache_aware(workers, loads, matches, crowded) == "w1"  # least loaded (tokens)
    # ties on the match (and no match anywhere) go to the least loaded of the tied
    assert cache_aware(workers, loads, {"w0": 2, "w2": 2}, balanced) == "w2"
    assert cache_aware(workers, loads, {}, balanced) == "w1"
    assert pick("cache_aware", workers, loads, 0, matches, balanced) == "w0"
    with pytest.raises(ValueError, match="no live worker"):
        cache_aware([], loads, matches, balanced)


def test_prefix_index_matches_leading_blocks_and_forgets_lru_first():
    a, b = list(range(48)), list(range(32)) + [99] * 16  # share 2 blocks of 16
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    index = PrefixIndex(["w0", "w1"], capacity_blocks=4)
    index.insert("w0", ha)
    assert index.match("w0", ha) == 3 and index.match("w0", hb) == 2 and index.match("w1", ha) == 0
    index.insert("w0", hb[2:])  # a 4th block: at capacity
    index.insert("w0", block_hashes([7] * 16, 16))  # a 5th: the least recent (ha[0]) goes
    assert index.num_blocks("w0") == 4 and index.match("w0", ha) == 0
    index.forget("w0")
    assert index.match("w0", hb) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(["w0"], capacity_blocks=0)


def test_cache_aware_assigner_sends_a_shared_prefix_back_to_its_worker():
    a = Assigner([("colocated-0", "colocated"), ("colocated-1", "colocated")], "colocated",
                 "cache_aware", kv_block_size=BLOCK)
    conv = block_hashes(list(range(40)), BLOCK)  # 2 full blocks
    other = block_hashes(list(range(100, 140)), BLOCK)
    assert a.assign("t0", 40, 8, conv).first == "colocated-0"  # no match: least loaded, first
    assert a.assign("u0", 40, 8, other).first == "colocated-1"  # no match: least loaded
    a.release("t0")
    a.release("u0")
    a.assign("u1", 40, 8, other)  # colocated-1 now carries load; the match still wins
    assert a.loads == {"colocated-0": 0, "colocated-1": 48}
    # t1 starts with conv's 2 blocks, credited to colocated-0 (t0 went there), 0 elsewhere
    assert a.assign("t1", 60, 8, block_hashes(list(range(40)) + [5] * 20, BLOCK)).first == \
        "colocated-0"
    a.release("t1")
    assert a.loads == {"colocated-0": 0, "colocated-1": 48}
    a.assign("u2", 40, 8, other)  # colocated-1 carries 96 tokens now, colocated-0 none
    assert a.assign("t2", 40, 8, conv).first == "colocated-0"  # conv's 2 blocks live there
    assert a.assign("u3", 40, 8, other).first == "colocated-1"  # the match beats the load
    assert a.prefix_hit_tokens("colocated-0", conv) == 32
    a.mark_dead("colocated-0")  # its cache died with it
    assert a.prefix_hit_tokens("colocated-0", conv) == 0
    for rid in ("u1", "u2", "u3", "t2"):
        a.release(rid)
    assert a.loads == dict.fromkeys(a.loads, 0)


def test_kv_token_start_skips_only_prefixes_whose_kv_landed():
    """A decode worker is sent a prompt's KV from the prefix it holds for sure: the blocks
    of prompts whose KV reached it (``kv_landed``), not those merely routed there (still in
    flight: a burst on one system prompt), whole blocks before the prompt's last token."""
    a = Assigner([("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")],
                 "disagg", "cache_aware", kv_block_size=BLOCK)
    system = list(range(40))  # 2 full blocks
    first = a.assign("t0", 40, 8, block_hashes(system, BLOCK))
    assert first.kv_token_start == 0
    burst = a.assign("t1", 45, 8, block_hashes(system + [7] * 5, BLOCK))
    assert burst.decode == first.decode and burst.kv_token_start == 0  # t0's KV in flight
    a.kv_landed("t0", first.decode)
    later = a.assign("t2", 50, 8, block_hashes(system + [9] * 10, BLOCK))
    assert later.decode == first.decode and later.kv_token_start == 32
    whole = a.assign("t3", 32, 8, block_hashes(system[:32], BLOCK))  # its prompt is 2 blocks
    assert whole.kv_token_start == 16  # the last token's block always travels
    assert a.kv_token_start("decode-1", block_hashes(system, BLOCK), 40) == 0  # not there
    a.mark_dead(first.decode)  # its cache died with it
    assert a.kv_token_start(first.decode, block_hashes(system, BLOCK), 40) == 0
    colocated = Assigner([("colocated-0", "colocated")], "colocated", "cache_aware", BLOCK)
    assert colocated.assign("c0", 40, 8, block_hashes(system, BLOCK)).kv_token_start == 0


def test_conditional_decides_on_the_prompt_minus_its_prefix_hit():
    rule = ConditionalConfig(max_local_prefill_length=20, max_prefill_queue_size=4)
    for policy in ("least_loaded", "round_robin", "cache_aware"):
        a = Assigner([("prefill-0", "prefill"), ("decode-0", "decode")], "conditional", policy,
                     kv_block_size=BLOCK, conditional=rule)
        prompt = list(range(48))  # 48 tokens > 20: remote
        first = a.assign("t0", 48, 4, block_hashes(prompt, BLOCK))
        assert first.remote and (first.first, first.decode) == ("prefill-0", "decode-0")
        a.release("t0")
        # the next turn: 48 + 4 answered + 8 new = 60 tokens, 3 of its blocks (48 tokens)
        # credited to decode-0: 60 - 48 = 12 <= 20, so decode-0 prefills it itself
        turn = prompt + [1, 2, 3, 4] + list(range(200, 208))
        second = a.assign("t1", 60, 4, block_hashes(turn, BLOCK))
        assert not second.remote and second.decode == "decode-0", policy
        a.release("t1")
        # the same prompt without hashes (caching off): 60 > 20, remote as before
        assert a.assign("t2", 60, 4).remote
        a.release("t2")
        assert a.loads == dict.fromkeys(a.loads, 0)
