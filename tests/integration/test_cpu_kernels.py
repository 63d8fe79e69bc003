"""The fused CPU kernels (``engine/cpu_kernels.py``): each equals the torch ops it
replaces (RMSNorm and SiLU to float32 rounding, RoPE and the K/V write bit for bit), the
runner detects which modules they may stand in for, refuses what they cannot take, and the
engine equals generate() with them and without them (no compiler, a failing build, or
``PDLAB_CPU_KERNELS=0``)."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference_generate
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine import cpu_kernels, ops
from engine import runner as runner_mod
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVStore
from engine.model import load_model
from engine.request import Request, RequestState, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import ScheduledBatch

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason="no C compiler here: the kernels cannot be built")
# The GEMM and decode attention are taken only where the build targets AVX2 + FMA.
needs_vector_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.load().linear_vectorized,
    reason="the kernels are not built for AVX2/FMA here")
# pdlab's AVX-512 GEMM runs only where the CPU has avx512f (and the build keeps it).
HAS_AVX512 = cpu_kernels.load() is not None and cpu_kernels.load().linear_avx512
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no avx512f")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def kernels():
    return cpu_kernels.load()


@needs_kernels
@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 40), (130, 17)])
@pytest.mark.parametrize("norm_cls", [LlamaRMSNorm, Gemma2RMSNorm])
def test_add_rms_norm_equals_residual_add_then_module(kernels, rows, dim, norm_cls):
    module = norm_cls(dim, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(_randn(dim, seed=1))
    norm = runner_mod._Norm.of(module)
    assert norm.weight is not None  # both are the plain form (Gemma's 1 + w folded)
    hidden, delta = _randn(rows, dim, seed=2) * 4, _randn(rows, dim, seed=3)
    want_hidden = hidden + delta
    with torch.inference_mode():
        want = module(want_hidden)
        got = kernels.add_rms_norm(hidden, delta, norm.weight, norm.eps)
        assert torch.equal(hidden, want_hidden)  # the add, in place, is the same op
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)  # sum order only
        torch.testing.assert_close(kernels.add_rms_norm(hidden, None, norm.weight, norm.eps),
                                   want, rtol=2e-6, atol=1e-6)
    assert torch.equal(hidden, want_hidden)  # no delta: hidden untouched


@needs_kernels
@pytest.mark.parametrize("n,heads,kv_heads,d", [(1, 9, 3, 64), (7, 4, 2, 16), (3, 2, 1, 256)])
def test_rope_kv_equals_rope_and_index_copy(kernels, n, heads, kv_heads, d):
    """Against the runner's torch path: ``_apply_rope`` (transformers' formula) on q and k,
    then ``index_copy_`` of k and v into the store; bit for bit."""
    width = (heads + 2 * kv_heads) * d
    qkv = _randn(n, width, seed=n)
    q_end, k_end = heads * d, (heads + kv_heads) * d
    views = lambda t: (t[:, :q_end].view(n, heads, d),  # noqa: E731
                       t[:, q_end:k_end].view(n, kv_heads, d), t[:, k_end:].view(n, kv_heads, d))
    angles = torch.arange(n)[:, None] * 0.37 + torch.arange(d // 2) * 0.05
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [n, d]
    store = torch.full((3, 2, kv_heads, 4, 8, d), float("nan"))  # [L, 2, H_kv, NB, B, D]
    slots = torch.tensor([(5 + 3 * t) % 32 for t in range(n)])
    want_store = store.clone()
    q, k, v = views(qkv.clone())
    want_q = ops.apply_rope(q, cos[:, None], sin[:, None])
    flat = want_store[1].view(2, kv_heads, -1, d)
    flat[0].index_copy_(1, slots, ops.apply_rope(k, cos[:, None], sin[:, None])
                        .transpose(0, 1))
    flat[1].index_copy_(1, slots, v.transpose(0, 1))
    q, k, v = views(qkv)
    kernels.rope_kv(q, k, v, cos, sin, store[1], slots)
    assert torch.equal(q, want_q)
    assert torch.equal(store.nan_to_num(7.0), want_store.nan_to_num(7.0))  # only new slots


@needs_kernels
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 40), (2, 3)])
def test_silu_mul_equals_act_times_up(kernels, rows, inter):
    gate_up = _randn(rows, 2 * inter, seed=rows) * 6
    gate_up[0, :2] = torch.tensor([-100.0, 100.0])  # past exp's clamp on both sides
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up), want, rtol=2e-6, atol=1e-7)


@needs_kernels
def test_wrappers_refuse_what_they_cannot_read(kernels):
    w = torch.ones(8)
    for bad in (torch.ones(2, 8, dtype=torch.float64), torch.ones(8, 2).t(),
                torch.ones(2, 8, device="meta")):
        with pytest.raises(ValueError, match="contiguous float32 CPU"):
            kernels.add_rms_norm(bad, None, w, 1e-6)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        kernels.silu_mul(torch.ones(2, 8, device="meta"))
    q = torch.ones(1, 2, 4)
    with pytest.raises(ValueError, match="int64"):
        kernels.rope_kv(q, q[:, :1], q[:, :1], torch.ones(1, 4), torch.ones(1, 4),
                        torch.zeros(2, 1, 1, 4, 4), torch.tensor([0], dtype=torch.int32))


@needs_kernels
@pytest.mark.parametrize("rows,n,k", [(1, 960, 576), (2, 16, 5), (3, 32, 7), (7, 48, 9),
                                      (8, 17, 8), (16, 48, 33), (257, 40, 24), (12, 33, 10),
                                      (13, 64, 6), (25, 31, 12), (100, 50, 20),
                                      (300, 40, 576), (173, 20, 1536)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("avx512", [False, True])
def test_linear_equals_f_linear(kernels, rows, n, k, bias, avx512):
    """Both GEMMs. AVX2 (6 x 16): every block size 1..6 (7 = 4 + 3, 8 = 4 + 4, 16 = 6 + 5 +
    5, 257 = 42 x 6 + 5), a partial last panel (n % 16). AVX-512 (12 x 32): blocks 1..12
    (13 = 7 + 6, 16 = 8 + 8, 25 = 9 + 8 + 8, 100 = 9 x 11 + ..., 257 = 22 blocks of 11-12),
    partial last panels of 1-31 columns (masked stores: n = 17, 31, 33, 40, 50), and equal
    to the AVX2 kernel bit for bit (the same FMAs in the same order). Row blocks of 192 KiB
    of x (k = 576: 84 rows, 300 = 3 x 84 + 48; k = 1536: 30 / 24 rows, 173 ragged): every
    row equal bit for bit to that row computed alone. Rows of a wider tensor."""
    if avx512 and not kernels.linear_avx512:
        pytest.skip("this CPU has no avx512f")
    w, b = _randn(n, k, seed=1) * k ** -0.5, (_randn(n, seed=2) if bias else None)  # out ~1
    x = _randn(rows, k + 3, seed=3)[:, 2:2 + k]  # rows k + 3 apart, each contiguous
    if avx512:
        panels = kernels.pack_linear512(w)
        assert panels.shape == (-(-n // 32), k, 32)
        got = kernels.linear512(x, panels, b, n)
        if kernels.linear_vectorized:
            assert torch.equal(got, kernels.linear(x, kernels.pack_linear(w), b, n))
    else:
        panels = kernels.pack_linear(w)
        assert panels.shape == (-(-n // 16), k, 16)
        got = kernels.linear(x, panels, b, n)
        # without the software prefetch ("pdlab-hwpf"): the same sums, bit for bit
        assert torch.equal(got, kernels.linear(x, panels, b, n, prefetch=False))
    run = kernels.linear512 if avx512 else kernels.linear
    alone = torch.cat([run(x[i:i + 1], panels, b, n) for i in range(rows)])
    assert torch.equal(got, alone)  # the row blocking changes no sum's order
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_avx512_gemm_is_left_out_under_the_avx2_cap(kernels, monkeypatch, tmp_path):
    """``PDLAB_CPU_KERNELS_ISA=avx2`` builds without the AVX-512 kernels: the library says
    so (so the backend never offers ``pdlab512``) and they refuse to run; the AVX2 chunk
    attention still runs and gives the uncapped build's result."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path))
    capped = cpu_kernels.Kernels(cpu_kernels.build())
    assert not capped.linear_avx512
    w = torch.ones(32, 8)
    with pytest.raises(ValueError, match="linear512 needs a CPU with avx512f"):
        capped.linear512(torch.ones(2, 8), capped.pack_linear512(w), None, 32)
    q, kv = torch.ones(2, 2, 8), torch.ones(2, 1, 2, 8)
    with pytest.raises(ValueError, match="causal_attention512 needs a CPU with avx512f"):
        capped.causal_attention512(q, kv[0], kv[1], 0, 1.0)
    if kernels.linear_vectorized:
        q, kv = _randn(9, 4, 8, seed=13), _randn(2, 2, 9, 8, seed=14)
        torch.testing.assert_close(capped.causal_attention(q, kv[0], kv[1], 0, 0.3),
                                   kernels.causal_attention(q, kv[0], kv[1], 0, 0.3),
                                   rtol=1e-6, atol=1e-6)


@needs_kernels
def test_emulated_avx512_build_needs_simde_and_runs_the_avx512_functions(kernels, monkeypatch,
                                                                         tmp_path):
    """``PDLAB_CPU_KERNELS_ISA=avx512-emulated`` (``make test-avx512-emulated``): without
    SIMDe's headers the build says where they go; in that run itself the loaded library
    runs the AVX-512 functions, so this file's ``avx512`` cases are not skipped there."""
    if os.environ.get(cpu_kernels.ISA_ENV) == cpu_kernels.EMULATED_AVX512:
        assert kernels.linear_avx512
    monkeypatch.setenv(cpu_kernels.ISA_ENV, cpu_kernels.EMULATED_AVX512)
    monkeypatch.setenv(cpu_kernels.SIMDE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=r"needs SIMDe's headers in .*fetch_simde\.py"):
        cpu_kernels.build()


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="-mno-avx2 is an x86 flag")
def test_linear_scalar_fallback_without_avx2_equals_f_linear():
    """Built for a CPU without AVX2/FMA: the same packing, scalar loops, same results; the
    runner would not pick it (``linear_vectorized`` is False)."""
    scalar = cpu_kernels.Kernels(cpu_kernels.build(extra_flags=("-mno-avx2", "-mno-fma")))
    assert not scalar.linear_vectorized
    w, b, x = _randn(20, 9, seed=4), _randn(20, seed=5), _randn(7, 9, seed=6)
    torch.testing.assert_close(scalar.linear(x, scalar.pack_linear(w), b, 20),
                               F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    q, store = _randn(2, 4, 20, seed=7), _randn(2, 2, 3, 4, 20, seed=8)  # 3 blocks of 4
    tables, lens = torch.tensor([[2, 0], [1, 0]]), torch.tensor([5, 3])
    torch.testing.assert_close(scalar.decode_attention(q, store, tables, lens, 0.3),
                               _paged_reference(q, store, tables, lens, 0.3),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="causal_attention needs a build for AVX2"):
        scalar.causal_attention(q[:, :2], store[0, :, 0, :2], store[1, :, 0, :2], 0, 0.3)


def _paged_reference(q, store, tables, lens, scale):
    """SDPA over each row's blocks gathered into one sequence, key padding masked."""
    n, hq, d = q.shape
    _, hkv, _, block, _ = store.shape
    length = tables.shape[1] * block
    kv = store[:, :, tables].reshape(2, hkv, n, length, d).transpose(1, 2)  # [2, n, H_kv, T, D]
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(n, hkv, hq // hkv, d), kv[0], kv[1],
                                         attn_mask=mask, scale=scale)
    return out.reshape(n, hq, d)


@needs_kernels
@pytest.mark.parametrize("n,kv_heads,group,d,block", [(16, 3, 3, 64, 16), (5, 2, 4, 128, 8),
                                                      (3, 1, 1, 80, 4), (2, 2, 2, 20, 1)])
def test_decode_attention_equals_sdpa_over_gathered_blocks(kernels, n, kv_heads, group, d,
                                                           block):
    """Scattered block tables (a permutation of the store's blocks), each row its own length
    (partial last blocks), q rows of the fused QKV output; the blocks no row uses and the
    tokens past each row's end hold NaN, which must not be read."""
    max_blocks = 5
    store = torch.full((2, kv_heads, n * max_blocks + 3, block, d), float("nan"))
    order = torch.randperm(store.shape[2], generator=torch.Generator().manual_seed(9))
    tables = order[:n * max_blocks].view(n, max_blocks).contiguous()
    lens = torch.randint(1, max_blocks * block + 1, (n,),
                         generator=torch.Generator().manual_seed(10))
    lens[0] = max_blocks * block
    values = _randn(2, kv_heads, n, max_blocks * block, d, seed=11)
    for r, used in enumerate(lens.tolist()):
        for t in range(used):
            store[:, :, tables[r, t // block], t % block] = values[:, :, r, t]
    q = _randn(n, kv_heads * (group + 2), d, seed=12)[:, :kv_heads * group]
    ref = _paged_reference(q, store.nan_to_num(), tables, lens, d ** -0.5)
    got = kernels.decode_attention(q, store, tables, lens, d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("avx512", [
    pytest.param(False, id="avx2", marks=needs_vector_kernels),
    pytest.param(True, id="avx512", marks=needs_avx512)])
@pytest.mark.parametrize("n,start,kv_heads,group,d", [(256, 0, 3, 3, 64), (1, 0, 1, 1, 8),
                                                      (13, 5, 2, 2, 40), (37, 0, 1, 4, 80),
                                                      (100, 33, 3, 3, 64), (12, 20, 1, 2, 32),
                                                      (7, 0, 1, 1, 17)])
def test_causal_attention_equals_sdpa_with_a_lower_right_mask(kernels, avx512, n, start,
                                                              kv_heads, group, d):
    """pdlab's chunk attention on the AVX2 (6 x 16) and AVX-512 (12 x 32) GEMM blocks: q rows
    of the fused QKV output, K/V a slice of the store (heads apart, rows contiguous); row
    blocks of 1-6 / 1-12 (13 = 7 + 6, 37 = 4 x 9 + 1 ...), key panels cut by the causal
    diagonal and by the context's end, head dims 8-80 (partial 16- and 32-dim panels: masked
    stores; 17 leaves one column), a cached prefix (start > 0)."""
    causal = kernels.causal_attention512 if avx512 else kernels.causal_attention
    qkv = _randn(n, kv_heads * group * d + 7, seed=n)
    q = qkv[:, :kv_heads * group * d].view(n, kv_heads * group, d)
    store = _randn(2, kv_heads, start + n + 4, d, seed=start)
    k, v = store[0, :, :start + n], store[1, :, :start + n]
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 0),
                                         v.repeat_interleave(group, 0), attn_mask=mask,
                                         scale=d ** -0.5).transpose(0, 1)
    torch.testing.assert_close(causal(q, k, v, start, d ** -0.5), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"k/v \[H_kv, start \+ n, D\]"):
        causal(q, k, v, start + 1, d ** -0.5)


@needs_kernels
def test_gemm_and_attention_wrappers_refuse_what_they_cannot_read(kernels):
    panels = kernels.pack_linear(torch.ones(16, 8))
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        kernels.linear(torch.ones(2, 8, dtype=torch.float64), panels, None, 16)
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        kernels.linear(torch.ones(2, 9), panels, None, 16)
    store, tables = torch.ones(2, 1, 2, 4, 8), torch.tensor([[1]])
    with pytest.raises(ValueError, match="contiguous heads"):
        kernels.decode_attention(torch.ones(1, 8, 2).transpose(1, 2), store, tables,
                                 torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match="int64 CPU lens"):
        kernels.decode_attention(torch.ones(1, 2, 8), store, tables, torch.tensor([4.0]), 1.0)
    for bad_len, bad_table in ((0, tables), (5, tables), (4, torch.tensor([[2]]))):
        with pytest.raises(ValueError, match=r"lengths must be in 1 \.\. 4 and blocks in 0 \.\. 1"):
            kernels.decode_attention(torch.ones(1, 2, 8), store, bad_table,
                                     torch.tensor([bad_len]), 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear(torch.ones(2, 8), panels, torch.ones(8), 16)
    if kernels.linear_avx512:
        wide = kernels.pack_linear512(torch.ones(32, 8))
        with pytest.raises(ValueError, match="float32 CPU rows of 8"):
            kernels.linear512(torch.ones(2, 9), wide, None, 32)
        with pytest.raises(ValueError, match="float32 CPU rows of 8"):
            kernels.linear512(torch.ones(2, 8), panels, None, 16)  # 16-column panels
        with pytest.raises(ValueError, match="bias must be"):
            kernels.linear512(torch.ones(2, 8), wide, torch.ones(8), 32)


@needs_vector_kernels
def test_c_gemm_and_paged_attention_compete_only_with_one_torch_thread(tiny, monkeypatch):
    """The one-thread rule (``engine/ops.py``): with one torch thread pdlab's GEMM and the
    paged attention are candidates (forcing them runs them); with more threads they are not,
    forcing them is refused, and the threaded kernels give equal results."""
    monkeypatch.setenv(ops.FORCE_ENV, "linear=pdlab,decode_attention=paged")
    runner = ModelRunner(tiny.model, KVStore(tiny.kv_spec, 4, 8))
    qkv = runner.layers[0].qkv
    assert runner.ops.linear_candidates == ["mkl", *(["onednn"] if ops.ONEDNN else []), "pdlab",
                                            "pdlab-hwpf", *(["pdlab512"] if HAS_AVX512 else [])]
    assert runner.ops.decode_candidates == ["planned", "paged"]
    assert {type(k).__name__ for k in qkv.fused.by_bucket} == {"_PdlabGemm"}
    assert runner.ops.decode_layout(16, None) == "paged"
    x = _randn(16, qkv.weight.shape[1], seed=12)
    with torch.inference_mode():
        on_c = qkv.fused(x)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.raises(ValueError, match="linear=pdlab is not available here"):
        ModelRunner(tiny.model, KVStore(tiny.kv_spec, 4, 8))
    monkeypatch.setenv(ops.FORCE_ENV, "linear=mkl")
    threaded = ModelRunner(tiny.model, KVStore(tiny.kv_spec, 4, 8))
    assert threaded.ops.linear_candidates == ["mkl", *(["onednn"] if ops.ONEDNN else [])]
    assert threaded.ops.decode_candidates == ["planned"]
    assert threaded.ops.decode_layout(16, None) == "planned"
    with torch.inference_mode():
        torch.testing.assert_close(on_c, threaded.layers[0].qkv.fused(x), rtol=1e-5, atol=1e-5)


def test_detection_keeps_other_modules_on_their_own_forward():
    """Only the plain RMSNorm form and SiLU are taken over; anything else keeps its module."""
    assert runner_mod._Norm.of(torch.nn.LayerNorm(8)).weight is None  # has a bias: not RMS
    assert runner_mod._Norm.of(LlamaRMSNorm(8)).weight is not None
    assert runner_mod._is_silu(torch.nn.SiLU(), "cpu")
    assert not runner_mod._is_silu(torch.nn.GELU(approximate="tanh"), "cpu")


def _greedy(loaded, prompts, max_tokens=6, budget=96):
    engine = Engine(loaded, EngineConfig(max_num_seqs=len(prompts), max_model_len=96,
                                         max_num_batched_tokens=budget))
    outputs = engine.generate([Request(f"k{i}", tuple(p), SamplingParams(max_tokens=max_tokens))
                               for i, p in enumerate(prompts)])
    assert engine.is_empty()
    return engine, [outputs[f"k{i}"] for i in range(len(prompts))]


# Every choice the selector can make (engine/kernel_choice.py), forced: each GEMM candidate
# and each decode layout, and the reference backend.
FORCED = ["linear=mkl,decode_attention=planned", "linear=onednn,decode_attention=paged",
          "linear=pdlab,decode_attention=paged", "linear=pdlab,decode_attention=planned",
          "linear=pdlab512,decode_attention=paged,chunk_attention=pdlab512",
          "linear=onednn,decode_attention=planned,chunk_attention=pdlab512",
          "linear=mkl,decode_attention=paged,chunk_attention=pdlab",
          "linear=pdlab-hwpf,decode_attention=paged", "backend=torch"]


@needs_vector_kernels
@pytest.mark.parametrize("force", FORCED)
def test_engine_under_every_kernel_choice_matches_generate(tiny, monkeypatch, force):
    if "onednn" in force and not ops.ONEDNN:
        pytest.skip("this torch has no oneDNN linear")
    if "pdlab512" in force and not HAS_AVX512:  # noqa: SIM102
        pytest.skip("this CPU has no avx512f")
    monkeypatch.setenv(ops.FORCE_ENV, force)
    prompts = random_prompts([1, 9, 40], seed=21)
    engine, got = _greedy(tiny, prompts, budget=16)  # chunked, mixed prefill + decode steps
    backend = engine.runner.ops
    assert backend.name == ("torch" if force == "backend=torch" else "cpu")
    if backend.name == "cpu":  # the forced kernels really ran
        forced = dict(part.split("=") for part in force.split(","))
        assert {k.name for k in engine.runner.layers[0].qkv.fused.by_bucket} == {forced["linear"]}
        assert backend.decode_layout(3, None) == forced["decode_attention"]
        if "chunk_attention" in forced:
            assert set(backend.chunk_choices.values()) == {forced["chunk_attention"]}
        assert backend.c_elementwise is not None
    assert got == [reference_generate(tiny.model, p, 6) for p in prompts]


@needs_kernels
def test_engine_with_measured_kernels_matches_generate(tiny):
    """Whatever the selector measured fastest here (cached per machine)."""
    prompts = random_prompts([1, 9, 40], seed=21)
    engine, got = _greedy(tiny, prompts, budget=16)
    assert engine.runner.ops.kernels is not None  # the fast path really ran
    described = engine.runner.ops.describe()
    assert set(described["linear"]) == {"64x128", "64x64", "64x256", "128x64", "64x256/lm_head"}
    second = ModelRunner(tiny.model, KVStore(tiny.kv_spec, 4, 8))  # layers prepared already
    assert second.ops.describe()["linear"] == described["linear"]
    assert got == [reference_generate(tiny.model, p, 6) for p in prompts]


@pytest.mark.parametrize("how", ["env", "no_compiler", "build_fails"])
def test_fallback_without_kernels_matches_generate(tiny, monkeypatch, tmp_path, how):
    """No kernels (switched off, no compiler, or a compiler that fails): the pure-PyTorch path
    runs, with a warning where the build was tried, and still equals generate()."""
    monkeypatch.setattr(cpu_kernels, "_LOADED", {})  # forget this process's loaded library
    monkeypatch.setenv("PDLAB_CACHE_DIR", str(tmp_path))  # and any cached build
    if how == "env":
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
        assert cpu_kernels.load() is None
    else:
        if how == "no_compiler":
            monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
        else:
            monkeypatch.setenv("CC", "false")  # exists, always exits 1
        with pytest.warns(RuntimeWarning, match="CPU kernels unavailable"):
            assert cpu_kernels.load() is None
    prompts = random_prompts([1, 9, 40], seed=22)
    engine, got = _greedy(tiny, prompts, budget=16)
    assert engine.runner.ops.kernels is None
    assert got == [reference_generate(tiny.model, p, 6) for p in prompts]


@needs_kernels
@pytest.mark.parametrize("name", ["tiny-random-llama", "tiny-random-qwen3", "tiny-random-gemma2",
                                  "tiny-random-phi3"])
def test_fast_path_logits_equal_torch_path(name, monkeypatch):
    """A prompt in two chunks, then a decode step, kernels on and off: the logits agree to
    float32 rounding. Llama takes every fused op; Qwen3 (q/k norms), Gemma 2 ((1 + w) norms,
    sandwich norms, GELU, soft-caps) and Phi-3 (partial rotary) mix fused and module ops."""
    loaded = load_model(ModelConfig(name))
    prompt = random_prompts([13], seed=23)[0]
    logits = {}
    for on in (True, False):
        if not on:  # every kernel off, the GEMMs included (the projections re-prepared)
            monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        runner = ModelRunner(loaded.model, KVStore(loaded.kv_spec, 4, 8))
        assert (runner.ops.kernels is not None) == on
        state = RequestState(Request("x", tuple(prompt), SamplingParams(max_tokens=2)))
        state.block_ids = [2, 0, 3, 1]
        steps = []
        for num_new in (6, len(prompt) - 6, 1):
            if num_new == 1:
                state.token_ids.append(int(steps[-1][0].argmax()))
            batch = ScheduledBatch()
            batch.add(state, num_new)
            steps.append(runner.execute(batch))
            state.num_computed_tokens += num_new
        logits[on] = torch.cat(steps)
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
