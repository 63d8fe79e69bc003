"""load_model: clear errors for bad names/paths/hub ids, the tiny model's geometry and
fingerprint, and SmolLM2's geometry, chat template and safetensors cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVSpec
from engine.model import KNOWN_NAMES, ModelLoadError, cache_dir, load_model


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig("no-such-model"))
    message = str(info.value)
    assert "no-such-model" in message
    assert KNOWN_NAMES == ("smollm2-135m", "tiny-random-llama", "tiny-random-llama3",
                           "tiny-random-mistral", "tiny-random-qwen2", "tiny-random-qwen3",
                           "tiny-random-gemma2", "tiny-random-gemma3", "tiny-random-phi3")
    for name in KNOWN_NAMES:
        assert name in message


def test_directory_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(str(tmp_path)))
    assert str(tmp_path) in str(info.value) and "no config.json" in str(info.value)


def test_missing_hub_id_says_what_to_do(monkeypatch):
    import huggingface_hub.constants

    # Offline: fail fast instead of retrying DNS (the flag is read at import, so patch both).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig("no-such-org/no-such-model-pdlab"))
    message = str(info.value)
    assert "no-such-org/no-such-model-pdlab" in message
    assert "local directory" in message  # what to do instead
    assert isinstance(info.value.__cause__, OSError)


def test_tiny_model_spec_eos_and_fingerprint(tiny):
    spec = tiny.kv_spec
    assert spec == KVSpec(spec.model_fingerprint, num_layers=2, num_kv_heads=2, head_dim=16,
                          dtype="float32")
    assert spec.model_fingerprint.startswith("tiny-random-llama@")
    assert len(spec.model_fingerprint.split("@")[1]) == 12
    assert spec.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert tiny.eos_token_ids == (2,)
    assert tiny.max_context_len == 256 and tiny.tokenizer is None and tiny.name == "tiny-random-llama"
    assert tiny.model.config.num_attention_heads == 4  # GQA: 4 query heads over 2 KV heads
    assert next(tiny.model.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny.encode_chat("hi")


def test_tiny_model_is_seeded_and_fingerprint_ignores_dtype(tiny):
    again = load_model(ModelConfig("tiny-random-llama"))
    assert again.kv_spec == tiny.kv_spec
    for a, b in zip(tiny.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    bf16 = load_model(ModelConfig("tiny-random-llama", dtype="bfloat16"))
    assert bf16.kv_spec.model_fingerprint == tiny.kv_spec.model_fingerprint  # by design
    assert bf16.kv_spec.dtype == "bfloat16" and bf16.kv_spec != tiny.kv_spec
    assert bf16.kv_spec.bytes_per_token == tiny.kv_spec.bytes_per_token // 2
    assert next(bf16.model.parameters()).dtype == torch.bfloat16


def test_load_does_not_disturb_callers_rng():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    load_model(ModelConfig("tiny-random-llama"))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.slow
def test_smollm2_geometry(smollm2):
    spec = smollm2.kv_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (30, 3, 64, "float32")
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert spec.model_fingerprint.startswith("smollm2-135m@")
    assert smollm2.tokenizer is not None and len(smollm2.eos_token_ids) >= 1


@pytest.mark.slow
def test_smollm2_chat_template(smollm2):
    tok = smollm2.tokenizer
    ids = smollm2.encode_chat("hi")
    assert all(isinstance(t, int) for t in ids)
    start = tok.encode("<|im_start|>", add_special_tokens=False)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[:len(start)] == start
    assert ids[-len(header):] == header
    assert tok.decode(ids[:len(start)]) == "<|im_start|>"
    assert tok.decode(ids[-len(header):]) == "<|im_start|>assistant\n"
    text = tok.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text


@pytest.mark.slow
def test_smollm2_cached_as_safetensors(smollm2):
    folder = cache_dir() / "models" / "smollm2-135m"
    root = Path(os.environ.get("PDLAB_CACHE_DIR", Path.home() / ".cache" / "pdlab"))
    assert folder == root / "models" / "smollm2-135m"
    assert (folder / "model.safetensors").is_file()
    assert (folder / "config.json").is_file()
    assert not folder.with_name("smollm2-135m.partial").exists()


def test_local_hf_directory_loads_and_serves(tiny, tmp_path):
    """A model saved with save_pretrained loads by path; without tokenizer files it still
    serves token-id prompts, and its greedy tokens equal generate()."""
    from conftest import random_prompts, reference_generate

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import Request, SamplingParams

    tiny.model.save_pretrained(tmp_path / "tiny")
    loaded = load_model(ModelConfig(str(tmp_path / "tiny")))
    assert loaded.tokenizer is None
    assert loaded.kv_spec.num_kv_heads == 2 and loaded.kv_spec.num_layers == 2
    prompt = random_prompts([9])[0]
    engine = Engine(loaded, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16))
    out = engine.generate([Request("p", tuple(prompt), SamplingParams(max_tokens=6))])
    assert out["p"] == reference_generate(tiny.model, prompt, 6)
