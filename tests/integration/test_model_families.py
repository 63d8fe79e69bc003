"""Every supported family (engine/model.py SUPPORTED_ARCHITECTURES), as a tiny seeded model
with its own features on: greedy tokens equal generate() through the engine (chunked prefill
on and off) and through disagg:1p1d; logits equal the model's forward; the KV geometry and
bytes come from each config; unsupported models are refused with one line."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import random_prompts, reference_generate
from placement_helpers import ENGINE, assert_clean, assert_outputs

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.engine import Engine
from engine.kv_cache import KVStore
from engine.model import (SUPPORTED_ARCHITECTURES, TINY_FAMILIES, UnsupportedModelError,
                          check_model_name, load_model)
from engine.request import Request, RequestState, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import ScheduledBatch
from deployment.placement import Deployment

# name: (layers, KV heads, head dim, context, what bounds it), written out from the configs in
# engine/model.py tiny_family_config (head_dim given where it is not hidden/heads = 16).
GEOMETRY = {
    "tiny-random-llama3": (3, 2, 16, 256, "max_position_embeddings"),
    "tiny-random-mistral": (3, 2, 24, 256, "max_position_embeddings"),
    "tiny-random-qwen2": (3, 2, 16, 256, "max_position_embeddings"),
    "tiny-random-qwen3": (3, 2, 32, 256, "max_position_embeddings"),
    "tiny-random-gemma2": (3, 2, 32, 48, "sliding_window"),
    "tiny-random-gemma3": (3, 1, 32, 48, "sliding_window"),  # MQA
    "tiny-random-phi3": (3, 2, 16, 64, "longrope original_max_position_embeddings"),
}
FAMILIES = [f"tiny-random-{f}" for f in TINY_FAMILIES]
# The longest prompt + max_tokens is 48: the Gemma models' whole sliding window.
LENGTHS, MAX_TOKENS = [1, 17, 40], 8
SUPPORTED = ", ".join(SUPPORTED_ARCHITECTURES)


def test_every_family_has_a_tiny_model():
    assert sorted(GEOMETRY) == sorted(FAMILIES)
    archs = {load_model(ModelConfig(name)).model.config.architectures[0] for name in FAMILIES}
    assert archs == set(SUPPORTED_ARCHITECTURES)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    loaded = load_model(ModelConfig(request.param))
    prompts = random_prompts(LENGTHS, seed=5)
    expected = [reference_generate(loaded.model, p, MAX_TOKENS) for p in prompts]
    return loaded, prompts, expected


def test_kv_geometry_from_config(family):
    loaded = family[0]
    layers, kv_heads, head_dim, context, limit = GEOMETRY[loaded.name]
    spec = loaded.kv_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (layers, kv_heads, head_dim)
    assert spec.kv_bytes(10) == 2 * layers * kv_heads * head_dim * 10 * 4
    assert (loaded.max_context_len, loaded.context_limit) == (context, limit)


@pytest.mark.parametrize("chunked,budget", [(True, 7), (False, 64)])
def test_greedy_matches_generate(family, chunked, budget):
    loaded, prompts, expected = family
    engine = Engine(loaded, EngineConfig(max_num_seqs=3, max_model_len=64,
                                         max_num_batched_tokens=budget,
                                         enable_chunked_prefill=chunked))
    assert engine.max_model_len == min(64, loaded.max_context_len)
    outputs = engine.generate([Request(f"r{i}", tuple(p), SamplingParams(max_tokens=MAX_TOKENS))
                               for i, p in enumerate(prompts)])
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.is_empty()


def test_logits_equal_forward(family):
    """Prefill in two chunks, then one decode step: the runner's logits equal the model's own
    forward (this is what checks Gemma 2's final soft-cap, invisible to greedy)."""
    loaded, prompts, expected = family
    prompt = prompts[1]
    runner = ModelRunner(loaded.model, KVStore(loaded.kv_spec, 4, 8))  # 4 blocks of 8 tokens
    state = RequestState(Request("x", tuple(prompt), SamplingParams(max_tokens=2)))
    state.block_ids = [2, 0, 3, 1]  # scattered: chunk and decode attention gather
    logits = []
    for num_new in (7, len(prompt) - 7):
        batch = ScheduledBatch()
        batch.add(state, num_new)
        logits.append(runner.execute(batch))
        state.num_computed_tokens += num_new
    assert logits[0].shape[0] == 0  # the first chunk samples nothing
    state.token_ids.append(expected[1][0])
    batch = ScheduledBatch()
    batch.add(state, 1)
    decode_logits = runner.execute(batch)
    with torch.inference_mode():
        want = loaded.model(torch.tensor([state.token_ids])).logits[0]
    torch.testing.assert_close(logits[1][0], want[len(prompt) - 1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(decode_logits[0], want[len(prompt)], rtol=1e-4, atol=1e-5)


def test_greedy_through_disagg(family):
    loaded, prompts, expected = family
    layers, kv_heads, head_dim, _, _ = GEOMETRY[loaded.name]
    workload = [(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=MAX_TOKENS)), 0.01 * i)
                for i, p in enumerate(prompts)]
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), ModelConfig(loaded.name),
                    ENGINE, TransferConfig(transport="inprocess", timeout_s=5),
                    local=True) as deployment:
        records = deployment.run(workload)
        assert_outputs(records, {f"r{i}": e for i, e in enumerate(expected)})
        assert_clean(deployment)
    for record in records:
        assert record.kv_bytes == 2 * layers * kv_heads * head_dim * record.num_prompt_tokens * 4


def _refusal(what: str, path) -> str:
    return (f"model {path}: {what} is not supported by pdlab's runner (supported "
            f"architectures: {SUPPORTED}; see docs/guides/models.md)")


def _save(config, tmp_path):
    config.save_pretrained(tmp_path)  # config.json only: the check comes before any weights
    return str(tmp_path)


@pytest.mark.parametrize("config,what", [
    (transformers.GPT2Config(architectures=["GPT2LMHeadModel"]), "architecture GPT2LMHeadModel"),
    (transformers.MixtralConfig(architectures=["MixtralForCausalLM"]),
     "architecture MixtralForCausalLM"),
    (transformers.Gemma3TextConfig(architectures=["Gemma3ForConditionalGeneration"]),
     "architecture Gemma3ForConditionalGeneration"),
    (transformers.LlamaConfig(), "architecture (none in config.json)"),
    (transformers.LlamaConfig(architectures=["LlamaForCausalLM"], rope_parameters={
        "rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "LlamaForCausalLM with RoPE type 'proportional'"),
    (transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2,
                              layer_types=["chunked_attention", "full_attention"]),
     "Qwen3ForCausalLM with layer type 'chunked_attention'"),
    (transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"],
                                   use_bidirectional_attention=True),
     "Gemma3ForCausalLM with use_bidirectional_attention"),
    (transformers.LlamaConfig(architectures=["LlamaForCausalLM"],
                              quantization_config={"quant_method": "gptq", "bits": 4}),
     "LlamaForCausalLM with quantization_config (gptq)"),
], ids=["gpt2", "mixtral", "gemma3-multimodal", "no-architectures", "rope-type",
        "layer-type", "bidirectional", "quantized"])
def test_unsupported_is_refused_with_one_line(tmp_path, config, what):
    path = _save(config, tmp_path)
    with pytest.raises(UnsupportedModelError) as at_check:
        check_model_name(ModelConfig(path))  # fails fast, before any process starts
    with pytest.raises(UnsupportedModelError) as at_load:
        load_model(ModelConfig(path))
    assert str(at_check.value) == str(at_load.value) == _refusal(what, path)
    assert "\n" not in str(at_load.value)


def test_sliding_window_caps_context_only_where_layers_slide(tmp_path):
    """Mistral slides in every layer (its own window), Qwen2 only in "sliding_attention"
    layers (none here: max_window_layers >= layers), Llama never."""
    cases = [
        (transformers.MistralConfig(architectures=["MistralForCausalLM"], sliding_window=100,
                                    max_position_embeddings=512), (100, "sliding_window")),
        (transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                  sliding_window=100, max_window_layers=28, num_hidden_layers=2,
                                  max_position_embeddings=512), (512, "max_position_embeddings")),
        (transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                  sliding_window=100, max_window_layers=1, num_hidden_layers=2,
                                  max_position_embeddings=512), (100, "sliding_window")),
    ]
    from engine.model import check_supported

    for config, want in cases:
        assert check_supported(config, "m") == want, config.architectures
