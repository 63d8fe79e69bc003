"""The runner's projections (``engine.runner._Linear`` on ``engine.ops``' kernels):
every GEMM kernel the backend can pick gives ``F.linear``'s result, each row-count
bucket runs the kernel chosen for it, the fused weight is the modules' only copy, and
without oneDNN and pdlab's kernels the engine still equals generate()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference_generate

from engine import cpu_kernels, kernel_choice, ops
from engine import runner as runner_mod
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams

CAN_PDLAB = cpu_kernels.load() is not None and cpu_kernels.load().linear_vectorized
CAN_PDLAB512 = CAN_PDLAB and cpu_kernels.load().linear_avx512
# every kernel the selector can pick here, and the reference backend's
KERNELS = ["torch", "mkl", *(["onednn"] if ops.ONEDNN else []),
           *(["pdlab", "pdlab-hwpf"] if CAN_PDLAB else []),
           *(["pdlab512"] if CAN_PDLAB512 else [])]


def _modules(bias: bool):
    torch.manual_seed(3)
    return [torch.nn.Linear(32, out, bias=bias and out != 16) for out in (48, 16, 24)]


def _backend(kernel: str, monkeypatch) -> ops.TorchOps:
    if kernel == "torch":
        return ops.TorchOps()
    monkeypatch.setenv(ops.FORCE_ENV, f"linear={kernel}")
    return ops.select_ops(torch.device("cpu"), torch.float32, torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 63, 64, 130, 600])
def test_fused_projection_equals_f_linear_per_module(bias, rows, kernel, monkeypatch):
    modules = _modules(bias)
    before = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
              for m in modules]
    fused = runner_mod._Linear(modules, ops=_backend(kernel, monkeypatch))
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        outs = fused(x)
    assert [o.shape for o in outs] == [(rows, 48), (rows, 16), (rows, 24)]
    for out, (weight, b) in zip(outs, before):
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    for m, (weight, _) in zip(modules, before):  # same values, now views of the fused weight
        assert torch.equal(m.weight, weight)
        assert m.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


@pytest.mark.skipif(not CAN_PDLAB, reason="pdlab's C GEMM is not built for this CPU")
@pytest.mark.parametrize("kernel, prefetch", [("pdlab", True), ("pdlab-hwpf", False)])
def test_pdlab_hwpf_is_the_c_gemm_without_software_prefetch(kernel, prefetch, monkeypatch):
    """The results cannot tell the two apart (equal bit for bit): the call can."""
    calls = []
    real = cpu_kernels.Kernels.linear
    monkeypatch.setattr(cpu_kernels.Kernels, "linear", lambda self, *a, **kw: (
        calls.append(kw.get("prefetch", True)), real(self, *a, **kw))[1])
    fused = runner_mod._Linear(_modules(False), ops=_backend(kernel, monkeypatch))
    with torch.inference_mode():
        fused(torch.randn(3, 32))
    assert calls == [prefetch]


def test_each_row_bucket_runs_its_chosen_kernel(tmp_path):
    """A selector whose (fake) timings make MKL fastest for 1 row, oneDNN or pdlab for 2-8
    rows and MKL again from 9: the projection runs exactly those, the last bucket's choice
    for every larger count, and the chosen kernels are what ``describe()`` reports."""
    names = ["mkl", *(["onednn"] if ops.ONEDNN else []),
             *(["pdlab", "pdlab-hwpf"] if CAN_PDLAB else []),
             *(["pdlab512"] if CAN_PDLAB512 else [])]
    middle = names[-1]

    def timer(runs):
        b = timer.buckets.pop(0)
        fastest = "mkl" if b == 0 or b > 3 else middle
        return {name: 1.0 if name == fastest else 2.0 for name in runs}
    timer.buckets = list(range(ops.LINEAR_MAX_BUCKET + 1))
    selector = kernel_choice.KernelSelector({"cpu_model": "fake"}, tmp_path / "c.json", timer)
    backend = ops.CpuOps(cpu_kernels.load(), True, selector)
    linear = runner_mod._Linear([torch.nn.Linear(32, 40)], ops=backend)
    want = {1: "mkl", 2: middle, 5: middle, 8: middle, 9: "mkl", 512: "mkl", 3000: "mkl"}
    for rows, name in want.items():
        assert linear.fused.by_bucket[min(kernel_choice.bucket(rows), linear.fused.last)].name \
            == name
    expected = "1 mkl, 2-8 " + middle + ", 9+ mkl" if middle != "mkl" else "1+ mkl"
    assert backend.describe()["linear"] == {"32x40": expected}


def test_engine_without_onednn_matches_generate(monkeypatch):
    """The fallback where oneDNN and pdlab's kernels are missing: every projection is
    ``mm`` / ``addmm`` (MKL), the only candidate, so nothing is measured."""
    monkeypatch.setattr(ops, "ONEDNN", False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    loaded = load_model(ModelConfig("tiny-random-llama"))  # fresh: prepared without oneDNN
    prompts = random_prompts([3, 70, 9], seed=10)  # 70 + 2 rows in one step
    engine = Engine(loaded, EngineConfig(max_num_seqs=3, max_model_len=96,
                                         max_num_batched_tokens=96))
    assert engine.runner.ops.linear_candidates == ["mkl"]
    assert all({k.name for k in layer.qkv.fused.by_bucket} == {"mkl"}
               for layer in engine.runner.layers)
    outputs = engine.generate([Request(f"n{i}", tuple(p), SamplingParams(max_tokens=6))
                               for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert outputs[f"n{i}"] == reference_generate(loaded.model, p, 6)
