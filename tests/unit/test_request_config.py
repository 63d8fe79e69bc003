"""Request/config validation: every bad value raises ValueError naming the field and its range;
placement and device parsing; status ordering; Engine.validate against a tiny engine."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.kv_blocks import prompt_block_hashes
from engine.config import (EngineConfig, ModelConfig, PlacementConfig, TransferConfig,
                           cpu_cores_of, parse_devices, parse_placement,
                           placement_engine_overrides)
from engine.request import (FinishReason, Request, RequestState, RequestStatus,
                            SamplingParams)


def raises_naming(fn, *words):
    """Call ``fn``; it must raise ValueError whose message contains every one of ``words``."""
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"
    return message


# ---- SamplingParams ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    ({"max_tokens": 0}, ("max_tokens", ">= 1", "0")),
    ({"max_tokens": -3}, ("max_tokens", ">= 1", "-3")),
    ({"max_tokens": 2.0}, ("max_tokens", "integer")),
    ({"temperature": -1.0}, ("temperature", ">= 0", "-1")),
    ({"temperature": math.nan}, ("temperature", ">= 0", "nan")),
    ({"top_k": -2}, ("top_k", ">= -1", "-2")),  # -1 is vLLM's "off"
    ({"top_k": 1.5}, ("top_k", "integer")),
    ({"top_k": True}, ("top_k", "integer")),
    ({"top_p": 0.0}, ("top_p", "(0, 1]", "0.0")),
    ({"top_p": 1.5}, ("top_p", "(0, 1]", "1.5")),
    ({"top_p": -0.1}, ("top_p", "(0, 1]")),
    ({"top_p": math.nan}, ("top_p", "(0, 1]")),
    ({"logprobs": 21}, ("logprobs", "[0, 20]", "21")),
    ({"logprobs": -1}, ("logprobs", "[0, 20]", "-1")),
    ({"logprobs": 2.0}, ("logprobs", "integer")),
    ({"logprobs": True}, ("logprobs", "integer")),
    ({"min_p": -0.1}, ("min_p", "[0, 1]", "-0.1")),
    ({"min_p": 1.5}, ("min_p", "[0, 1]", "1.5")),
    ({"min_p": math.nan}, ("min_p", "[0, 1]")),
    ({"min_p": "0.1"}, ("min_p", "[0, 1]")),
    ({"min_tokens": -1}, ("min_tokens", "[0, max_tokens=16]", "-1")),
    ({"min_tokens": 17}, ("min_tokens", "[0, max_tokens=16]", "17")),
    ({"min_tokens": 2.0}, ("min_tokens", "integer")),
    ({"repetition_penalty": 0.0}, ("repetition_penalty", "> 0", "0.0")),
    ({"repetition_penalty": -1.0}, ("repetition_penalty", "> 0")),
    ({"repetition_penalty": math.inf}, ("repetition_penalty", "finite")),
    ({"repetition_penalty": math.nan}, ("repetition_penalty", "finite")),
    ({"presence_penalty": 2.5}, ("presence_penalty", "[-2, 2]", "2.5")),
    ({"presence_penalty": -2.01}, ("presence_penalty", "[-2, 2]")),
    ({"frequency_penalty": math.nan}, ("frequency_penalty", "[-2, 2]")),
    ({"frequency_penalty": True}, ("frequency_penalty", "[-2, 2]")),
])
def test_sampling_params_rejects_out_of_range(kwargs, words):
    raises_naming(lambda: SamplingParams(**kwargs), *words)


def test_sampling_params_accepts_edges_and_normalizes_stop_tokens():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[5, 7])
    assert p.is_greedy
    assert p.stop_token_ids == (5, 7) and isinstance(p.stop_token_ids, tuple)
    q = SamplingParams(temperature=0.5, top_p=1e-6, top_k=1)
    assert not q.is_greedy and q.top_p == 1e-6
    assert SamplingParams().logprobs is None
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20


def test_sampling_params_extensions_edges_and_defaults():
    """vLLM's extension fields: defaults are off; -1 top_k is 0; the edges of
    each range are accepted; has_penalties says when the sampler needs the history."""
    default = SamplingParams()
    assert (default.min_p, default.min_tokens, default.repetition_penalty,
            default.presence_penalty, default.frequency_penalty) == (0.0, 0, 1.0, 0.0, 0.0)
    assert not default.has_penalties
    assert SamplingParams(top_k=-1).top_k == 0
    edges = SamplingParams(max_tokens=4, min_tokens=4, min_p=1.0, repetition_penalty=1e-3,
                           presence_penalty=-2.0, frequency_penalty=2)
    assert edges.min_tokens == 4 and edges.min_p == 1.0 and edges.has_penalties
    assert SamplingParams(min_p=0, min_tokens=0).min_p == 0
    for kwargs in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
                   {"frequency_penalty": -0.1}):
        assert SamplingParams(**kwargs).has_penalties
    assert not SamplingParams(min_tokens=3, min_p=0.2).has_penalties  # no history needed


# ---- Request -------------------------------------------------------------------------------

def test_request_rejects_empty_prompt():
    raises_naming(lambda: Request("r0", ()), "r0", "prompt_token_ids", "must not be empty")


@pytest.mark.parametrize("prompt", [(1, -1, 3), (-5,), (1, 2.0, 3), (1, "2")])
def test_request_rejects_negative_or_non_integer_token_ids(prompt):
    raises_naming(lambda: Request("r1", prompt), "r1", "prompt_token_ids", "non-negative integers")


def test_arrived_at_changes_only_the_arrival_and_keeps_the_cached_block_hashes():
    request = Request("r1", (3, 1, 4, 1, 5), SamplingParams(max_tokens=7))
    hashes = prompt_block_hashes(request, 2)
    arrived = request.arrived_at(12.5)
    assert arrived == dataclasses.replace(request, arrival_time_s=12.5)
    assert request.arrival_time_s == 0.0
    assert prompt_block_hashes(arrived, 2) is hashes


def test_request_normalizes_prompt_to_tuple_and_counts():
    r = Request("r", [4, 5, 6], SamplingParams(max_tokens=3))
    assert r.prompt_token_ids == (4, 5, 6) and r.num_prompt_tokens == 3
    state = RequestState(r)
    assert state.status == RequestStatus.WAITING and state.num_computed_tokens == 0
    assert state.max_total_tokens == 6 and state.is_prefilling and state.output_token_ids == []


# ---- EngineConfig / TransferConfig / ModelConfig --------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    ({"max_num_seqs": 0}, ("max_num_seqs", ">= 1", "0")),
    ({"max_model_len": 1}, ("max_model_len", ">= 2", "1")),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4},
     ("max_num_batched_tokens", ">= max_num_seqs", "(8)", "got 4")),
    ({"kv_capacity_tokens": 1}, ("kv_capacity_tokens", ">= 2", "1")),
    ({"block_size": 0}, ("block_size", ">= 1", "0")),
    ({"kv_cache_memory_gb": 0.0}, ("kv_cache_memory_gb", "> 0", "0.0")),
    ({"gpu_memory_utilization": 0.0}, ("gpu_memory_utilization", "> 0", "0.0")),
    ({"gpu_memory_utilization": 1.5}, ("gpu_memory_utilization", "<= 1", "1.5")),
    ({"device": "gpu"}, ("device", "'cpu' or 'cuda[:i]'", "'gpu'")),
    ({"device": "cuda:x"}, ("device", "'cuda:x'")),
    ({"device": "cpu:0"}, ("device", "'cpu:0'")),  # an engine device is cpu/cuda, not a core group
])
def test_engine_config_rejects(kwargs, words):
    raises_naming(lambda: EngineConfig(**kwargs), *words)


def test_engine_config_accepts_and_derives_capacity():
    assert EngineConfig(max_num_seqs=4, max_model_len=32).total_kv_capacity_tokens == 128
    # whole blocks: 4 requests of ceil(33 / 16) = 3 blocks; a token cap rounds up to blocks
    assert EngineConfig(max_num_seqs=4, max_model_len=33).max_kv_blocks == 12
    assert EngineConfig(kv_capacity_tokens=50).total_kv_capacity_tokens == 64
    assert EngineConfig(kv_capacity_tokens=50, block_size=5).max_kv_blocks == 10
    default = EngineConfig()  # the field's defaults (vLLM's)
    assert (default.max_num_seqs, default.block_size,
            default.max_num_batched_tokens) == (256, 16, 512)
    for device in ("cpu", "cuda", "cuda:3"):
        assert EngineConfig(device=device).device == device
    assert EngineConfig(max_num_seqs=4, max_num_batched_tokens=4).max_num_batched_tokens == 4


@pytest.mark.parametrize("kwargs,words", [
    ({"transport": "tcp"}, ("transport", "inprocess", "ray", "torchdist", "'tcp'")),
    ({"granularity": "token"}, ("granularity", "request", "layer", "'token'")),
    ({"layers_per_chunk": 0}, ("layers_per_chunk", ">= 1", "0")),
    ({"timeout_s": 0}, ("timeout_s", "> 0", "0")),
    ({"timeout_s": -1.0}, ("timeout_s", "> 0")),
])
def test_transfer_config_rejects(kwargs, words):
    raises_naming(lambda: TransferConfig(**kwargs), *words)


@pytest.mark.parametrize("kwargs,words", [
    ({"dtype": "float64"}, ("dtype", "float32", "bfloat16", "float16", "'float64'")),
    ({"dtype": "fp32"}, ("dtype", "'fp32'")),
    ({"model": ""}, ("model", "must not be empty")),
])
def test_model_config_rejects(kwargs, words):
    raises_naming(lambda: ModelConfig(**kwargs), *words)


# ---- placement and devices -------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("colocated:2", ("colocated", 2, 0)),
    ("colocated:1", ("colocated", 1, 0)),
    ("disagg:2p1d", ("disagg", 2, 1)),
    ("disagg:1p3d", ("disagg", 1, 3)),
    ("DISAGG:2P1D", ("disagg", 2, 1)),
    ("Colocated:4", ("colocated", 4, 0)),
    ("  disagg:10p12d ", ("disagg", 10, 12)),
    ("colocated-nochunk:2", ("colocated", 2, 0)),
])
def test_parse_placement_good(text, expected):
    assert parse_placement(text) == expected


def test_nochunk_placement_turns_chunking_off_and_fits_any_prompt():
    engine = EngineConfig(max_model_len=1024, max_num_batched_tokens=256)
    nochunk = placement_engine_overrides("colocated-nochunk:2", engine)
    assert nochunk.enable_chunked_prefill is False and nochunk.max_num_batched_tokens == 1024
    assert placement_engine_overrides("colocated:2", engine) is engine
    assert placement_engine_overrides("disagg:1p1d", engine) is engine


@pytest.mark.parametrize("text,words", [
    ("disagg:0p1d", ("x, y >= 1", "disagg:0p1d")),
    ("disagg:1p0d", ("x, y >= 1",)),
    ("colocated:0", ("N >= 1",)),
    ("colocated:", ("colocated:N", "disagg:xPyD", "'colocated:'")),
    ("foo", ("colocated:N", "disagg:xPyD", "'foo'")),
    ("disagg:2p", ("disagg:xPyD",)),
    ("colocated:-1", ("colocated:N",)),
    ("", ("colocated:N",)),
])
def test_parse_placement_bad(text, words):
    raises_naming(lambda: parse_placement(text), *words)


def test_placement_config_counts_devices_and_validates():
    assert PlacementConfig("disagg:2p1d").num_devices_needed == 3
    assert PlacementConfig("colocated:2").num_devices_needed == 2
    assert PlacementConfig("colocated:2").kind == "colocated"
    raises_naming(lambda: PlacementConfig("disagg:0p1d"), "x, y >= 1")
    raises_naming(lambda: PlacementConfig("colocated:1", devices="cpu:0,cpu:0"), "repeat")


def test_parse_devices_good():
    assert parse_devices("cpu:0,cpu:1") == ("cpu:0", "cpu:1")
    assert parse_devices(" cuda:0 , cuda:1 ") == ("cuda:0", "cuda:1")
    assert parse_devices("cpu:0-3") == ("cpu:0-3",)
    assert parse_devices("cpu:0-1,cpu:2-3") == ("cpu:0-1", "cpu:2-3")
    # overlapping core groups are allowed on purpose (tests share 2 cores this way)
    assert parse_devices("cpu:0,cpu:1,cpu:0-1") == ("cpu:0", "cpu:1", "cpu:0-1")
    default = parse_devices(None)
    assert len(default) >= 1 and all(d.startswith(("cpu:", "cuda:")) for d in default)


@pytest.mark.parametrize("text,words", [
    ("cpu:0,cpu:0", ("must not repeat",)),
    ("cuda:1,cuda:1", ("must not repeat",)),
    ("cpu:0,cuda:0", ("must not mix cpu and cuda",)),
    ("gpu:0", ("'cuda:0' or 'cpu:0' or 'cpu:0-3'", "'gpu:0'")),
    ("cpu", ("'cpu'",)),
    ("cuda:0-1", ("'cuda:0-1'",)),
    (",", ("at least one device",)),
])
def test_parse_devices_bad(text, words):
    raises_naming(lambda: parse_devices(text), *words)


def test_parse_devices_rejects_reversed_core_group():
    with pytest.raises(ValueError, match="low-high"):
        parse_devices("cpu:3-1")


def test_cpu_cores_of():
    assert cpu_cores_of("cpu:2") == [2]
    assert cpu_cores_of("cpu:0-3") == [0, 1, 2, 3]
    assert cpu_cores_of("cpu:5-5") == [5]


# ---- status ordering ---------------------------------------------------------------------------

def test_request_status_order_and_is_finished():
    order = [RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING,
             RequestStatus.PREFILLED,
             RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR]
    assert sorted(RequestStatus) == order
    assert list(RequestStatus) == order
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {s for s in RequestStatus if s.name.startswith("FINISHED_")}
    assert not RequestStatus.PREFILLED.is_finished
    for status in RequestStatus:
        assert status.is_finished == (status >= RequestStatus.FINISHED_STOPPED)


def test_finish_reason_of_status():
    state = RequestState(Request("r", (1, 2)))
    expected = {RequestStatus.WAITING: None, RequestStatus.RUNNING: None,
                RequestStatus.PREFILLED: None,
                RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
                RequestStatus.FINISHED_ERROR: FinishReason.ERROR}
    for status, reason in expected.items():
        state.status = status
        assert state.finish_reason == reason
    assert FinishReason.STOP.value == "stop" and FinishReason.LENGTH.value == "length"


# ---- Engine.validate (tiny model) ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny):
    from engine.engine import Engine

    return Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=32, max_num_batched_tokens=16,
                                     enable_chunked_prefill=False))


def test_engine_validate_rejects_then_still_serves(tiny, tiny_engine):
    from conftest import random_prompts, reference_generate

    engine = tiny_engine
    assert engine.max_model_len == 32 and engine.vocab_size == 256
    # prompt + max_tokens beyond max_model_len
    raises_naming(lambda: engine.add_request(Request("long", (5,) * 10,
                                                     SamplingParams(max_tokens=23))),
                  "long", "10", "23", "33", "max_model_len", "32")
    # token id >= vocab
    raises_naming(lambda: engine.add_request(Request("vocab", (5, 256, 7))),
                  "vocab", "prompt_token_ids", "[0, 256)", "256")
    # chunked prefill off and a prompt larger than the budget
    raises_naming(lambda: engine.add_request(Request("big", (5,) * 20,
                                                     SamplingParams(max_tokens=4))),
                  "big", "20", "max_num_batched_tokens=16", "chunked prefill")
    assert engine.is_empty() and not engine.has_unfinished()
    # an exact fit is accepted: 10 + 22 == 32
    engine.validate(Request("fits", (5,) * 10, SamplingParams(max_tokens=22)))

    prompt = random_prompts([9], seed=3)[0]
    outputs = engine.generate([Request("ok", tuple(prompt), SamplingParams(max_tokens=8))])
    assert outputs["ok"] == reference_generate(tiny.model, prompt, 8)
    assert len(outputs["ok"]) >= 1
    assert engine.is_empty()


def test_engine_validate_rejects_duplicate_id_and_kv_capacity(tiny):
    from engine.engine import Engine

    engine = Engine(tiny, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16,
                                       kv_capacity_tokens=20))  # 2 blocks of 16 tokens
    raises_naming(lambda: engine.add_request(Request("cap", (5,) * 10,
                                                     SamplingParams(max_tokens=23))),
                  "cap", "33 KV tokens", "(3 blocks of 16)", "2 blocks = 32 tokens",
                  "kv_capacity_tokens")
    assert engine.is_empty()  # refused whole: nothing queued, no block held
    engine.validate(Request("fits", (5,) * 10, SamplingParams(max_tokens=22)))  # 32 tokens
    engine.add_request(Request("dup", (5, 6), SamplingParams(max_tokens=2)))
    raises_naming(lambda: engine.add_request(Request("dup", (5, 6))), "request_id", "'dup'")
    tokens = []
    while engine.has_unfinished():
        tokens += [out.token_id for out in engine.step() if out.request_id == "dup"]
    assert 1 <= len(tokens) <= 2
    assert engine.is_empty()
