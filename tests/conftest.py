"""Shared fixtures: the tiny seeded model, SmolLM2 (loaded once), and the generate() oracle."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import load_model


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests run the engine as a worker bound to one core runs it (``bind_device``: one
    torch thread), so the kernels chosen for one thread (``runner._Linear``'s C GEMM, the C
    decode attention) are the ones the greedy-equality tests check; the threaded choice is
    tested where it is made (``test_cpu_kernels.py``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny():
    """The tiny random Llama (GQA 4q/2kv, 2 layers, fp32, CPU)."""
    return load_model(ModelConfig("tiny-random-llama"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the bundled GGUF (cached as safetensors after the first load)."""
    return load_model(ModelConfig("smollm2-135m"))


def reference_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """The oracle: transformers ``generate(do_sample=False)`` on one prompt alone."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab_size: int = 256, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts (token ids 3.. so none is BOS/EOS/PAD of the tiny model)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
