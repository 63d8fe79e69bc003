"""ScheduledBatch -> logits: the only code that calls the model.

One step is one forward over every scheduled token, prompt chunks and decodes together:

1. The new tokens of all requests are packed into one ``[N]`` sequence with their positions.
2. Each layer projects Q/K/V for all N tokens at once (one fused matmul), applies RoPE with
   the tables of the model's own rotary module, and writes only the new K/V into the
   requests' KV blocks at their flat positions ``block * B + offset`` (``index_copy_``, or
   inside the fused RoPE kernel below).
3. Attention: single-token entries (decodes) run as batched SDPAs with a per-row length
   mask, reading the KV blocks in place wherever they can (``_plan_decodes``): a request's
   blocks are usually consecutive (the allocator's first fit), so its KV is one token range
   of the store's ``[H_kv, NB * B, D]`` per layer, and rows whose ranges start equally spaced
   (requests of equal size admitted in turn) are one strided view ``[rows, H_kv, T, D]``,
   exactly the slot store's view this design replaced. Each such run is split by KV length
   (``_group_decodes``) so short rows do not read up to the longest row's length; a row on
   its own is a view of its own range; rows with scattered blocks are gathered per layer
   (one ``index_select`` over the block axis into a reused buffer: a decode step of 64 such
   rows took 1.4x the in-place one on the CPU measured, benchmarks/README.md). GQA without
   copying K/V: the G query heads that share a KV head are folded into the query-length
   axis, ``[H_q, 1, D] -> [H_kv, G, D]``. Each multi-token prompt chunk runs flash
   attention over its request's blocks (a view when they are consecutive, as the allocator
   makes them unless the free list is fragmented; else a gather) at the cost of the causal
   FLOPs (``_chunk_attention``: ``is_causal`` for a first chunk; prefix + causal diagonal
   merged by log-sum-exp for a later one). CUDA runs the same plan (views, ``index_select``); FlexAttention's paged
   ``block_mask`` would read blocks in place at any spacing, at the price of a compiled
   kernel per shape (not done: no GPU to measure it on). On CPU in float32 with one torch
   thread (kernels built for AVX2/FMA, no soft-capping) none of that planning runs: every
   decode row of the step is one paged C call per layer (``_paged_group``,
   ``cpu_kernels.decode_attention``: each row's blocks read in place through its block
   table, to its own length), because torch's CPU flash kernel blocks queries by 32+ rows
   and a decode row has G per KV head (~7-17 GFLOP/s there), and a group needs a view or a
   copy (benchmarks/README.md, "A GEMM kernel for decode rows").
4. Only the last position of each request that completes this step goes through the final
   norm and LM head.

Elementwise work. On CPU with a float32 model and store, the chains of small torch ops
between the matmuls run as three fused C kernels (``engine/cpu_kernels.py``, built once per
machine with the system C compiler, called through ctypes): the residual add with the RMSNorm
that follows it (``_add_norm``; the residual stream is updated in place), RoPE on q in place
and on k with the K/V write into the store (``rope_kv``), and SiLU(gate) * up (``_mlp``).
With the fewer-ops changes around them (``mm`` for ``F.linear``, one split for q/k/v, views
made once) a SmolLM2 decode step at B = 1 went from ~1,900 top-level torch ops to ~490 and
took ~0.87x the time on the CPU measured (benchmarks/README.md, "Fused elementwise
kernels"). Each stands in for a module only where it computes the module's formula, checked
at _prepare on a probe input bit for bit (``_Norm``: Llama-style ``w * x / rms`` or Gemma's
``(1 + w)`` folded; ``_is_silu``; RoPE only with full rotary): anything else (q/k norms,
sandwich norms, GELU, partial rotary) runs its own module's forward, so the forward is
transformers' to float32 rounding (RMSNorm's sum order, exp's last bits; RoPE bit for bit).
Where the kernels cannot be built (no compiler, a failed build, ``PDLAB_CPU_KERNELS=0``), on
CUDA and for other dtypes, the same ops run in PyTorch: the modules' forwards, RoPE over q
and k in one call where they are adjacent, in-place residual adds.

One residual-block shape (``_Layer``) covers every family that
``engine/model.py`` accepts (``SUPPORTED_ARCHITECTURES``; anything else is refused at load):
optional per-head q/k norms (Qwen3, Gemma 3), optional sandwich norms around attention and MLP
(Gemma 2/3), fused QKV / gate-up projections (Phi-3), partial rotary (Phi-3), per-layer-type
RoPE tables (Gemma 3), a non-default attention scale and attention / final logit soft-capping
(Gemma); embedding scaling is inside Gemma's own embedding module. The projections use the
layers' own weights through ``_Linear``: Q/K/V fused into one matmul and gate/up into another
(the modules' weights become views of the fused tensor, so there is one copy; Phi-3's already
fused ones as they are). On CPU in float32 each fused weight is also packed once more, and
each matmul runs on whichever kernel was measured faster for its row count: where the C
kernels build for AVX2/FMA, pdlab's own GEMM (``cpu_kernels.linear``, 16-column panels) for
1-256 rows with one torch thread (the workers' configuration: ``engine.device.bind_device``)
and MKL's sgemm beyond; without them, oneDNN's reordered weight for 2-63 rows and MKL for one
row and for 64 or more (through ``mm`` / ``addmm`` directly). Results agree with
``F.linear`` to float32 rounding. Elsewhere ``_Linear`` is ``mm`` / ``addmm``, what
``F.linear`` runs. The packed weights (a second copy of the projection and LM-head weights)
are built once per model and shared by every runner of that model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine import cpu_kernels
from engine.kv_cache import KVStore
from engine.scheduler import ScheduledBatch

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_BATCH_HINT = 16  # oneDNN's reorder takes an M hint; the packed weight serves any M
# From this many rows a matmul runs on MKL (``F.linear``), below it on packed oneDNN (N = 1
# aside): the crossover measured at SmolLM2's projection shapes (``_Linear``).
_BLAS_MIN_ROWS = 64
# Up to this many rows a matmul runs on pdlab's own kernel (``cpu_kernels.linear``) where it
# is built and torch has one thread: the crossover with MKL measured at SmolLM2's shapes
# (benchmarks/README.md, "A GEMM kernel for decode rows").
_C_GEMM_MAX_ROWS = 256
# CPU flash attention returning (out [B, H, L, D], logsumexp [B, H, L]); GQA without a copy.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """As transformers' ``rotate_half`` (Llama RoPE, Su et al. 2021)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[N, H, D]`` with ``cos``/``sin`` ``[N, 1, R]``: the first R <= D dims
    rotate, the rest pass (partial rotary, as transformers' Phi-3 ``apply_rotary_pos_emb``)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _sdpa(q, k, v, attn_mask=None, scale: float | None = None,
          softcap: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (boolean mask, True = attend; ``scale`` None =
    1/sqrt(D)), plus attention-logit soft-capping ``softcap * tanh(scores / softcap)``, which
    SDPA lacks, done the eager way as transformers' Gemma 2 ``eager_attention_forward``
    (scores scaled, capped, masked, softmax in float32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class _Linear:
    """One or more projections of the same input, run as one matmul:
    ``x [N, in] -> (x @ W_i.T + b_i for each module i)``, the output split into per-module
    views.

    Several modules (Q/K/V, gate/up) are fused once: their weights are concatenated and each
    module's ``weight`` becomes a view of its rows of that tensor (same values, no second
    copy; transformers' own forward reads the same memory). CPU float32: the
    fused weight is also packed once (a copy) and each call picks the kernel by its row
    count ``N``. Where the C kernels are built for AVX2/FMA (``kernels`` given), the copy is
    pdlab's panel layout and ``N <= _C_GEMM_MAX_ROWS`` runs ``cpu_kernels.linear`` with one
    torch thread (``_use_c_kernel``): over a whole forward's matmuls it took 0.63-0.94x the
    better of torch's two kernels from 1 to 256 rows (benchmarks/README.md, "A GEMM kernel
    for decode rows"). Otherwise the copy is oneDNN's blocked layout (``_use_onednn``),
    because neither of torch's kernels wins at every ``N`` ("Kernel choice"): MKL's sgemm
    (``F.linear``) takes 0.56-0.84x oneDNN's time at ``N = 1`` (GEMV) and 0.89-0.99x from
    ``N = _BLAS_MIN_ROWS``; the packed oneDNN kernel takes 0.74-0.8x MKL's time for
    ``N = 2 .. 48``. All are float32 to rounding (max error ~1e-6 of the output scale).
    Elsewhere (CUDA, other dtypes): ``F.linear`` on the fused weight.
    """

    def __init__(self, modules: list[torch.nn.Linear], split: list[int] | None = None,
                 gemv_onednn: bool = False, kernels: cpu_kernels.Kernels | None = None) -> None:
        self.modules = modules
        # A fused module (Phi-3's qkv_proj, gate_up_proj) is one matmul split into ``split``.
        self.sizes = split or [m.out_features for m in modules]
        # N = 1 on oneDNN instead of MKL: the LM head (576 x 49152), where oneDNN was faster.
        self.gemv_onednn = gemv_onednn
        self.packed = None  # oneDNN's reordered copy of the weight
        self.panels, self.kernels = None, None  # pdlab's own packed copy, its kernels
        with torch.no_grad():
            self.weight, self.bias = modules[0].weight, modules[0].bias
            if len(modules) > 1:
                self.weight = torch.cat([m.weight for m in modules])
                for m, rows in zip(modules, self.weight.split(self.sizes)):
                    m.weight.data = rows  # a view of the fused weight: one copy in memory
                if any(m.bias is not None for m in modules):
                    self.bias = torch.cat([m.bias if m.bias is not None else
                                           self.weight.new_zeros(m.out_features)
                                           for m in modules])
            self.weight_t = self.weight.t()  # [in, out] view
            # oneDNN's copy is made now, or with pdlab's kernel only on the first call that
            # needs it (more than one torch thread), so a worker holds one extra copy.
            self._onednn_pending = (_ONEDNN and self.weight.device.type == "cpu"
                                    and self.weight.dtype == torch.float32)
            if not self._onednn_pending:
                return
            if kernels is not None and kernels.linear_vectorized:  # pdlab's kernel instead
                self.kernels, self.panels = kernels, kernels.pack_linear(self.weight.contiguous())
            else:
                self._pack_onednn()

    def _pack_onednn(self) -> None:
        """``packed``: the weight reordered into oneDNN's blocked layout (None where this
        build's oneDNN cannot pack it: ``mm`` only)."""
        self._onednn_pending = False
        try:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                      _PACK_BATCH_HINT)
        except RuntimeError:
            self.packed = None

    def _use_c_kernel(self, num_rows: int) -> bool:
        """True where pdlab's packed kernel runs ``num_rows`` rows: it was the faster one up
        to ``_C_GEMM_MAX_ROWS``, and it is single-threaded, so with more torch threads the
        threaded BLAS runs instead."""
        return (self.panels is not None and num_rows <= _C_GEMM_MAX_ROWS
                and torch.get_num_threads() == 1)

    def _use_onednn(self, num_rows: int) -> bool:
        """True where the packed oneDNN kernel was the faster one for ``num_rows`` rows
        (packing it on first use where pdlab's kernel made it unneeded until now)."""
        if num_rows >= _BLAS_MIN_ROWS or not (num_rows > 1 or self.gemv_onednn):
            return False
        if self._onednn_pending:
            self._pack_onednn()
        return self.packed is not None

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, in]`` -> the unsplit output ``[N, sum(sizes)]`` (contiguous). The MKL
        path calls ``mm`` / ``addmm`` on the transposed weight directly: what ``F.linear``
        runs for a 2-D input, without its three dispatch layers (``linear``, ``t``,
        ``matmul``) per call."""
        if self._use_c_kernel(x.shape[0]):
            return self.kernels.linear(x, self.panels, self.bias, self.weight.shape[0])
        if self._use_onednn(x.shape[0]):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.fused(x)
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)


def _probe(width: int, device) -> torch.Tensor:
    """A fixed ``[2, width]`` float32 input for checking a module's formula at _prepare."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, width, generator=gen) * 3).to(device)


@dataclass
class _Norm:
    """An RMSNorm module, plus what the fused path needs where the module is the plain form
    ``out = w' * (x * rsqrt(mean(x^2, -1) + eps))`` (Zhang & Sennrich 2019): Llama-style norms
    (``w' = weight``: Llama, Mistral, Qwen2/3, Phi-3) and Gemma's (``w' = 1 + weight``,
    folded once here). Which form, if any, is decided on a probe input at _prepare: the
    formula must reproduce the module's output bit for bit (``torch.equal``), else ``weight``
    is None and only the module's own forward is used."""

    module: torch.nn.Module
    weight: torch.Tensor | None  # [H] float32, contiguous; None: not the plain form
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Norm:
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 1
                or weight.dtype != torch.float32 or not isinstance(eps, float)):
            return cls(module, None, 0.0)
        with torch.no_grad():
            probe = _probe(weight.shape[0], weight.device)
            expected = module(probe)
            normed = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps)
            for folded in (weight.detach(), 1.0 + weight.detach()):  # Llama's, Gemma's
                if torch.equal(folded * normed, expected):
                    return cls(module, folded.contiguous(), eps)
        return cls(module, None, 0.0)


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor], device) -> bool:
    """True if ``act`` computes ``F.silu`` (checked on a probe input, bit for bit)."""
    with torch.no_grad():
        probe = _probe(64, device)
        try:
            return torch.equal(act(probe), F.silu(probe))
        except (RuntimeError, TypeError):
            return False


@dataclass
class _Layer:
    """One decoder layer's modules, projections grouped by shared input. One residual block
    order serves every supported family (engine/model.py ``SUPPORTED_ARCHITECTURES``)::

        h = h + attn_out_norm(o(attention(rope(q_norm(q)), rope(k_norm(k)), v)))  # of input_norm(h)
        h = h + mlp_out_norm(down(act(gate) * up))                               # of mlp_norm(h)

    where the optional norms (None: identity) are Qwen3/Gemma 3's per-head q/k RMSNorm and
    Gemma 2/3's sandwich norms; Llama's ``post_attention_layernorm`` is ``mlp_norm``,
    Gemma's is ``attn_out_norm`` (its ``pre_feedforward_layernorm`` is ``mlp_norm``).
    """

    input_norm: _Norm
    qkv: _Linear  # -> q [N, H_q*D], k [N, H_kv*D], v [N, H_kv*D]
    q_norm: torch.nn.Module | None  # over D, per head
    k_norm: torch.nn.Module | None
    o: _Linear
    attn_out_norm: torch.nn.Module | None
    mlp_norm: _Norm
    gate_up: _Linear  # -> gate [N, I], up [N, I]
    down: _Linear
    mlp_out_norm: torch.nn.Module | None
    act: Callable[[torch.Tensor], torch.Tensor]
    act_is_silu: bool  # act is SiLU: the fused SiLU(gate) * up applies
    rope_key: str | None  # the layer type whose RoPE table it uses (Gemma 3), else None
    scale: float  # attention logit scale (Gemma: query_pre_attn_scalar**-0.5)
    softcap: float | None  # attention logit soft-cap (Gemma 2)

    @classmethod
    def of(cls, layer, cfg, per_type_rope: bool,
           kernels: cpu_kernels.Kernels | None = None) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        linear = lambda mods, split=None: _Linear(mods, split, kernels=kernels)  # noqa: E731
        q_size = cfg.num_attention_heads * attn.head_dim
        kv_size = cfg.num_key_value_heads * attn.head_dim
        if hasattr(attn, "qkv_proj"):  # Phi-3: fused, q then k then v
            qkv = linear([attn.qkv_proj], [q_size, kv_size, kv_size])
        else:
            qkv = linear([attn.q_proj, attn.k_proj, attn.v_proj])
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: fused, gate then up
            gate_up = linear([mlp.gate_up_proj], [cfg.intermediate_size] * 2)
        else:
            gate_up = linear([mlp.gate_proj, mlp.up_proj])
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma 2/3
        act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        return cls(
            input_norm=_Norm.of(layer.input_layernorm), qkv=qkv,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
            o=linear([attn.o_proj]),
            attn_out_norm=layer.post_attention_layernorm if sandwich else None,
            mlp_norm=_Norm.of(layer.pre_feedforward_layernorm if sandwich
                              else layer.post_attention_layernorm),
            gate_up=gate_up, down=linear([mlp.down_proj]),
            mlp_out_norm=layer.post_feedforward_layernorm if sandwich else None,
            act=act, act_is_silu=_is_silu(act, qkv.weight.device),
            rope_key=attn.layer_type if per_type_rope else None,
            scale=attn.scaling, softcap=getattr(attn, "attn_logit_softcapping", None))


# Prepared layers per model, shared by every runner (and engine) of that model.
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepare(model, kernels: cpu_kernels.Kernels | None
             ) -> tuple[list[_Layer], _Norm, _Linear]:
    """The model's layers as ``_Layer``s, its final norm and LM head, built once per model
    (and per choice of ``kernels``: the projections' packed weights depend on it)."""
    weight = model.lm_head.weight
    key = (weight.data_ptr(), weight.dtype, kernels is not None)  # moved/cast: redo
    cached = _PREPARED.get(model)
    if cached is None or cached[0] != key:
        per_type_rope = hasattr(model.model.rotary_emb, "layer_types")  # Gemma 3
        cached = (key, [_Layer.of(layer, model.config, per_type_rope, kernels)
                        for layer in model.model.layers],
                  _Norm.of(model.model.norm),
                  _Linear([model.lm_head], gemv_onednn=True, kernels=kernels))
        _PREPARED[model] = cached
    return cached[1], cached[2], cached[3]


# Grouping decode rows (see ``_group_decodes``): one more gather + SDPA call costs about as
# much as reading this many tokens of one layer's K/V (~20 us vs ~0.1 us/token on the CPU
# measured).
_DECODE_CALL_COST_TOKENS = 256
_GROUP_DP_UNITS = 32  # split-point candidates in _group_decodes (see there)


@dataclass
class _DecodeGroup:
    """Decode rows attended by one call: an SDPA over ``[num_rows, H_kv, ctx_len, D]`` K and
    V, a strided view of the store (row r's range starts at flat token ``token_offset + r *
    stride_tokens``) or, when ``block_idx`` is set, the rows' blocks gathered; or, when
    ``block_tables`` is set, the C paged kernel reading every row's blocks in place."""

    num_rows: int
    ctx_len: int  # the longest row's KV length
    token_offset: int  # view: the first row's first flat token
    stride_tokens: int  # view: flat tokens between consecutive rows' starts
    block_idx: torch.Tensor | None  # gather: [num_rows * nb] block ids, row-major, padded
    mask: torch.Tensor | None  # [num_rows, 1, 1, ctx_len] True = attend; None: all full
    token_start: int | None  # set when row r is token token_start + r (no gather of q)
    token_idx: torch.Tensor | None  # [num_rows] token index of each row (gather path)
    # view groups: K and V of every layer at once, [L, num_rows, H_kv, ctx_len, D] strided
    # views of the store (one select per layer instead of an as_strided per layer)
    kv_views: tuple[torch.Tensor, torch.Tensor] | None = None
    # paged (C kernel): [num_rows, max_blocks] int64, each row's used blocks, 0-padded,
    # and [num_rows] int64 KV lengths
    block_tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None


@dataclass
class _StepLayout:
    """Index tensors shared by every layer of one step."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    token_slots: torch.Tensor  # [N] flat store position (block * B + offset) of each token
    decode_groups: list[_DecodeGroup]  # the single-token entries (``_plan_decodes``)
    # (token offset, n, cached tokens, the request's KV: a flat token slice when its blocks
    # are consecutive, else [ctx] flat positions to gather)
    chunks: list[tuple[int, int, int, slice | torch.Tensor]]
    sample_idx: torch.Tensor  # [num_sampled] token index whose logits are needed


class ModelRunner:
    """Runs scheduled batches through a supported decoder model (``engine.model.
    SUPPORTED_ARCHITECTURES``) against a paged ``KVStore``; requests name their KV by
    ``RequestState.block_ids``."""

    def __init__(self, model, kv_store: KVStore, device: str = "cpu") -> None:
        self.model = model
        self.kv_store = kv_store
        self.device = torch.device(device)
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        # The C kernels (engine/cpu_kernels.py) for a float32 model on CPU, where they build:
        # the projections' GEMMs, and with a float32 store the fused elementwise ones; else
        # None and the pure-PyTorch path runs.
        on_cpu_fp32 = (self.device.type == "cpu"
                       and model.lm_head.weight.dtype == torch.float32)
        kernels = cpu_kernels.load() if on_cpu_fp32 else None
        self.layers, self.final_norm, self.lm_head = _prepare(model, kernels)
        self.kernels = kernels if kv_store.kv.dtype == torch.float32 else None
        # Attention scale and soft-cap are the same in every layer of every supported family;
        # None = SDPA's own default 1/sqrt(D), so Llama-like models run exactly as before.
        self.scale = self.layers[0].scale
        self.scale = None if self.scale == self.head_dim ** -0.5 else self.scale
        self.softcap = self.layers[0].softcap
        assert all(layer.scale == self.layers[0].scale and layer.softcap == self.softcap
                   for layer in self.layers), "per-layer attention scale/soft-cap"
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3
        self._gather_buf = torch.empty(0, dtype=kv_store.kv.dtype, device=self.device)
        self._kv_views: tuple = (None, [])  # (store tensor, [(layer view, flat view)])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step.

        Args:
            batch: the scheduler's step (counters not yet advanced).
            on_layer_done: called with the layer index once that layer's K/V are in the
                store (layer-wise KV streaming hooks in here).

        Returns:
            logits ``[num_sampled, vocab]`` (float32), one row per entry ``i`` with
            ``batch.completes(i)``, in batch order.
        """
        layout = self._layout(batch)
        inner = self.model.model
        hidden = inner.embed_tokens(layout.input_ids)  # [N, hidden] (Gemma: scaled inside)
        rope = self._rope_tables(hidden, layout.positions)
        layers = self.layers
        # ``hidden`` is this step's own tensor (the embedding's output), so the residual adds
        # run in place; each add is fused with the norm that follows it (``_add_norm``).
        normed = self._add_norm(layers[0].input_norm, hidden, None)
        for layer_idx, layer in enumerate(layers):
            x = self._attention(layer, layer_idx, normed, rope[layer.rope_key], layout)
            if layer.attn_out_norm is not None:
                x = layer.attn_out_norm(x)
            normed = self._add_norm(layer.mlp_norm, hidden, x)
            x = self._mlp(layer, normed)
            if layer.mlp_out_norm is not None:
                x = layer.mlp_out_norm(x)
            if layer_idx + 1 < len(layers):
                normed = self._add_norm(layers[layer_idx + 1].input_norm, hidden, x)
            else:
                hidden.add_(x)
            if on_layer_done is not None:
                on_layer_done(layer_idx)
        last = self._add_norm(self.final_norm, hidden[layout.sample_idx], None)
        logits = self.lm_head(last)[0].float()
        if self.final_softcap is not None:  # as Gemma2ForCausalLM.forward
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _add_norm(self, norm: _Norm, hidden: torch.Tensor,
                  delta: torch.Tensor | None) -> torch.Tensor:
        """``hidden += delta`` in place (when given), then ``norm(hidden)`` ``[N, H]``: one C
        call where the kernels are loaded and the norm is the plain form (``_Norm``), else
        ``add_`` and the module's own forward."""
        if self.kernels is not None and norm.weight is not None:
            return self.kernels.add_rms_norm(hidden, delta, norm.weight, norm.eps)
        if delta is not None:
            hidden.add_(delta)
        return norm.module(hidden)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` ``[N, H]``: gate and up one matmul; SiLU and the
        product one C call where the kernels are loaded and ``act`` is SiLU."""
        if self.kernels is not None and layer.act_is_silu:
            return layer.down.fused(self.kernels.silu_mul(layer.gate_up.fused(x)))
        gate, up = layer.gate_up(x)
        return layer.down.fused(layer.act(gate) * up)

    def _rope_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """``{rope_key: (cos, sin)}``, each ``[N, R]`` (contiguous), from the model's own
        rotary module (so Llama 3 / YaRN / longrope scaling and Gemma 3's per-layer-type bases
        follow transformers). ``R`` < D for partial rotary."""
        rotary, tables = self.model.model.rotary_emb, {}
        for key in {layer.rope_key for layer in self.layers}:
            args = () if key is None else (key,)
            cos, sin = rotary(hidden, positions[None], *args)  # [1, N, R]
            tables[key] = (cos[0], sin[0])
        return tables

    def _attention(self, layer: _Layer, layer_idx: int, x: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], layout: _StepLayout) -> torch.Tensor:
        """Q/K/V of ``x [N, hidden]``, RoPE with ``rope`` = (cos, sin) ``[N, R]``, the new
        K/V into the store, attention over the requests' KV, and the output projection ->
        ``[N, hidden]``."""
        num_tokens, heads, kv_heads, head_dim = (x.shape[0], self.num_heads,
                                                  self.num_kv_heads, self.head_dim)
        qkv = layer.qkv.fused(x).view(num_tokens, heads + 2 * kv_heads, head_dim)
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)  # views, q then k then v
        if layer.q_norm is not None:  # Qwen3 / Gemma 3: RMSNorm over D, before RoPE
            q, k = layer.q_norm(q), layer.k_norm(k)
        if self._kv_views[0] is not self.kv_store.kv:  # the per-layer views, made once
            self._kv_views = (self.kv_store.kv, [
                (kv, kv.view(2, kv_heads, -1, head_dim)) for kv in self.kv_store.kv])
        kv_layer, kv_flat = self._kv_views[1][layer_idx]  # [2, H_kv, NB, B, D], [.., NB*B, D]
        cos, sin = rope
        if self.kernels is not None and cos.shape[-1] == head_dim:  # full rotary: fused
            self.kernels.rope_kv(q, k, v, cos, sin, kv_layer, layout.token_slots)
        else:
            cos, sin = cos[:, None], sin[:, None]  # [N, 1, R]: broadcast over heads
            if layer.q_norm is None:  # q and k adjacent in qkv: one RoPE over both
                qk = _apply_rope(qkv[:, :heads + kv_heads], cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            kv_flat[0].index_copy_(1, layout.token_slots, k.transpose(0, 1))  # only new tokens
            kv_flat[1].index_copy_(1, layout.token_slots, v.transpose(0, 1))
        groups, chunks = layout.decode_groups, layout.chunks
        if (len(groups) == 1 and not chunks and groups[0].token_start == 0
                and groups[0].num_rows == num_tokens):  # one decode group: no out buffer
            out = self._decode_attention(q, layer_idx, kv_layer, groups[0])
        elif not groups and len(chunks) == 1 and chunks[0][1] == num_tokens:  # one prompt
            _, n, start, where = chunks[0]
            kv = (kv_flat[:, :, where] if isinstance(where, slice)
                  else kv_flat.index_select(2, where))  # [2, H_kv, ctx, D]
            out = self._chunk_attention(q, kv[0], kv[1], start)
        else:
            out = q.new_empty(num_tokens, heads, head_dim)
            for group in groups:
                res = self._decode_attention(q, layer_idx, kv_layer, group)
                if group.token_start is not None:
                    out[group.token_start:group.token_start + group.num_rows] = res
                else:
                    out.index_copy_(0, group.token_idx, res)
            for offset, n, start, where in chunks:
                kv = (kv_flat[:, :, where] if isinstance(where, slice)
                      else kv_flat.index_select(2, where))  # [2, H_kv, ctx, D]
                out[offset:offset + n] = self._chunk_attention(q[offset:offset + n], kv[0],
                                                               kv[1], start)
        return layer.o.fused(out.reshape(num_tokens, -1))

    def _use_c_attention(self) -> bool:
        """Decode attention in C (``cpu_kernels.decode_attention``): only a vectorised build
        (scalar C would be slower than SDPA), one torch thread (it is single-threaded; SDPA
        uses them all), and no soft-capped logits."""
        return (self.kernels is not None and self.kernels.linear_vectorized
                and self.softcap is None and torch.get_num_threads() == 1)

    def _decode_attention(self, q, layer_idx: int, kv_layer,
                          group: _DecodeGroup) -> torch.Tensor:
        """One attention call for ``group``'s rows over their KV (the C paged kernel for a
        ``_paged_group``, else SDPA) -> their outputs ``[num_rows, H_q,
        D]`` (row r is token ``token_start + r``, or ``token_idx[r]``). ``q``: ``[N, H_q,
        D]``; ``kv_layer``: the store's ``[2, H_kv, NB, B, D]`` for layer ``layer_idx``."""
        n, heads, head_dim, ctx = group.num_rows, self.num_kv_heads, self.head_dim, group.ctx_len
        if group.token_start == 0 and n == q.shape[0]:
            q_rows = q
        elif group.token_start is not None:
            q_rows = q[group.token_start:group.token_start + n]
        else:
            q_rows = q.index_select(0, group.token_idx)
        if group.block_tables is not None:  # paged, in place (``_paged_group``)
            return self.kernels.decode_attention(q_rows, kv_layer, group.block_tables,
                                                 group.lens, self.scale or head_dim ** -0.5)
        if group.kv_views is not None:  # in place: a strided view of each of K and V
            k, v = group.kv_views[0][layer_idx], group.kv_views[1][layer_idx]
        else:
            blocks = kv_layer.view(2, heads, kv_layer.shape[2], -1)
            size = 2 * heads * group.block_idx.numel() * blocks.shape[-1]
            if self._gather_buf.numel() < size:  # reused: a fresh tensor this large costs
                self._gather_buf = blocks.new_empty(size)  # page faults, 5x the copy itself
            out_buf = self._gather_buf[:size].view(2, heads, group.block_idx.numel(), -1)
            torch.index_select(blocks, 2, group.block_idx, out=out_buf)
            kv = out_buf.view(2, heads, n, -1, head_dim)[:, :, :, :ctx].transpose(1, 2)
            k, v = kv[0], kv[1]  # [n, H_kv, T, D]
        res = _sdpa(q_rows.view(n, heads, self.group, head_dim), k, v, attn_mask=group.mask,
                    scale=self.scale, softcap=self.softcap)  # [n, H_kv, G, D]
        return res.reshape(n, self.num_heads, head_dim)

    def _chunk_attention(self, q, k, v, start: int) -> torch.Tensor:
        """Attention of one prompt chunk over its request's KV: ``q [n, H_q, D]`` (positions
        ``start .. start+n-1``), ``k, v [H_kv, start+n, D]`` (the cached prefix, then the
        chunk's own K/V) -> ``[n, H_q, D]``.

        Cost follows the causal FLOPs: no ``[n, ctx]`` mask is built. A chunk with no cached
        context is one causal SDPA (``is_causal``: CPU and CUDA flash kernels skip the
        masked blocks). A later chunk on CPU is two flash calls, the prefix (unmasked) and
        the chunk's own causal diagonal, merged by their log-sum-exp (the split-KV merge of
        FlashDecoding / FlashAttention-2); elsewhere one SDPA with a lower-right causal bias.
        Measured in benchmarks/README.md (issue 14): a 3-D SDPA with a boolean mask took
        the math path, materialising every score.
        """
        n = q.shape[0]
        if self.softcap is not None:  # soft-capped logits (Gemma 2): the eager form, masked
            return self._capped_chunk_attention(q, k, v, start)
        q4, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]  # [1, H, len, D]
        scale = self.scale
        if start == 0:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True,
                                                 scale=scale)
        elif _CPU_FLASH is not None and q.device.type == "cpu":
            out = _merge_lse(_CPU_FLASH(q4, k4[:, :, :start], v4[:, :, :start], scale=scale),
                             _CPU_FLASH(q4, k4[:, :, start:], v4[:, :, start:], is_causal=True,
                                        scale=scale))
        else:
            bias = causal_lower_right(n, start + n)  # query i sees keys 0 .. start + i
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, enable_gqa=True,
                                                 scale=scale)
        return out[0].transpose(0, 1)

    def _capped_chunk_attention(self, q, k, v, start: int) -> torch.Tensor:
        """``_chunk_attention`` with attention-logit soft-capping: GQA folded into the query
        axis ``[H_kv, G*n, D]`` and an explicit causal mask ``[G*n, start+n]`` (soft-capping
        has no flash kernel; the families that use it have short contexts)."""
        n = q.shape[0]
        keys = torch.arange(start + n, device=q.device)
        mask = (keys[None, :] <= torch.arange(start, start + n, device=q.device)[:, None])
        q = q.transpose(0, 1).reshape(self.num_kv_heads, self.group * n, self.head_dim)
        out = _sdpa(q, k, v, attn_mask=mask.repeat(self.group, 1), scale=self.scale,
                    softcap=self.softcap)  # [H_kv, G*n, D]
        return out.view(self.num_heads, n, self.head_dim).transpose(0, 1)

    def _layout(self, batch: ScheduledBatch) -> _StepLayout:
        block_size = self.kv_store.block_size
        ids, positions, slots, sample_idx = [], [], [], []
        decodes, chunks = [], []  # decodes: (kv length, token index, block ids)
        offset = 0
        for i, (state, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start, table = state.num_computed_tokens, state.block_ids
            self.kv_store.claim(max(table) + 1)  # first use of a block: zero it (masked reads
            # must stay finite)
            ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[t // block_size] * block_size + t % block_size
                         for t in range(start, start + n))
            if n == 1:
                decodes.append((start + 1, offset, table))
            else:
                chunks.append((offset, n, start, self._request_tokens(table, start + n)))
            if batch.completes(i):
                sample_idx.append(offset + n - 1)
            offset += n
        if decodes and self._use_c_attention():  # every decode row in one paged C call
            groups = [self._paged_group(decodes)]
        else:
            groups = self._plan_decodes(decodes)
        return _StepLayout(self._long(ids), self._long(positions), self._long(slots), groups,
                           chunks, self._long(sample_idx))

    def _long(self, xs: list[int]) -> torch.Tensor:
        """``xs`` as an int64 tensor on the runner's device."""
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _query_rows(self, tokens: list[int]) -> tuple[int | None, torch.Tensor | None]:
        """A group's ``(token_start, token_idx)`` for decode rows at step tokens ``tokens``:
        ``(tokens[0], None)`` when they are consecutive (q is a slice), else ``(None, the
        indices)`` (q is gathered)."""
        if all(t == tokens[0] + r for r, t in enumerate(tokens)):
            return tokens[0], None
        return None, self._long(tokens)

    def _paged_group(self, decodes: list[tuple[int, int, list[int]]]) -> _DecodeGroup:
        """Decode rows ``(kv length, token index, block ids)`` -> one group for the C paged
        kernel: no views, no gather, no split by length (it reads each row to its own
        length), so none of ``_plan_decodes``' planning."""
        block_size = self.kv_store.block_size
        used = [table[:-(-length // block_size)] for length, _, table in decodes]
        width = max(len(u) for u in used)
        return _DecodeGroup(
            len(decodes), max(length for length, _, _ in decodes), 0, 0, None, None,
            *self._query_rows([token for _, token, _ in decodes]),
            block_tables=self._long([u + [0] * (width - len(u)) for u in used]),
            lens=self._long([length for length, _, _ in decodes]))

    def _plan_decodes(self, decodes: list[tuple[int, int, list[int]]]) -> list[_DecodeGroup]:
        """Decode rows ``(kv length, token index, block ids)`` -> SDPA groups.

        Rows whose used blocks are consecutive have a flat start token each; sorted by it,
        runs of equally spaced starts become strided views (a run of one is a row's own
        view), each run split by length by ``_group_decodes``. A view reads ``ctx_len``
        tokens from every row's start, past a shorter row's end into its neighbour's
        blocks (finite values, masked out), so a piece whose last row would read past the
        store's end is split into single rows. The other rows are one gathered group.
        """
        block_size, flat_tokens = self.kv_store.block_size, self.kv_store.num_tokens
        in_place, scattered = [], []
        for length, token, table in decodes:
            used = table[:-(-length // block_size)]
            if all(b - a == 1 for a, b in zip(used, used[1:])):
                in_place.append((used[0] * block_size, length, token))
            else:
                scattered.append((length, token, table))
        in_place.sort()
        runs, groups = [], []
        for row in in_place:  # greedy: extend the run while the spacing stays the same
            run = runs[-1] if runs else None
            if run and (len(run) == 1 or row[0] - run[-1][0] == run[1][0] - run[0][0]):
                run.append(row)
            else:
                runs.append([row])
        for run in runs:
            stride = run[1][0] - run[0][0] if len(run) > 1 else 0
            ranked = [(rank, length, token) for rank, (_, length, token) in enumerate(run)]
            for piece in _group_decodes(ranked):
                last = run[piece[-1][0]]
                ctx_len = max(length for _, length, _ in piece)
                if len(piece) > 1 and last[0] + ctx_len > flat_tokens:
                    pieces = [[row] for row in piece]
                else:
                    pieces = [piece]  # reads up to the last row's start + ctx_len:
                    self.kv_store.claim(-(-(last[0] + ctx_len) // block_size))
                for p in pieces:
                    start = run[p[0][0]][0]
                    groups.append(self._decode_group(p, start, stride))
        if scattered:
            scattered.sort(key=lambda row: row[0])
            ranked = [(rank, length, token) for rank, (length, token, _) in enumerate(scattered)]
            groups.append(self._decode_group(ranked, 0, 0, [t for _, _, t in scattered]))
        return groups

    def _request_tokens(self, block_ids: list[int], num_tokens: int) -> slice | torch.Tensor:
        """Where a request's first ``num_tokens`` tokens lie in the flat store: a slice when
        their blocks are consecutive, else ``[num_tokens]`` flat positions."""
        block_size = self.kv_store.block_size
        needed = block_ids[:-(-num_tokens // block_size)]
        if all(b - a == 1 for a, b in zip(needed, needed[1:])):
            return slice(needed[0] * block_size, needed[0] * block_size + num_tokens)
        return self.kv_store.token_index(block_ids, num_tokens)

    def _decode_group(self, rows: list[tuple[int, int, int]], token_offset: int,
                      stride_tokens: int, tables: list[list[int]] | None = None) -> _DecodeGroup:
        """``rows``: (rank, kv length, token index). A view group reads from flat token
        ``token_offset`` every ``stride_tokens``; a gather group (``tables`` given: the
        rows' block ids) gathers ``nb = ceil(ctx_len / B)`` blocks per row, a shorter row
        padding with its own first block (finite values, masked out)."""
        ctx_len = max(length for _, length, _ in rows)
        block_idx = None
        if tables is not None:
            block_size = self.kv_store.block_size
            num_blocks, ids = -(-ctx_len // block_size), []
            for table, (_, length, _) in zip(tables, rows):
                used = table[:-(-length // block_size)]
                ids.extend(used + [table[0]] * (num_blocks - len(used)))
            block_idx = self._long(ids)
        mask = None
        if any(length != ctx_len for _, length, _ in rows):
            lens_t = self._long([length for _, length, _ in rows])
            mask = (torch.arange(ctx_len, device=self.device)[None, :] < lens_t[:, None])
            mask = mask[:, None, None, :]
        kv_views = None
        if tables is None:  # row r's K at flat token token_offset + r * stride_tokens
            kv = self.kv_store.kv  # [L, 2, H_kv, NB, B, D], contiguous
            size = (kv.shape[0], len(rows), kv.shape[2], ctx_len, kv.shape[-1])
            strides = (kv.stride(0), stride_tokens * kv.stride(4), kv.stride(2), kv.stride(4), 1)
            start = kv.storage_offset() + token_offset * kv.stride(4)
            kv_views = (kv.as_strided(size, strides, start),
                        kv.as_strided(size, strides, start + kv.stride(1)))
        return _DecodeGroup(len(rows), ctx_len, token_offset, stride_tokens, block_idx, mask,
                            *self._query_rows([t for _, _, t in rows]), kv_views)


def _merge_lse(a: tuple[torch.Tensor, torch.Tensor],
               b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Softmax attention over keys A then keys B from the two partial results ``(out [B, H,
    L, D], lse [B, H, L])``: ``(out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b)``,
    computed in float32 (FlashAttention-2 / FlashDecoding's split-KV merge)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    weight_a = torch.sigmoid(lse_a.float() - lse_b.float())[..., None]  # e^a / (e^a + e^b)
    merged = out_b.float() + (out_a.float() - out_b.float()) * weight_a
    return merged.to(out_a.dtype)


def _group_decodes(rows: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split decode rows ``(rank, kv length, token index)`` (sorted by rank; the runner ranks
    them by KV length) into runs, each gathered and attended as one padded batch. A run
    costs ``_DECODE_CALL_COST_TOKENS`` plus (ranks spanned x longest KV length) token reads;
    dynamic programming over the split points finds the cheapest split, so a few long
    contexts do not make every short row read (and mask) their length.

    The DP is quadratic in its candidate split points, and at 256 rows an exact one cost
    88 ms of Python per step on a loaded core (benchmarks/README.md), so it considers
    at most ~2 x ``_GROUP_DP_UNITS`` of them: every ``ceil(len(rows) / _GROUP_DP_UNITS)``
    rows, plus the ``_GROUP_DP_UNITS`` largest jumps in KV length between neighbouring rows
    (where a long context starts or ends). Up to that many rows it is exact."""
    n = len(rows)
    size = -(-n // _GROUP_DP_UNITS) if n else 1
    jumps = sorted(range(1, n), key=lambda i: -abs(rows[i][1] - rows[i - 1][1]))
    bounds = sorted({*range(0, n, size), *jumps[:_GROUP_DP_UNITS], n})  # unit u = rows[b_u:b_u+1]
    unit_longest = [max(r[1] for r in rows[a:b]) for a, b in zip(bounds, bounds[1:])]
    m = len(unit_longest)
    best, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for j in range(1, m + 1):
        longest, last_slot = 0, rows[bounds[j] - 1][0]
        for i in range(j - 1, -1, -1):
            longest = max(longest, unit_longest[i])
            span = last_slot - rows[bounds[i]][0] + 1
            cost = best[i] + _DECODE_CALL_COST_TOKENS + span * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], m
    while j > 0:
        runs.append(rows[bounds[cut[j]]:bounds[j]])
        j = cut[j]
    return runs[::-1]
