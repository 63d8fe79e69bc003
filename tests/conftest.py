"""Shared fixtures: the tiny seeded model, SmolLM2 (loaded once), the generate() oracle, and
one local Ray cluster for the tests that ask for ``shared_ray``."""

from __future__ import annotations

import contextlib

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


# The cluster of ``shared_ray`` while it runs: its ``placement_helpers.local_ray()`` context.
_shared_ray: contextlib.ExitStack | None = None


@pytest.fixture
def shared_ray():
    """A local Ray cluster (``placement_helpers.local_ray()``: 4 logical CPUs) shared by the
    tests that use this fixture: started by the first, shut down before the first test that
    does not use it (collection runs them one after another), so a test that starts its
    own cluster, or none, never meets it. Each test must leave it as it found it
    (``placement_helpers.ray_leftovers``): a test that does not fails at teardown, and the
    cluster is shut down, so the next test gets a fresh one."""
    global _shared_ray
    if _shared_ray is None:
        from placement_helpers import local_ray

        with contextlib.ExitStack() as stack:
            stack.enter_context(local_ray())
            _shared_ray = stack.pop_all()
    yield
    from placement_helpers import ray_leftovers

    left = ray_leftovers()
    if left:
        _stop_shared_ray()
        pytest.fail(f"the test left the shared Ray cluster holding: {'; '.join(left)}")


def _stop_shared_ray() -> None:
    global _shared_ray
    if _shared_ray is not None:
        stack, _shared_ray = _shared_ray, None
        stack.close()


def pytest_collection_modifyitems(items):
    """The tests that use ``shared_ray`` run one after another, where the first of them was
    (the others keep their order): the cluster starts once."""
    shared = [item for item in items if "shared_ray" in item.fixturenames]
    if shared:
        first = items.index(shared[0])
        rest = [item for item in items if "shared_ray" not in item.fixturenames]
        items[:] = rest[:first] + shared + rest[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures are torn down first
    if nextitem is None or "shared_ray" not in nextitem.fixturenames:
        _stop_shared_ray()


def pytest_sessionfinish(session):
    _stop_shared_ray()  # a run stopped early (-x, a failure at collection) left it running
