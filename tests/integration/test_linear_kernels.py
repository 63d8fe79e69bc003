"""The runner's projections (``engine.runner._Linear``, issue 10): each GEMM kernel it picks by
row count gives ``F.linear``'s result, the fused weight is the modules' only copy, and without
oneDNN the engine still equals generate()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference_generate

from engine import cpu_kernels
from engine import runner as runner_mod
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams


def _modules(bias: bool):
    torch.manual_seed(3)
    return [torch.nn.Linear(32, out, bias=bias and out != 16) for out in (48, 16, 24)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, runner_mod._BLAS_MIN_ROWS - 1,
                                  runner_mod._BLAS_MIN_ROWS, 130])
def test_fused_projection_equals_f_linear_per_module(bias, rows):
    modules = _modules(bias)
    before = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
              for m in modules]
    fused = runner_mod._Linear(modules)
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        outs = fused(x)
    assert [o.shape for o in outs] == [(rows, 48), (rows, 16), (rows, 24)]
    for out, (weight, b) in zip(outs, before):
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    for m, (weight, _) in zip(modules, before):  # same values, now views of the fused weight
        assert torch.equal(m.weight, weight)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


@pytest.mark.skipif(not runner_mod._ONEDNN, reason="this torch has no oneDNN linear")
def test_kernel_choice_by_rows():
    layer = runner_mod._Linear(_modules(False))
    head = runner_mod._Linear([torch.nn.Linear(32, 64, bias=False)], gemv_onednn=True)
    assert layer.packed is not None and head.packed is not None
    edge = runner_mod._BLAS_MIN_ROWS
    assert [layer._use_onednn(n) for n in (1, 2, edge - 1, edge, 4 * edge)] == [
        False, True, True, False, False]  # MKL for one row and from the crossover on
    assert [head._use_onednn(n) for n in (1, 2, edge)] == [True, True, False]


def test_engine_without_onednn_matches_generate(monkeypatch):
    """The fallback where oneDNN and pdlab's kernels are missing: every projection is
    ``F.linear``."""
    monkeypatch.setattr(runner_mod, "_ONEDNN", False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    loaded = load_model(ModelConfig("tiny-random-llama"))  # fresh: prepared without oneDNN
    prompts = random_prompts([3, 70, 9], seed=10)  # 70 + 2 rows in one step reach MKL's range
    engine = Engine(loaded, EngineConfig(max_num_seqs=3, max_model_len=96,
                                         max_num_batched_tokens=96))
    assert all(layer.qkv.packed is None and layer.qkv.panels is None
               for layer in engine.runner.layers)
    outputs = engine.generate([Request(f"n{i}", tuple(p), SamplingParams(max_tokens=6))
                               for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert outputs[f"n{i}"] == reference_generate(loaded.model, p, 6)
