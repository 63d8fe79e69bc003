"""The recorded request bodies of the benchmark clients (tests/data/clients: vLLM ``bench
serve``, SGLang ``bench_serving``, genai-perf, AIPerf, GuideLLM, llmperf), replayed as they
were sent against ``pdlab serve``: the command's own deployment and app
(``experiments.commands.serve.build`` from its command line), colocated:1 with SmolLM2 in
this process, on a loopback port (one model load: the HTTP layer is the same over every
placement; ``benchmarks/vllm_client.py`` runs vLLM's own client against disagg:1p1d).

Every body is served (200) with the answer its client parses: 16 completion tokens where it
asked ``ignore_eos`` (at most 16 otherwise), one SSE chunk per token, the usage chunk last
when asked, the usage in every chunk with ``continuous_usage_stats``, ``[DONE]`` at the end,
no empty ``choices`` unless usage was asked for (SGLang reads ``choices[0]`` of every chunk).
The greedy bodies (SGLang's, temperature 0) give transformers ``generate()``'s text. The
OpenAI SDK sends vLLM's sampling body too, and ``/v1/models`` has vLLM's ``root``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from conftest import reference_generate

from experiments import cli
from experiments.commands import serve
from server.app import ServerThread

pytestmark = pytest.mark.slow
CLIENTS = Path(__file__).resolve().parents[1] / "data" / "clients"
FILES = sorted(CLIENTS.glob("*.json"))
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def pdlab_serve():
    """``pdlab serve --local --placement colocated:1 --model smollm2-135m`` (small KV cache),
    on a free loopback port: (base url, the app, the deployment)."""
    args = cli.build_parser().parse_args([
        "serve", "--local", "--placement", "colocated:1", "--devices", "cpu:0",
        "--model", MODEL, "--max-model-len", "512", "--max-num-seqs", "32",
        "--kv-cache-memory-gb", "0.25", "--port", "0"])
    dep, app = serve.build(args, serve.check(args))
    with dep:
        thread = ServerThread(app.app).start()
        try:
            yield thread.url, app, dep
        finally:
            thread.stop()


def load(path: Path) -> tuple[dict, dict]:
    body = json.loads(path.read_text())
    return body.pop("_source"), body


async def post(client: httpx.AsyncClient, url: str, source: dict, body: dict) -> dict:
    """The reply as its client sees it: status, and the JSON body or the SSE events."""
    async with client.stream("POST", url + source["endpoint"], json=body) as reply:
        raw = (await reply.aread()).decode()
    if not body.get("stream") or reply.status_code != 200:
        return {"status": reply.status_code, "json": json.loads(raw)}
    lines = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    return {"status": 200, "done": lines[-1] == "[DONE]",
            "events": [json.loads(line) for line in lines if line != "[DONE]"]}


@pytest.fixture(scope="module")
def replies(pdlab_serve):
    """Every fixture posted at once (as a benchmark's concurrent requests would be)."""
    url = pdlab_serve[0]

    async def replay():
        async with httpx.AsyncClient(timeout=300) as client:
            loaded = [load(path) for path in FILES]
            results = await asyncio.gather(*(post(client, url, s, b) for s, b in loaded))
        return {path.stem: (source, body, result)
                for path, (source, body), result in zip(FILES, loaded, results)}

    return asyncio.run(replay())


def text_of(events: list[dict], chat: bool) -> str:
    return "".join((e["choices"][0]["delta"].get("content") or "") if chat else e["choices"][0]["text"]
                   for e in events if e.get("choices"))


@pytest.mark.parametrize("name", [f.stem for f in FILES])
def test_each_recorded_body_is_served_as_its_client_parses_it(replies, name):
    source, body, reply = replies[name]
    assert reply["status"] == 200, reply
    chat = "messages" in body
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    if not body.get("stream"):
        answer = reply["json"]
        choice = answer["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        tokens = answer["usage"]["completion_tokens"]
        assert text and len(answer["choices"]) == 1
    else:
        events = reply["events"]
        assert reply["done"] and not any("error" in e for e in events)
        token_chunks = [e for e in events if e.get("choices")]
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            assert events[-1]["choices"] == [] and events[-1]["usage"] is not None
            tokens = events[-1]["usage"]["completion_tokens"]
            assert len(token_chunks) == len(events) - 1
        else:  # SGLang and llmperf read choices[0] / count every event: no usage chunk
            assert len(token_chunks) == len(events) and "usage" not in events[-1]
            tokens = len(token_chunks)
        assert len(token_chunks) == tokens  # one chunk per token
        if options.get("continuous_usage_stats"):
            assert [e["usage"]["completion_tokens"] for e in token_chunks] == list(
                range(1, tokens + 1))
        if body.get("logprobs"):
            assert all(len(e["choices"][0]["logprobs"]["tokens"]) == 1 for e in token_chunks)
        text = text_of(events, chat)
        assert token_chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert (tokens == limit) if body.get("ignore_eos") else (1 <= tokens <= limit)
    assert text or not body.get("ignore_eos")


def test_greedy_bodies_give_generate_s_text(replies, pdlab_serve, smollm2):
    """SGLang's bodies are greedy (temperature 0): their text is transformers generate()'s
    (the first 16 tokens; ignore_eos may go past an EOS that generate() stops at); one
    streamed completion and one whole chat answer."""
    app = pdlab_serve[1]
    for name in ("sglang_completions_stream", "sglang_chat"):
        _, body, reply = replies[name]
        chat = "messages" in body
        prompt = (app.text.encode_chat(body["messages"]) if chat else app.text.encode(body["prompt"]))
        want = app.text.decode(reference_generate(smollm2.model, prompt, 16))
        if body.get("stream"):
            got = text_of(reply["events"], chat)
        else:
            choice = reply["json"]["choices"][0]
            got = choice["message"]["content"] if chat else choice["text"]
        assert got.startswith(want) if len(want) < len(got) else got == want, name


def test_the_openai_sdk_sends_vllm_s_sampling_body_and_models_has_root(pdlab_serve):
    url = pdlab_serve[0]
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["root"] == MODEL
    _, body = load(CLIENTS / "vllm_completions_stream_sampling.json")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    openai_fields = ("model", "prompt", "max_tokens", "logprobs", "stream", "stream_options",
                     "top_p", "temperature", "frequency_penalty", "presence_penalty")
    chunks = list(client.completions.create(
        **{k: body[k] for k in openai_fields},
        extra_body={k: v for k, v in body.items() if k not in openai_fields}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 16 == chunks[-1].usage.completion_tokens
    assert all(len(c.choices[0].logprobs.top_logprobs[0]) >= 1 for c in token_chunks)
