"""The engine's greedy output equals transformers generate() on each prompt alone."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, reference_generate

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import FinishReason, Request, SamplingParams

LENGTHS = [1, 2, 7, 13, 24, 40, 3, 31, 17, 9]


def make_requests(prompts, max_tokens=12, **params):
    return [Request(f"r{i}", tuple(p), SamplingParams(max_tokens=max_tokens, **params))
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def references(tiny):
    prompts = random_prompts(LENGTHS)
    return prompts, [reference_generate(tiny.model, p, 12) for p in prompts]


@pytest.mark.parametrize("chunked,budget,seqs", [
    (True, 16, 4),    # prompts split across steps, mixed with running decodes
    (True, 7, 3),     # budget smaller than most prompts, fewer slots than requests
    (True, 512, 16),  # everything in one step
    (False, 64, 4),   # whole prompts, no chunking
    (False, 40, 2),
])
def test_greedy_matches_generate(tiny, references, chunked, budget, seqs):
    prompts, expected = references
    engine = Engine(tiny, EngineConfig(max_num_seqs=seqs, max_model_len=64,
                                       max_num_batched_tokens=budget, enable_chunked_prefill=chunked))
    outputs = engine.generate(make_requests(prompts))
    for i, want in enumerate(expected):
        assert outputs[f"r{i}"] == want, f"prompt {i} (len {len(prompts[i])})"
    assert engine.is_empty()
    assert sum(r.num_prefill_tokens for r in engine.step_records) == sum(LENGTHS)


def test_requests_join_while_others_decode_and_leave_early(tiny, references):
    prompts, expected = references
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16))
    max_tokens = [12, 3, 12, 1, 2, 12, 5, 12, 12, 4]
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    pending = [Request(f"r{i}", tuple(p), SamplingParams(max_tokens=m))
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    reasons = {}
    engine.add_request(pending.pop(0))
    while engine.has_unfinished() or pending:
        if pending:  # a new request every step, while earlier ones decode
            engine.add_request(pending.pop(0))
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
            assert out.index == len(outputs[out.request_id]) - 1
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for i, want in enumerate(expected):
        assert outputs[f"r{i}"] == want[:max_tokens[i]]
        assert reasons[f"r{i}"] == FinishReason.LENGTH
    assert engine.is_empty()


def test_abort_frees_kv_and_leaves_others_intact(tiny, references):
    prompts, expected = references
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16))
    for request in make_requests(prompts[:4]):
        engine.add_request(request)
    outputs = {f"r{i}": [] for i in range(4)}
    for _ in range(3):
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
    engine.abort("r1")
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out.token_id)
    for i in (0, 2, 3):
        assert outputs[f"r{i}"] == expected[i]
    assert engine.is_empty()


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_short_max_tokens(tiny, references, max_tokens):
    prompts, expected = references
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32))
    outputs = engine.generate(make_requests(prompts, max_tokens=max_tokens))
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [e[:max_tokens] for e in expected]
    assert engine.is_empty()


def test_first_token_eos_and_stop_tokens(tiny, references):
    prompts, expected = references
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32))
    # r0 stops on its first token (declared a stop token); r1 on its 4th token.
    engine.add_request(Request("r0", tuple(prompts[0]), SamplingParams(
        max_tokens=12, stop_token_ids=(expected[0][0],))))
    engine.add_request(Request("r1", tuple(prompts[1]), SamplingParams(
        max_tokens=12, stop_token_ids=(expected[1][3],))))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    by_id = {rid: [o for o in outs if o.request_id == rid] for rid in ("r0", "r1")}
    assert [o.token_id for o in by_id["r0"]] == expected[0][:1]
    assert by_id["r0"][-1].finish_reason == FinishReason.STOP
    first_stop = expected[1].index(expected[1][3])
    assert [o.token_id for o in by_id["r1"]] == expected[1][:first_stop + 1]
    assert engine.is_empty()


def test_model_eos_ends_request_unless_ignored(tiny, references):
    """The model's own EOS (as generate() uses it): find a prompt whose greedy first token is
    EOS by reusing its generation config, then check ignore_eos keeps decoding."""
    prompts, expected = references
    eos = expected[2][0]  # pretend this token is the model's EOS
    loaded = load_model(ModelConfig("tiny-random-llama"))
    loaded.eos_token_ids = (eos,)
    engine = Engine(loaded, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32))
    out = engine.generate([Request("a", tuple(prompts[2]), SamplingParams(max_tokens=5))])
    assert out["a"] == [eos]
    out = engine.generate([Request("b", tuple(prompts[2]), SamplingParams(max_tokens=5, ignore_eos=True))])
    assert out["b"] == expected[2][:5]
    want = reference_generate(loaded.model, prompts[2], 5, eos_token_id=eos)
    assert want == [eos]  # generate() agrees that EOS first ends the request


def test_export_import_continues_in_second_engine(tiny, references):
    prompts, expected = references
    config = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=24)
    prefill, decode = Engine(tiny, config), Engine(tiny, config)
    requests = make_requests(prompts[:6])
    for request in requests:
        prefill.add_request(request, prefill_only=True)
    by_id = {r.request_id: r for r in requests}
    outputs, fetched = {}, {}
    spec = tiny.kv_spec
    while prefill.has_unfinished():
        for out in prefill.step():  # hand each prefilled request over while decode is busy
            assert out.index == 0 and out.finish_reason is None
            request = by_id[out.request_id]
            kv, first = prefill.export_kv(request.request_id)
            assert first == out.token_id
            assert kv.shape == (spec.num_layers, 2, spec.num_kv_heads, request.num_prompt_tokens,
                                spec.head_dim)
            # 2 * layers * kv_heads * head_dim * tokens * itemsize (2 layers, 2 heads, 16 dims, fp32)
            assert kv.numel() * kv.element_size() == 2 * 2 * 2 * 16 * request.num_prompt_tokens * 4
            decode.add_remote(request, first)  # WAITING_FOR_REMOTE_KVS: nothing held yet
            fetched[request.request_id] = kv
            outputs[request.request_id] = [first]
        decode_step(decode, fetched, outputs)
    while decode.has_unfinished():
        decode_step(decode, fetched, outputs)
    for i in range(6):
        assert outputs[f"r{i}"] == expected[i]
    assert prefill.is_empty() and decode.is_empty()


def decode_step(decode: Engine, fetched: dict, outputs: dict) -> None:
    """One decode-engine step, then "fetch" the KV of every request whose slot it reserved
    (the decode worker's job): the KV enters the engine only once its slot exists."""
    step = decode.step()
    for out in step:
        outputs[out.request_id].append(out.token_id)
    for rid in step.kv_reserved:
        decode.finish_remote(rid, fetched.pop(rid))


@pytest.mark.parametrize("reservation,reserved", [("full", 6), ("on_demand", 4)])
def test_remote_request_reserves_before_its_kv_enters(tiny, reservation, reserved):
    """Blocks before the fetch: prompt + max_tokens (full) or prompt + 1 (on demand: the
    first token's KV, computed by its first decode step)."""
    config = EngineConfig(max_num_seqs=1, max_model_len=64, max_num_batched_tokens=32,
                          kv_reservation=reservation)
    engine = Engine(tiny, config)
    a, b = (Request(rid, (5, 6, 7), SamplingParams(max_tokens=3)) for rid in "ab")
    engine.add_remote(a, 9)
    engine.add_remote(b, 9)
    assert engine.is_waiting_for_kv("a") and engine.is_waiting_for_kv("b")
    step = engine.step()
    assert list(step) == [] and list(step.kv_reserved) == ["a"]  # one slot: a only
    assert engine.scheduler.reserved_tokens == reserved and engine.step_records == []
    with pytest.raises(KeyError, match="not waiting for remote KV"):
        engine.finish_remote("b", torch.zeros(2, 2, 2, 3, 16))  # b has no slot yet
    wrong = torch.zeros(2, 2, 4, 3, 16)  # 4 KV heads instead of 2
    with pytest.raises(ValueError, match=r"expected shape \(2, 2, 2, 3, 16\)"):
        engine.finish_remote("a", wrong)
    engine.abort("a")  # cancelled while its KV was "in flight": slot free, b reserves next
    assert engine.scheduler.reserved_tokens == 0
    step = engine.step()
    assert list(step) == [] and list(step.kv_reserved) == ["b"]
    engine.finish_remote("b", torch.zeros(2, 2, 2, 3, 16))
    assert [o.index for o in engine.step()] == [1] and not engine.is_waiting_for_kv("b")
    engine.abort("b")
    assert engine.is_empty()


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    engine = Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32))
    for stop in (256, -1):
        with pytest.raises(ValueError, match=rf"stop_token_ids must be in \[0, 256\), got \[{stop}\]"):
            engine.add_request(Request("s", (5, 6), SamplingParams(stop_token_ids=(3, stop))))
    assert engine.is_empty()


def test_add_remote_rejects_nothing_to_decode(tiny):
    engine = Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32))
    with pytest.raises(ValueError, match="nothing to decode"):
        engine.add_remote(Request("y", (5, 6, 7), SamplingParams(max_tokens=1)), 9)
    with pytest.raises(ValueError, match=r"first_token must be in \[0, 256\)"):
        engine.add_remote(Request("z", (5, 6, 7), SamplingParams(max_tokens=4)), 256)
    assert engine.is_empty()


def test_bf16_matches_bf16_generate(references):
    loaded = load_model(ModelConfig("tiny-random-llama", dtype="bfloat16"))
    prompts, _ = references
    # prefix caching off: it changes which blocks a request gets (cached blocks are kept),
    # so the attention gathers differently and bf16 near-ties flip (4 of 6 here, not 5);
    # the caching layouts are checked exactly in fp32 (test_prefix_cache.py)
    engine = Engine(loaded, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
                                         enable_prefix_caching=False))
    outputs = engine.generate(make_requests(prompts[:6], max_tokens=8))
    agree = [outputs[f"r{i}"] == reference_generate(loaded.model, p, 8) for i, p in enumerate(prompts[:6])]
    # bf16 rounding differs between a batched and a single-sequence kernel order; demand
    # the first tokens match everywhere and full sequences match for most prompts.
    assert all(outputs[f"r{i}"][:1] == reference_generate(loaded.model, p, 1)
               for i, p in enumerate(prompts[:6]))
    assert sum(agree) >= 5, agree
    assert engine.kv_store.kv.dtype == torch.bfloat16


@pytest.mark.slow
def test_smollm2_greedy_matches_generate(smollm2):
    texts = ["What is 2+2?", "Write a haiku about the sea.", "hi",
             "Explain in one sentence why the KV cache makes decoding faster."]
    prompts = [smollm2.encode_chat(t) for t in texts]
    engine = Engine(smollm2, EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32))
    outputs = engine.generate(make_requests(prompts, max_tokens=16))
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference_generate(smollm2.model, p, 16)
    assert engine.is_empty()


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny, references):
    """Greedy with logprobs: the sampled token is the argmax, its logprob the max
    log-probability, the top-N sorted descending, all equal to ``torch.log_softmax`` of
    transformers' own forward logits at each position (raw logprobs)."""
    prompts, expected = references
    n = 5
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16))
    requests = make_requests(prompts[:4], logprobs=n) + [
        Request("plain", tuple(prompts[4]), SamplingParams(max_tokens=12))]
    for r in requests:
        engine.add_request(r)
    outs = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert all(o.logprob is None and o.top_logprobs == () for o in outs["plain"])
    for i in range(4):
        got = outs[f"r{i}"]
        assert [o.token_id for o in got] == expected[i]
        ids = torch.tensor([prompts[i] + expected[i]])
        with torch.inference_mode():
            logits = tiny.model(ids).logits[0, len(prompts[i]) - 1:-1].float()
        want = torch.log_softmax(logits, dim=-1)
        for pos, o in enumerate(got):
            top_vals, top_ids = want[pos].topk(n)
            assert o.token_id == int(want[pos].argmax())
            assert abs(o.logprob - float(want[pos].max())) < 1e-5
            assert abs(o.logprob - float(want[pos, o.token_id])) < 1e-5
            values = [v for _, v in o.top_logprobs]
            assert values == sorted(values, reverse=True) and len(values) == n
            assert o.top_logprobs[0][0] == o.token_id
            assert values == pytest.approx(top_vals.tolist(), abs=1e-5)
            assert [t for t, _ in o.top_logprobs] == top_ids.tolist()


def test_logprobs_zero_gives_the_token_logprob_only(tiny, references):
    prompts, _ = references
    engine = Engine(tiny, EngineConfig(max_model_len=64), quiet=True)
    engine.add_request(Request("z", tuple(prompts[0]), SamplingParams(max_tokens=3, logprobs=0,
                                                                      temperature=0.8, seed=1)))
    got = []
    while engine.has_unfinished():
        got.extend(engine.step())
    assert len(got) == 3 and all(o.logprob is not None and o.logprob <= 0 for o in got)
    assert all(o.top_logprobs == () for o in got)
