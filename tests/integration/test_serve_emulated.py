"""``pdlab serve`` on two emulated H100s (disagg:1p1d, in-process, the Llama-3.1-8B profile in
tests/data) answers text prompts with text: one ``WORDS`` entry per emulated token, streamed and
not, with ``usage`` equal to the engine's own counts (its ``RequestRecord``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from engine.config import ModelConfig
from engine.emulated import emulated_token, prompt_hash
from engine.model import load_geometry
from experiments import cli
from experiments.commands import serve
from server.app import ServerThread
from server.emulated_text import WORDS, EmulatedText

pytestmark = pytest.mark.workers
ROOT = Path(__file__).resolve().parents[2]
PROFILE = str(ROOT / "tests" / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json")
MODEL = "engine/configs/llama-3.1-8b"


@pytest.fixture(scope="module")
def emulated():
    """(base url, the server's text, the engine's records of finished requests)."""
    args = cli.build_parser().parse_args(
        ["serve", "--model", MODEL, "--devices", "emu:0-1", "--placement", "disagg:1p1d",
         "--local", "--device-profile", PROFILE, "--emu-kv-scale", "0.00390625",
         "--max-model-len", "512"])
    dep, app = serve.build(args, serve.check(args))
    records = []
    observe = app.metrics.observe

    def keep(record):
        records.append(record)
        observe(record)

    app.metrics.observe = keep
    try:
        thread = ServerThread(app.app).start()
        try:
            yield thread.url, app.text, records
        finally:
            thread.stop()
    finally:
        dep.close()


def expected_words(prompt_ids: list[int], n: int) -> str:
    """The emulated model's ``n`` output tokens for ``prompt_ids``, as words."""
    geometry = load_geometry(ModelConfig(MODEL))
    ids = [emulated_token(prompt_hash(prompt_ids), i, geometry.vocab_size,
                          frozenset(geometry.eos_token_ids)) for i in range(n)]
    return "".join(WORDS[t % len(WORDS)] for t in ids)


def record_of(records: list, response_id: str):
    """The engine's record of the response's one request (the router may finish its
    bookkeeping just after the last token reached the client)."""
    deadline = time.monotonic() + 30
    while not any(r.request_id.startswith(response_id) for r in records):
        assert time.monotonic() < deadline, f"no record of {response_id}"
        time.sleep(0.01)
    return next(r for r in records if r.request_id.startswith(response_id))


def sse(reply: httpx.Response) -> list[dict]:
    lines = [ln for ln in reply.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def test_streamed_completion_is_one_word_per_token_with_the_engines_usage(emulated):
    url, text, records = emulated
    assert isinstance(text, EmulatedText)
    prompt = "Rehearse a GPU box on a laptop: the emulated devices answer in words."
    prompt_ids = text.encode(prompt)
    reply = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=60)
    assert reply.status_code == 200, reply.text
    chunks = sse(reply)
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 12 and all(c["choices"][0]["text"] in WORDS for c in tokens)
    streamed = "".join(c["choices"][0]["text"] for c in tokens)
    assert streamed == expected_words(prompt_ids, 12)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    record = record_of(records, chunks[0]["id"])
    assert record.num_prompt_tokens == len(prompt_ids) and len(record.output_token_ids) == 12
    assert text.decode(record.output_token_ids) == streamed
    assert chunks[-1]["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                                   "total_tokens": len(prompt_ids) + 12}


def test_whole_chat_answer_carries_the_text_and_the_engines_usage(emulated):
    url, text, records = emulated
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = text.encode_chat(messages)
    reply = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 9}, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    content = body["choices"][0]["message"]["content"]
    assert content == expected_words(prompt_ids, 9) and len(content.split()) == 9
    record = record_of(records, body["id"])
    assert body["usage"] == {"prompt_tokens": record.num_prompt_tokens,
                             "completion_tokens": len(record.output_token_ids),
                             "total_tokens": record.num_prompt_tokens + 9}
    assert record.num_prompt_tokens == len(prompt_ids)
