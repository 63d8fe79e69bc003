"""The fused CPU kernels (``engine/cpu_kernels.py``, issue 10): each equals the torch ops it
replaces (RMSNorm and SiLU to float32 rounding, RoPE and the K/V write bit for bit), the
runner detects which modules they may stand in for, refuses what they cannot take, and the
engine equals generate() with them and without them (no compiler, a failing build, or
``PDLAB_CPU_KERNELS=0``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference_generate
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine import cpu_kernels
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
    want_q = runner_mod._apply_rope(q, cos[:, None], sin[:, None])
    flat = want_store[1].view(2, kv_heads, -1, d)
    flat[0].index_copy_(1, slots, runner_mod._apply_rope(k, cos[:, None], sin[:, None])
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
@pytest.mark.parametrize("rows,n,k", [(1, 960, 576), (16, 48, 33), (13, 17, 8), (257, 40, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(kernels, rows, n, k, bias):
    """Every block split (1..6 rows), a partial last panel (n % 16), rows of a wider tensor."""
    w, b = _randn(n, k, seed=1) * k ** -0.5, (_randn(n, seed=2) if bias else None)  # out ~1
    x = _randn(rows, k + 3, seed=3)[:, 2:2 + k]  # rows k + 3 apart, each contiguous
    panels = kernels.pack_linear(w)
    assert panels.shape == (-(-n // 16), k, 16)
    torch.testing.assert_close(kernels.linear(x, panels, b, n), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-5)


@needs_kernels
def test_linear_scalar_fallback_without_avx2_equals_f_linear():
    """Built for a CPU without AVX2/FMA: the same packing, scalar loops, same results; the
    runner would not pick it (``linear_vectorized`` is False)."""
    scalar = cpu_kernels.Kernels(cpu_kernels.build(extra_flags=("-mno-avx2", "-mno-fma")))
    assert not scalar.linear_vectorized
    w, b, x = _randn(20, 9, seed=4), _randn(20, seed=5), _randn(7, 9, seed=6)
    torch.testing.assert_close(scalar.linear(x, scalar.pack_linear(w), b, 20),
                               F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    q, kv = _randn(2, 4, 20, seed=7), _randn(2, 2, 2, 5, 20, seed=8)
    lens = torch.tensor([5, 3])
    mask = (torch.arange(5)[None, :] < lens[:, None])[:, None, None, :]
    torch.testing.assert_close(
        scalar.decode_attention(q, kv[0], kv[1], lens, 0.3),
        F.scaled_dot_product_attention(q.view(2, 2, 2, 20), kv[0], kv[1], attn_mask=mask,
                                       scale=0.3).reshape(2, 4, 20), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n,kv_heads,group,d,length", [(16, 3, 3, 64, 130), (5, 2, 4, 128, 37),
                                                       (3, 1, 1, 80, 9), (2, 2, 2, 20, 1)])
def test_decode_attention_equals_sdpa_with_key_padding(kernels, n, kv_heads, group, d, length):
    """Strided K/V views (as of the paged store), q rows of the fused QKV output, each row
    its own KV length (the rest of the view is garbage it must not read: NaN here)."""
    store = _randn(2, n, kv_heads, length + 4, d, seed=9)
    lens = torch.randint(1, length + 1, (n,), generator=torch.Generator().manual_seed(10))
    lens[0] = length
    for r, used in enumerate(lens.tolist()):
        store[:, r, :, used:] = float("nan")  # past each row's end
    k, v = store[0, :, :, :length], store[1, :, :, :length]
    q = _randn(n, kv_heads * (group + 2), d, seed=11)[:, :kv_heads * group]
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.reshape(n, kv_heads, group, d),
                                         k.nan_to_num(), v.nan_to_num(), attn_mask=mask)
    got = kernels.decode_attention(q, k, v, lens, d ** -0.5)
    torch.testing.assert_close(got, ref.reshape(n, kv_heads * group, d), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_gemm_and_attention_wrappers_refuse_what_they_cannot_read(kernels):
    panels = kernels.pack_linear(torch.ones(16, 8))
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        kernels.linear(torch.ones(2, 8, dtype=torch.float64), panels, None, 16)
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        kernels.linear(torch.ones(2, 9), panels, None, 16)
    kv = torch.ones(1, 1, 4, 8)
    with pytest.raises(ValueError, match="contiguous tokens"):
        kernels.decode_attention(torch.ones(1, 2, 8), kv.transpose(2, 3), kv.transpose(2, 3),
                                 torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match="int64 lens"):
        kernels.decode_attention(torch.ones(1, 2, 8), kv, kv, torch.tensor([4.0]), 1.0)


@needs_kernels
def test_projections_run_on_the_c_gemm_up_to_its_row_limit(tiny, monkeypatch):
    """The packed kernel replaces oneDNN's copy (one extra weight copy, not two) and runs
    1 .. _C_GEMM_MAX_ROWS rows with one torch thread; otherwise torch's kernels run."""
    runner = ModelRunner(tiny.model, KVStore(tiny.kv_spec, 4, 8))
    qkv, head = runner.layers[0].qkv, runner.lm_head
    assert qkv.panels is not None and qkv.packed is None and head.panels is not None
    edge = runner_mod._C_GEMM_MAX_ROWS
    assert [qkv._use_c_kernel(n) for n in (1, 16, edge, edge + 1)] == [True, True, True, False]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not qkv._use_c_kernel(16)


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


@needs_kernels
def test_engine_with_kernels_matches_generate(tiny):
    prompts = random_prompts([1, 9, 40], seed=21)
    engine, got = _greedy(tiny, prompts, budget=16)  # chunked, mixed prefill + decode steps
    assert engine.runner.kernels is not None  # the fast path really ran
    assert engine.runner.layers[0].qkv.panels is not None  # and its GEMM
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
    assert engine.runner.kernels is None
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
        assert (runner.kernels is not None) == on
        assert (runner.layers[0].qkv.panels is not None) == on
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
