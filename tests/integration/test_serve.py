"""``pdlab serve`` over in-process placements of the tiny model (``ByteText``: one token per
UTF-8 byte), reached over real HTTP on a loopback port.

- The official ``openai`` client, streaming and not: greedy text equal to transformers
  ``generate()``'s tokens decoded, exact usage, one chunk per token, the usage chunk last.
- Stop strings across tokens, stop_token_ids, n, chat template.
- Logprobs (completions and chat, streamed and not): one entry per completion token, the
  first included in disagg:1p1d, equal to a bare engine's.
- Every bad input of the issue gets its status and the field named, and the next request
  is still served with the exact greedy output.
- A client that disconnects mid-stream has its request aborted and its KV freed on every
  worker.
- 200 concurrent streaming clients: exact usage and tokens, engines and transports empty.
- /metrics counts what was served; /health and /v1/models answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import openai
import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import assert_clean

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from deployment.placement import Deployment
from server.app import OpenAIServer, ServerThread
from server.text import ByteText

pytestmark = pytest.mark.workers
TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=64)
BYTES = ByteText()
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # 2 (K, V) * layers * kv_heads * head_dim * fp32


@contextlib.contextmanager
def served(placement: str, faults: dict | None = None, engine: EngineConfig = ENGINE):
    """(base url, deployment) of ``placement`` served on a free loopback port."""
    with Deployment(PlacementConfig(placement, "cpu:0,cpu:1"), TINY, engine,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                    faults=faults) as dep:
        server = ServerThread(OpenAIServer(dep.router, BYTES, "tiny").app).start()
        try:
            yield server.url, dep
        finally:
            server.stop()


@pytest.fixture(scope="module", params=["colocated:1", "disagg:1p1d"])
def server(request):
    with served(request.param) as (url, dep):
        yield url, dep


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def greedy(tiny, prompt: list[int], max_tokens: int) -> list[int]:
    return reference_generate(tiny.model, prompt, max_tokens)


def assert_next_request_exact(url: str, tiny) -> None:
    """The server still serves a request with the exact greedy output."""
    prompt = random_prompts([9], seed=11)[0]
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == BYTES.decode(greedy(tiny, prompt, 6))


def wait_clean(dep, timeout_s: float) -> None:
    """Wait until every worker is empty (engine, transport) and the router holds nothing;
    fails after ``timeout_s`` (a hang guard)."""
    start_s = time.monotonic()
    while True:
        statuses = dep.statuses()
        clean = all(s["engine_empty"] and s.get("transport_held", 0) == 0
                    and s.get("transfers_held", 0) == 0 for s in statuses)
        if clean and dep.router.num_running + dep.router.num_waiting == 0:
            return
        assert time.monotonic() - start_s < timeout_s, statuses
        time.sleep(0.02)


def watch_finishes(router, monkeypatch) -> list:
    """The router's ``finish`` events of the requests submitted from now on, as their sinks
    get them."""
    finishes, submit = [], router.submit

    def tee(request, sink):
        def both(event):
            if event.kind == "finish":
                finishes.append(event)
            sink(event)
        return submit(request, both)

    monkeypatch.setattr(router, "submit", tee)
    return finishes


# ---- the openai client --------------------------------------------------------------------

def test_openai_client_completions_equal_generate(server, client, tiny):
    prompt = random_prompts([7], seed=1)[0]
    expected = greedy(tiny, prompt, 8)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert reply.choices[0].text == BYTES.decode(expected)
    assert reply.choices[0].finish_reason == ("length" if len(expected) == 8 else "stop")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (7, len(expected))
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == len(expected)  # one chunk per output token
    assert "".join(c.choices[0].text for c in token_chunks) == BYTES.decode(expected)
    assert token_chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.total_tokens == 7 + len(expected)


def test_text_prompt_and_chat_template_go_through_the_tokenizer(server, client, tiny):
    text = "hello, world"
    expected = greedy(tiny, BYTES.encode(text), 5)
    reply = client.completions.create(model="tiny", prompt=text, max_tokens=5, temperature=0)
    assert reply.choices[0].text == BYTES.decode(expected)
    assert reply.usage.prompt_tokens == len(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat_prompt = BYTES.encode_chat(messages)
    expected = greedy(tiny, chat_prompt, 5)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                           temperature=0)
    assert reply.choices[0].message.content == BYTES.decode(expected)
    assert reply.usage.prompt_tokens == len(chat_prompt)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                            temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == BYTES.decode(expected)


def _stop_case(tiny):
    """A prompt whose greedy output has two ASCII tokens in a row after the first: the stop
    string they form spans a token boundary."""
    for seed in range(50):
        prompt = random_prompts([6], seed=100 + seed)[0]
        out = greedy(tiny, prompt, 12)
        for i in range(1, len(out) - 1):
            if 32 <= out[i] < 127 and 32 <= out[i + 1] < 127:
                return prompt, out, chr(out[i]) + chr(out[i + 1])
    pytest.fail("no greedy output with two printable ASCII tokens in a row")


def test_stop_string_across_tokens_ends_text_and_usage_at_it(server, client, tiny):
    url, dep = server
    prompt, out, stop = _stop_case(tiny)
    # oracle: the first prefix of the output whose text contains the stop string
    k = next(k for k in range(1, len(out) + 1) if stop in BYTES.decode(out[:k]))
    text = BYTES.decode(out[:k])
    expected_text = text[:text.find(stop)]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      stop=[stop, "\x00never"])
    assert reply.choices[0].text == expected_text
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == k
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0, stop=stop, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text
    assert chunks[-1].usage.completion_tokens == k
    wait_clean(dep, 5.0)  # the stopped request was aborted: nothing left anywhere


def test_stop_token_ids_and_n(server, client, tiny):
    prompt = random_prompts([5], seed=4)[0]
    out = greedy(tiny, prompt, 10)
    stop_id = out[3]
    first = out.index(stop_id)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == first + 1  # the stop token is kept, as vLLM
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                      n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.text == BYTES.decode(out) for c in reply.choices)
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 3 * len(out)
    # seeded sampling: choice i is the single request with seed + i
    many = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0,
                                     seed=7, n=2)
    for i in range(2):
        one = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                        temperature=1.0, seed=7 + i)
        assert many.choices[i].text == one.choices[0].text


def test_models_health_and_metrics_count_what_was_served(tiny):
    with served("disagg:1p1d") as (url, dep):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{url}/health").status_code == 200
        prompts = random_prompts([4, 9, 13], seed=5)
        usage = [httpx.post(f"{url}/v1/completions", timeout=30, json={
            "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json()["usage"]
                 for p in prompts]
        text = httpx.get(f"{url}/metrics").text
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        model = '{model_name="tiny"}'
        assert values[f"pdlab:prompt_tokens_total{model}"] == sum(u["prompt_tokens"] for u in usage) == 26
        assert values[f"pdlab:generation_tokens_total{model}"] == 12
        assert values[f"pdlab:time_to_first_token_seconds_count{model}"] == 3
        assert values[f"pdlab:inter_token_latency_seconds_count{model}"] == 3 * 3
        pair = '{decode_worker="decode-0",prefill_worker="prefill-0"}'
        assert values[f"pdlab:kv_transfer_bytes_count{pair}"] == 3
        assert values[f"pdlab:kv_transfer_bytes_sum{pair}"] == 26 * KV_BYTES_PER_TOKEN
        assert values[f"pdlab:kv_transfer_seconds_count{pair}"] == 3
        assert values['pdlab:worker_info{role="prefill",worker="prefill-0"}'] == 1
        assert values['pdlab:worker_info{role="decode",worker="decode-0"}'] == 1
        assert values[f"pdlab:num_requests_running{model}"] == 0
        assert values['pdlab:request_success_total{finished_reason="length",model_name="tiny"}'] == 3
        assert values[f"pdlab:prefix_cache_queries_total{model}"] == 26
        assert values[f"pdlab:prefix_cache_hits_total{model}"] == 0  # no full block in common
        long = random_prompts([40], seed=6)[0]
        for _ in range(2):  # the second finds the first's 2 full blocks in the prefill cache
            httpx.post(f"{url}/v1/completions", timeout=30, json={
                "prompt": long, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        text = httpx.get(f"{url}/metrics").text
        values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        assert values[f"pdlab:prefix_cache_queries_total{model}"] == 26 + 2 * 40
        assert values[f"pdlab:prefix_cache_hits_total{model}"] == 32


# ---- bad input --------------------------------------------------------------------------

BIG = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
BAD = [  # (name, body bytes, status, param)
    ("malformed JSON", b'{"prompt": [1, 2', 400, None),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, None),
    ("10 MB body", BIG, 413, None),
    ("unknown field", {"prompt": [5, 6], "max_tokenz": 3}, 400, "max_tokenz"),
    ("max_tokens a string", {"prompt": [5, 6], "max_tokens": "3"}, 400, "max_tokens"),
    ("prompt a number", {"prompt": 5}, 400, "prompt"),
    ("stream a string", {"prompt": [5], "stream": "yes"}, 400, "stream"),
    ("temperature < 0", {"prompt": [5], "temperature": -1}, 400, "temperature"),
    ("top_p = 0", {"prompt": [5], "top_p": 0}, 400, "top_p"),
    ("max_tokens = 0", {"prompt": [5], "max_tokens": 0}, 400, "max_tokens"),
    ("n = 0", {"prompt": [5], "n": 0}, 400, "n"),
    ("prompt over the context", {"prompt": [5] * 200}, 400, "prompt"),
    ("prompt + max_tokens over the context", {"prompt": [5] * 100, "max_tokens": 50}, 400,
     "max_tokens"),
    ("empty prompt", {"prompt": ""}, 400, "prompt"),
    ("empty token list", {"prompt": []}, 400, "prompt"),
    ("token outside the vocabulary", {"prompt": [5, 999]}, 400, "prompt"),
    ("stop_token_ids outside the vocabulary", {"prompt": [5], "stop_token_ids": [999]}, 400,
     "stop_token_ids"),
    ("logprobs over 20", {"prompt": [5], "logprobs": 21}, 400, "logprobs"),
    ("logprobs < 0", {"prompt": [5], "logprobs": -1}, 400, "logprobs"),
    ("unknown model", {"prompt": [5], "model": "gpt-9"}, 404, "model"),
]
CHAT_BAD = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("content a number", {"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}],
                                       "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("endpoint,name,body,status,param",
                         [("completions", *row) for row in BAD]
                         + [("chat/completions", *row) for row in CHAT_BAD],
                         ids=[row[0] for row in BAD + CHAT_BAD])
def test_bad_input_is_refused_naming_the_field_and_hurts_nobody(server, tiny, endpoint, name,
                                                               body, status, param):
    url, dep = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(f"{url}/v1/{endpoint}", content=content, timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"], error
    if param is not None:
        assert param.split(".")[0] in error["message"] or param == "model", error
    assert_next_request_exact(url, tiny)
    assert_clean(dep)


def test_wrong_method_and_unknown_path_get_openai_error_objects(server, tiny):
    url, dep = server
    for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/nope", 404)):
        reply = httpx.request(method, f"{url}{path}", timeout=30)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["code"] == status and path in error["message"] and error["param"] is None
    assert_next_request_exact(url, tiny)


@pytest.mark.parametrize("placement", ["colocated:1", "disagg:1p1d"])
def test_request_over_the_kv_cache_is_refused_before_prefill(placement, tiny):
    """KV caches of 48 tokens (3 blocks) under a 128-token context: prompt + max_tokens over
    48 gets 400 naming max_tokens (a prompt over it alone: naming the prompt) and runs no
    prefill; chat's default max_tokens fits what the KV cache holds; the next request is
    exact."""
    small = EngineConfig(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=64,
                         kv_capacity_tokens=48)
    with served(placement, engine=small) as (url, dep):
        for body, param in (({"prompt": [5] * 20, "max_tokens": 40}, "max_tokens"),
                            ({"prompt": [5] * 60, "max_tokens": 1}, "prompt")):
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param and "whole KV cache (48 tokens;" in error["message"]
        assert dep.step_records() == []  # refused before any worker ran a step
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 48, usage
        assert_next_request_exact(url, tiny)
        assert_clean(dep)


def test_a_metrics_fault_is_logged_and_the_answer_still_exact(tiny, monkeypatch, caplog):
    """/metrics' observe raising on the router's thread: the answer comes back exact and the
    fault is logged with the request's id (it used to vanish with the router's sink)."""
    with Deployment(PlacementConfig("colocated:1", "cpu:0"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as dep:
        openai_server = OpenAIServer(dep.router, BYTES, "tiny")

        def broken(record):
            raise RuntimeError("metrics backend down")

        monkeypatch.setattr(openai_server.metrics, "observe", broken)
        server = ServerThread(openai_server.app).start()
        try:
            with caplog.at_level("ERROR", logger="server.app"):
                assert_next_request_exact(server.url, tiny)
        finally:
            server.stop()
    faults = [r for r in caplog.records if "metrics of request cmpl-" in r.getMessage()]
    assert len(faults) == 1 and "metrics backend down" in faults[0].exc_text


# ---- logprobs ---------------------------------------------------------------------------

def _engine_logprobs(tiny, prompt: list[int], max_tokens: int, n: int) -> list[tuple]:
    """(token, logprob, top) per output token of a greedy request on a bare engine."""
    from engine.engine import Engine
    from engine.request import Request, SamplingParams
    engine = Engine(tiny, EngineConfig(max_model_len=128), quiet=True)
    engine.add_request(Request("x", tuple(prompt), SamplingParams(max_tokens=max_tokens,
                                                                 logprobs=n)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return [(o.token_id, o.logprob, o.top_logprobs) for o in outs]


def test_logprobs_completions_and_chat_equal_the_engine(server, client, tiny):
    """Every token, the first included (sampled on the prefill worker in disagg:1p1d), has
    its logprob; greedy: it is the max of its top list; values equal a bare engine's."""
    prompt, n = random_prompts([7], seed=3)[0], 3
    want = _engine_logprobs(tiny, prompt, 6, n)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=n)
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == reply.usage.completion_tokens == len(want)
    assert lp.tokens == [BYTES.decode([t]) for t, _, _ in want]
    assert lp.text_offset == list(range(len(want)))  # one character per byte token
    for got, top, (_, value, want_top) in zip(lp.token_logprobs, lp.top_logprobs, want):
        assert len(top) <= n and got == pytest.approx(max(top.values()), abs=1e-6)
        assert got == pytest.approx(value, abs=1e-5)
        want_dict = {}  # byte tokens >= 128 all read U+FFFD: the most likely one's value
        for t, v in want_top:
            want_dict.setdefault(BYTES.decode([t]), v)
        assert top == pytest.approx(want_dict, abs=1e-5)
    chunks = [c for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                                   temperature=0, logprobs=n, stream=True)
              if c.choices]
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx([v for _, v, _ in want], abs=1e-5)

    messages = [{"role": "user", "content": "hi"}]
    want = _engine_logprobs(tiny, BYTES.encode_chat(messages), 5, n)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=n)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(want)
    for entry, (token, value, want_top) in zip(content, want):
        assert entry.bytes == [token] and entry.logprob == pytest.approx(value, abs=1e-5)
        assert [t.bytes[0] if t.bytes else None for t in entry.top_logprobs] == \
            [t if t < 256 else None for t, _ in want_top]
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in want_top], abs=1e-5)
    chunks = [c for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=n, stream=True) if c.choices and c.choices[0].logprobs]
    streamed = [e.logprob for c in chunks for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([v for _, v, _ in want], abs=1e-5)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


# ---- disconnects ------------------------------------------------------------------------

@pytest.mark.parametrize("placement,slow", [("colocated:1", "colocated-0"),
                                            ("disagg:1p1d", "decode-0")])
def test_client_disconnect_mid_stream_aborts_and_frees_kv_on_every_worker(
        tiny, placement, slow, monkeypatch):
    # 20 ms per step: the 100 tokens asked for take >= 2 s, so the request is still running
    # when the client goes
    with served(placement, faults={slow: {"step_delay_s": 0.02}}) as (url, dep):
        finishes = watch_finishes(dep.router, monkeypatch)
        body = {"prompt": random_prompts([12], seed=2)[0], "max_tokens": 100,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                chunks = [next(lines) for _ in range(6)]  # a few tokens (blank lines between)
                assert sum(c.startswith("data:") for c in chunks) >= 3
                busy = [s for s in dep.statuses() if not s["engine_empty"]]
                assert busy, "the request should still be running"
        wait_clean(dep, timeout_s=30.0)
        assert_aborted(finishes)
        assert_next_request_exact(url, tiny)


def assert_aborted(finishes: list) -> None:
    """One request, ended by the abort of a client gone (not by its 100 tokens)."""
    [finish] = finishes
    assert finish.finish_reason == "abort", finish
    assert len(finish.record.output_token_ids) < 100


def test_client_gone_while_waiting_for_a_whole_answer_aborts_and_frees_its_kv(tiny, monkeypatch):
    with served("disagg:1p1d", faults={"decode-0": {"step_delay_s": 0.02}}) as (url, dep):
        finishes = watch_finishes(dep.router, monkeypatch)
        body = {"prompt": random_prompts([12], seed=2)[0], "max_tokens": 100, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        wait_clean(dep, timeout_s=30.0)
        assert_aborted(finishes)
        assert_next_request_exact(url, tiny)


# ---- load -------------------------------------------------------------------------------

def test_200_concurrent_streaming_clients_get_exact_tokens_and_usage(tiny):
    prompts = random_prompts([3 + i % 13 for i in range(16)], seed=31)
    expected = [BYTES.decode(greedy(tiny, p, 4)) for p in prompts]  # ignore_eos: 4 tokens each
    engine = EngineConfig(max_num_seqs=32, max_model_len=64, max_num_batched_tokens=128)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int]:
        stream = await client.completions.create(
            model="tiny", prompt=prompts[i % 16], max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage.prompt_tokens, usage.completion_tokens

    async def all_clients(url: str):
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", http_client=http,
                                        max_retries=0)
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    with served("disagg:1p1d", engine=engine) as (url, dep):
        results = asyncio.run(all_clients(url))
        for i, (text, prompt_tokens, completion_tokens) in enumerate(results):
            assert text == expected[i % 16], i
            assert (prompt_tokens, completion_tokens) == (len(prompts[i % 16]), 4), i
        wait_clean(dep, timeout_s=5.0)


# ---- vLLM's fields, served -------------------------------------------------------------------

def _engine_tokens(tiny, prompt: list[int], sampling) -> list[int]:
    """The tokens of one request on a bare engine (the oracle of the HTTP fields)."""
    from engine.engine import Engine
    from engine.request import Request
    engine = Engine(tiny, EngineConfig(max_model_len=128), quiet=True)
    engine.add_request(Request("x", tuple(prompt), sampling))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return [o.token_id for o in outs]


def test_vllm_sampling_fields_reach_the_sampler(server, client, tiny):
    """repetition / presence / frequency penalties, min_p, top_k -1, min_tokens and a seed
    through the OpenAI client's extra_body give a bare engine's tokens for the same
    SamplingParams (and differ from plain greedy, so the fields were not dropped)."""
    from engine.request import SamplingParams
    prompt = random_prompts([6], seed=21)[0]
    fields = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "frequency_penalty": 1.0,
              "min_p": 0.05, "top_k": -1, "min_tokens": 12}
    want = _engine_tokens(tiny, prompt, SamplingParams(max_tokens=12, temperature=0.0, **fields))
    assert want != greedy(tiny, prompt, 12)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      presence_penalty=1.5, frequency_penalty=1.0,
                                      extra_body={k: v for k, v in fields.items()
                                                  if "presence" not in k and "frequency" not in k})
    assert reply.choices[0].text == BYTES.decode(want) and reply.usage.completion_tokens == 12
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5,
                            **fields | {"min_tokens": 2})
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 5,
            **fields, "min_tokens": 2}
    reply = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=30)
    assert reply.json()["choices"][0]["text"] == BYTES.decode(_engine_tokens(tiny, prompt, seeded))


def test_null_fields_content_parts_and_prompt_lists(server, client, tiny):
    """null for every optional field is its default; chat content as text parts is the
    text joined by newlines; a prompt list of strings (genai-perf) or of token lists gives
    one choice set per prompt, numbered prompt * n + i, usage summing the prompts."""
    url, dep = server
    prompt = random_prompts([5], seed=8)[0]
    nulls = {k: None for k in ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                               "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
                               "presence_penalty", "frequency_penalty", "skip_special_tokens",
                               "include_stop_str_in_output", "n", "best_of", "stream",
                               "stream_options", "user", "logit_bias", "logprobs", "echo",
                               "suffix")}
    reply = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": prompt, "max_tokens": 5, **nulls, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == BYTES.decode(greedy(tiny, prompt, 5))
    parts = [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]
    joined = BYTES.encode_chat([{"role": "user", "content": "be\nbrief"}])
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": parts, "name": None}], "max_completion_tokens": 4,
        "temperature": 0, "logprobs": None, "top_logprobs": None, "tools": None, "best_of": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == BYTES.decode(greedy(tiny, joined, 4))
    assert reply.json()["usage"]["prompt_tokens"] == len(joined)
    other = random_prompts([3], seed=9)[0]
    reply = client.completions.create(model="tiny", prompt=[prompt, other], max_tokens=4,
                                      temperature=0, n=2)
    texts = [BYTES.decode(greedy(tiny, p, 4)) for p in (prompt, other)]
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, texts[0]), (1, texts[0]), (2, texts[1]), (3, texts[1])]
    assert reply.usage.prompt_tokens == 8
    reply = client.completions.create(model="tiny", prompt=["hi", "yo"], max_tokens=3,
                                      temperature=0)
    assert [c.text for c in reply.choices] == [BYTES.decode(greedy(tiny, BYTES.encode(t), 3))
                                               for t in ("hi", "yo")]


def test_include_stop_str_in_output_and_continuous_usage(server, client, tiny):
    """include_stop_str_in_output: the text ends right after the stop string; GuideLLM's
    stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    url, dep = server
    prompt, out, stop = _stop_case(tiny)
    k = next(k for k in range(1, len(out) + 1) if stop in BYTES.decode(out[:k]))
    text = BYTES.decode(out[:k])
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      stop=stop, extra_body={"include_stop_str_in_output": True})
    assert reply.choices[0].text == text[:text.find(stop) + len(stop)]
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    tokens = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in tokens] == [1, 2, 3, 4, 5]
    assert all(c.usage.prompt_tokens == len(prompt) for c in tokens)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    wait_clean(dep, 5.0)


# ---- bad input on one keep-alive connection -------------------------------------------------

KEEPALIVE_BAD = [  # (endpoint, body, param, words of the message)
    ("completions", {"prompt": [5, -1, 7]}, "prompt", "prompt token ids must be >= 0, got -1"),
    ("completions", {"prompt": [5, 999]}, "prompt", "[0, 256), got [999]"),
    ("completions", {"prompt": []}, "prompt", "must not be empty"),
    ("completions", {"prompt": [[5], []]}, "prompt", "must not be empty"),
    ("completions", {"prompt": [True, 5]}, "prompt", "must be integers"),
    ("completions", {"prompt": [5] * 200_000}, "prompt", "exceeds the context length 128"),
    ("completions", {"prompt": ["a"] * 17}, "prompt", "at most 16 prompts"),
    ("completions", {"prompt": [5], "stop": ["x"] * 1000}, "stop", "at most 16 strings, got 1000"),
    ("completions", {"prompt": [5], "stop": [""]}, "stop", "must not be empty"),
    ("completions", {"prompt": [5], "stop_token_ids": [-3]}, "stop_token_ids",
     "greater than or equal to 0"),
    ("completions", {"prompt": [5], "stop_token_ids": [5] * 100 + [300]}, "stop_token_ids",
     "[0, 256)"),
    ("completions", {"prompt": [5], "max_tokens": 4, "min_tokens": 50}, "min_tokens",
     "max_tokens=4"),
    ("completions", {"prompt": [5], "repetition_penalty": 0}, "repetition_penalty",
     "greater than 0"),
    ("completions", {"prompt": [5], "presence_penalty": 3}, "presence_penalty",
     "less than or equal to 2"),
    ("completions", {"prompt": [5], "min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("completions", {"prompt": [5], "top_k": -2}, "top_k", "greater than or equal to -1"),
    ("completions", {"prompt": [5], "best_of": 3}, "best_of", "not supported"),
    ("completions", {"prompt": [5], "n": 2, "best_of": 1}, "best_of", ">= n"),
    ("completions", {"prompt": [5], "logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ("completions", {"prompt": [5], "echo": True}, "echo", "not supported"),
    ("completions", {"prompt": [5], "seed": -1}, "seed", "greater than or equal to 0"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content", "Field required"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, "messages",
     "context"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}]}, "tools", "not supported"),
    ("chat/completions", {"messages": None}, "messages", "messages"),
]


def _post(conn, endpoint: str, body: dict) -> tuple[int, dict, dict]:
    conn.request("POST", f"/v1/{endpoint}", body=json.dumps(body),
                 headers={"content-type": "application/json"})
    reply = conn.getresponse()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, json.loads(reply.read())


def test_bad_inputs_on_one_keep_alive_connection_are_400s_and_it_serves_on(server, tiny):
    """Every bad input is a 400 naming its field and limit, on one TCP connection that stays
    open; the next request on that same connection gets the exact greedy output."""
    import http.client
    import urllib.parse

    url, dep = server
    conn = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=30)
    try:
        conn.connect()
        sock = conn.sock
        for endpoint, body, param, words in KEEPALIVE_BAD:
            status, headers, reply = _post(conn, endpoint, body)
            assert status == 400, (body if len(json.dumps(body)) < 200 else param, reply)
            error = reply["error"]
            assert error["param"] == param and words in error["message"], error
            assert error["code"] == 400 and error["type"] == "invalid_request_error"
            assert headers.get("connection") != "close" and conn.sock is sock
        prompt = random_prompts([9], seed=11)[0]
        status, _, reply = _post(conn, "completions",
                                 {"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert status == 200 and conn.sock is sock
        assert reply["choices"][0]["text"] == BYTES.decode(greedy(tiny, prompt, 6))
    finally:
        conn.close()
    assert_clean(dep)


def test_an_unexpected_error_is_a_json_500_that_closes_the_connection(tiny, monkeypatch):
    """A bug in the request path (here the tokenizer raising) is OpenAI's error object with
    status 500 and ``Connection: close``; the server serves the next connection exactly."""
    import http.client
    import urllib.parse

    with Deployment(PlacementConfig("colocated:1", "cpu:0"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as dep:
        text = ByteText()
        openai_server = OpenAIServer(dep.router, text, "tiny")
        server = ServerThread(openai_server.app).start()
        try:
            monkeypatch.setattr(text, "encode", lambda s: (_ for _ in ()).throw(
                RuntimeError("tokenizer bug")))
            conn = http.client.HTTPConnection(urllib.parse.urlsplit(server.url).netloc, timeout=30)
            status, headers, reply = _post(conn, "completions", {"prompt": "hello"})
            assert status == 500 and headers["connection"] == "close"
            assert reply["error"]["type"] == "internal_error"
            assert "RuntimeError" in reply["error"]["message"] or "tokenizer bug" in \
                reply["error"]["message"]
            conn.close()
            monkeypatch.undo()
            assert_next_request_exact(server.url, tiny)
        finally:
            server.stop()
