"""The recorded client bodies (tests/data/clients) are what they say they are: each
names its source and endpoint, and its streaming mode and prompt field match its file name.
(The replay against a running ``pdlab serve`` is tests/integration/test_client_replay.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CLIENTS = Path(__file__).resolve().parent.parent / "data" / "clients"
FILES = sorted(CLIENTS.glob("*.json"))
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def test_every_client_has_completions_or_chat_fixtures():
    names = {f.stem for f in FILES}
    for client in ("vllm", "sglang", "genai_perf", "aiperf", "guidellm", "llmperf"):
        assert any(n.startswith(client + "_") for n in names), client
    assert len(FILES) == 20


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_fixture_names_its_source_and_matches_its_name(path):
    data = json.loads(path.read_text())
    source = data.pop("_source")
    for key in ("client", "repo", "path", "function", "endpoint", "command", "how"):
        assert source.get(key), (path.name, key)
    assert source.get("commit") or source.get("version"), path.name
    kind = "chat" if "_chat" in path.stem else "completions"
    assert source["endpoint"] == ENDPOINTS[kind]
    assert ("messages" if kind == "chat" else "prompt") in data
    assert bool(data.get("stream")) == path.stem.endswith(("_stream", "_stream_sampling"))
    assert data["model"] == "smollm2-135m"
