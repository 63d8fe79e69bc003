"""The kernel backend: every tensor kernel of the forward with more than one implementation,
behind one interface chosen once per runner (``select_ops``).

- ``TorchOps``, the reference: public torch ops only (CUDA, dtypes other than float32, and CPU
  when forced with ``PDLAB_FORCE_KERNELS=backend=torch``).
- ``CpuOps``, float32 on CPU: pdlab's C kernels (``engine/cpu_kernels.py``) for the fused
  elementwise chains and, per shape class and row-count (or chunk-length) bucket, the candidate
  ``engine/kernel_choice.py`` measured fastest here (GEMMs: MKL, oneDNN, pdlab's AVX2 or AVX-512;
  paged or planned decode attention; torch's flash or pdlab's causal chunk attention).

One thread: pdlab's C GEMM and paged attention run on the calling thread, so they compete only
when torch has one thread. ``TorchOps`` reads consecutive blocks in place (the allocator hands out
first-fit runs) as strided views (``"planned"``); ``CpuOps``' paged kernel reads any block table
(``"paged"``). Every implementation gives ``generate()``'s greedy tokens. ``PDLAB_FORCE_KERNELS``
pins choices, e.g. ``linear=onednn,decode_attention=planned``; unknown names are refused."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine import cpu_kernels, host_memory, kernel_choice
from engine.model import cache_dir

FORCE_ENV = "PDLAB_FORCE_KERNELS"
# oneDNN's packed linear in this torch build (private ops: CPU backend only, never the reference).
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_BATCH_HINT = 16  # oneDNN's reorder takes an M hint; the packed weight serves any M
# torch's CPU flash attention -> (out [B, H, L, D], lse [B, H, L]), GQA without a copy (private).
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Row-count buckets measured: 1 .. 2^LINEAR_MAX_BUCKET, more use the last; the LM head to 64 rows.
LINEAR_MAX_BUCKET = 9
LM_HEAD_MAX_BUCKET = 6
DECODE_MAX_BUCKET = 8  # decode rows 1 .. 256
# Prompt-chunk lengths measured for the chunk attention: 1 .. 1024 (longer use the 1024 choice).
CHUNK_MAX_BUCKET = 10
# The decode-attention measurement's KV context: about a ShareGPT prompt plus its reply.
DECODE_PROBE_CONTEXT = 256
# A decode step reads every weight from DRAM once: time small-M GEMMs over enough weight copies
# to exceed the last-level cache.
_STREAM_BYTES = 64 * 2**20
_STREAM_MAX_ROWS = 64  # from this many rows a GEMM is compute bound: one copy is timed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """As transformers' ``rotate_half`` (Llama RoPE, Su et al. 2021)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[N, H, D]`` with ``cos``/``sin`` ``[N, 1, R]``: the first R <= D dims
    rotate, the rest pass (partial rotary, as transformers' Phi-3 ``apply_rotary_pos_emb``)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def sdpa(q, k, v, attn_mask=None, scale: float | None = None,
         softcap: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (boolean mask, True = attend; ``scale`` None =
    1/sqrt(D)) plus logit soft-capping ``softcap * tanh(scores / softcap)``, done as transformers'
    Gemma 2 ``eager_attention_forward`` (softmax in float32)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _merge_lse(a: tuple[torch.Tensor, torch.Tensor],
               b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention over keys A then B from partial ``(out [B, H, L, D], lse [B, H, L])`` results:
    ``(out_a e^lse_a + out_b e^lse_b) / (e^lse_a + e^lse_b)`` in float32 (FlashDecoding's merge)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    weight_a = torch.sigmoid(lse_a.float() - lse_b.float())[..., None]  # e^a / (e^a + e^b)
    merged = out_b.float() + (out_a.float() - out_b.float()) * weight_a
    return merged.to(out_a.dtype)


class _Mm:
    """``x [N, in] -> x @ W.T + b`` as ``mm`` / ``addmm`` (MKL's sgemm on CPU), without
    ``F.linear``'s three dispatch layers."""

    name = "mkl"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight_t, self.bias = weight.t(), bias  # [in, out] view

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class _OneDnn:
    """oneDNN's inner product on the weight reordered once into its blocked layout (a copy).

    Raises:
        RuntimeError: this build's oneDNN cannot pack the weight (the candidate is dropped)."""

    name = "onednn"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class _PdlabGemm:
    """``cpu_kernels.linear`` on the weight packed once into 16-column panels (a copy)."""

    name = "pdlab"
    prefetch = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernels: cpu_kernels.Kernels) -> None:
        self.kernels, self.bias, self.out_features = kernels, bias, weight.shape[0]
        self.panels = kernels.pack_linear(weight.detach().contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.panels, self.bias, self.out_features,
                                   prefetch=self.prefetch)


class _PdlabGemmHwpf(_PdlabGemm):
    """``_PdlabGemm`` with the hardware prefetcher alone (``linear(prefetch=False)``)."""

    name = "pdlab-hwpf"
    prefetch = False


class _PdlabGemm512(_PdlabGemm):
    """``cpu_kernels.linear512`` on 32-column panels (a copy); only where the CPU has avx512f."""

    name = "pdlab512"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernels: cpu_kernels.Kernels) -> None:
        self.kernels, self.bias, self.out_features = kernels, bias, weight.shape[0]
        self.panels = kernels.pack_linear512(weight.detach().contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear512(x, self.panels, self.bias, self.out_features)


class _Bucketed:
    """``by_bucket[i]`` runs rows in bucket ``i`` (``kernel_choice.bucket``), the last also more."""

    def __init__(self, by_bucket: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.by_bucket, self.last = by_bucket, len(by_bucket) - 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.by_bucket[min((x.shape[0] - 1).bit_length(), self.last)](x)


class TorchOps:
    """The reference backend: public torch ops only. Stateless; the runner passes every tensor."""

    name = "torch"
    cache_key: tuple = ("torch",)  # what prepared (packed) weights depend on
    # "in x out" -> {bucket: kernel} of the projections built (empty in the reference)
    linear_choices: dict = {}

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None,
               lm_head: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel for ``x [N, in] -> x @ weight.T + bias`` ``[N, out]``, ``weight`` ``[out,
        in]``; ``lm_head``: the output layer (only sampled rows). Float32 to rounding."""
        return _Mm(weight, bias)

    def add_norm(self, norm, hidden: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """``hidden += delta`` in place (when given), then ``norm.module(hidden)`` ``[N, H]``."""
        if delta is not None:
            hidden.add_(delta)
        return norm.module(hidden)

    def act_mul(self, act: Callable[[torch.Tensor], torch.Tensor], act_is_silu: bool,
                gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` for ``gate_up [N, 2I]`` (gate then up) -> ``[N, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor,
                qk: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE on ``q [N, H_q, D]`` and ``k [N, H_kv, D]`` with ``cos``/``sin`` ``[N, R]`` (R < D:
        partial rotary); the rotated k and ``v`` written into ``kv_layer`` ``[2, H_kv, NB, B, D]``
        at the flat positions ``slots [N]`` (``block * B + offset``). ``qk``: the tensor q and k
        are views of (one RoPE over both), or None. Returns the rotated q."""
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, R]: broadcast over heads
        heads = q.shape[1]
        if qk is not None:
            qk = apply_rope(qk[:, :heads + k.shape[1]], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv_flat = kv_layer.view(2, kv_layer.shape[1], -1, kv_layer.shape[-1])  # [2, H, NB*B, D]
        kv_flat[0].index_copy_(1, slots, k.transpose(0, 1))  # only the new tokens
        kv_flat[1].index_copy_(1, slots, v.transpose(0, 1))
        return q

    def prepare_attention(self, num_kv_heads: int, group: int, head_dim: int,
                          block_size: int, softcap: float | None) -> None:
        """Called once with the attention geometry (``H_kv``, ``G = H_q / H_kv``, ``D``, block
        size ``B``, soft-cap or None) before ``decode_layout``."""

    def decode_layout(self, num_rows: int, softcap: float | None) -> str:
        """``"planned"`` (SDPA groups over strided views of consecutive blocks, a gather for the
        rest) or ``"paged"`` (``decode_attention``) for a step's ``num_rows`` decode rows."""
        return "planned"

    def decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Paged attention of one query token per row: ``q [n, H_q, D]`` over row r's first
        ``lens[r]`` tokens, token t in block ``block_tables[r, t // B]`` of ``kv_layer`` ``[2, H_kv,
        NB, B, D]`` (GQA) -> ``[n, H_q, D]``. Reference: a gather and SDPA with a padding mask."""
        n, hq, d = q.shape
        _, hkv, _, block, _ = kv_layer.shape
        length = block_tables.shape[1] * block
        kv = kv_layer[:, :, block_tables].reshape(2, hkv, n, length, d).transpose(1, 2)
        mask = (torch.arange(length, device=q.device)[None, :] < lens[:, None])[:, None, None]
        out = F.scaled_dot_product_attention(q.reshape(n, hkv, hq // hkv, d), kv[0], kv[1],
                                             attn_mask=mask, scale=scale)
        return out.reshape(n, hq, d)

    def chunk_attention(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                        start: int, scale: float | None) -> torch.Tensor:
        """Causal attention of one prompt chunk: ``q4 [1, H_q, n, D]`` at positions ``start ..
        start+n-1`` over ``k4, v4 [1, H_kv, start+n, D]`` (prefix, then the chunk) -> ``[1, H_q, n,
        D]``; query i sees keys 0 .. start + i (a first chunk: SDPA ``is_causal``)."""
        if start == 0:
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True,
                                                  scale=scale)
        bias = causal_lower_right(q4.shape[2], k4.shape[2])
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, enable_gqa=True,
                                              scale=scale)

    def describe(self) -> dict[str, object]:
        """What this backend runs (JSON-able)."""
        return {"backend": self.name}

    def summary(self) -> str:
        """``describe()`` as one line."""
        return f"kernels: {self.name} (reference, public torch ops)"


def _parse_force(spec: str) -> dict[str, str]:
    """``"linear=onednn,decode_attention=paged"`` -> ``{"linear": "onednn", ...}``.

    Raises:
        ValueError: an entry that is not ``op=name`` for a known op."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        op, sep, name = part.partition("=")
        if not sep or op not in ("backend", "linear", "decode_attention", "chunk_attention"):
            raise ValueError(f"${FORCE_ENV}: {part!r} is not backend=torch|cpu, "
                             f"linear=<kernel>, decode_attention=<layout> or "
                             f"chunk_attention=<kernel>")
        if op == "backend" and name not in ("torch", "cpu"):
            raise ValueError(f"${FORCE_ENV}: backend={name} is not torch or cpu")
        out[op] = name
    return out


class CpuOps(TorchOps):
    """Float32 on CPU: pdlab's C kernels where they build, and per shape class and row-count bucket
    the GEMM and decode-attention layout measured fastest here. ``kernels``: ``cpu_kernels.load()``
    or None (then oneDNN and MKL, and the reference's elementwise ops); ``kv_float32``: the C
    kernels that touch the store need float32; ``force``: ``PDLAB_FORCE_KERNELS`` pins.

    Raises:
        ValueError: a forced choice that is not a candidate here."""

    name = "cpu"

    def __init__(self, kernels: cpu_kernels.Kernels | None, kv_float32: bool,
                 selector: kernel_choice.KernelSelector, force: dict[str, str] | None = None,
                 ) -> None:
        self.kernels = kernels
        self.selector, self.force = selector, dict(force or {})
        self.threads = torch.get_num_threads()
        # The one-thread rule (module docstring).
        single = (self.threads == 1 and kernels is not None and kernels.linear_vectorized)
        self.c_elementwise = kernels if kv_float32 else None
        self.linear_candidates = ["mkl", *(["onednn"] if ONEDNN else []),
                                  *(["pdlab", "pdlab-hwpf"] if single else []),
                                  *(["pdlab512"] if single and kernels.linear_avx512 else [])]
        self.decode_candidates = ["planned", *(["paged"] if single and kv_float32 else [])]
        # a prompt chunk's causal attention: torch's CPU flash kernel, or pdlab's AVX2 / AVX-512
        self.chunk_candidates = ["flash", *(["pdlab"] if single else []),
                                 *(["pdlab512"] if single and kernels.linear_avx512 else [])]
        for op, allowed in (("linear", self.linear_candidates),
                            ("decode_attention", self.decode_candidates),
                            ("chunk_attention", self.chunk_candidates)):
            if op in self.force and self.force[op] not in allowed:
                raise ValueError(f"${FORCE_ENV}: {op}={self.force[op]} is not available here "
                                 f"(candidates: {', '.join(allowed)})")
        self.linear_choices: dict[str, dict[int, str]] = {}  # "in x out" -> bucket -> name
        self.decode_choices: dict[int, str] = {}
        self.chunk_choices: dict[int, str] = {}  # chunk-length bucket -> kernel

    @property
    def cache_key(self) -> tuple:
        """What prepared (packed) weights depend on: the kernels each bucket runs."""
        return (self.name, self.kernels is not None, self.threads,
                tuple(sorted(self.force.items())))

    def _make_linear(self, name: str, weight, bias):
        if name == "onednn":
            return _OneDnn(weight, bias)
        if name == "pdlab":
            return _PdlabGemm(weight, bias, self.kernels)
        if name == "pdlab-hwpf":
            return _PdlabGemmHwpf(weight, bias, self.kernels)
        if name == "pdlab512":
            return _PdlabGemm512(weight, bias, self.kernels)
        return _Mm(weight, bias)

    def linear(self, weight, bias, lm_head: bool = False):
        out_features, in_features = weight.shape
        shape = f"{in_features}x{out_features}"
        max_bucket = LM_HEAD_MAX_BUCKET if lm_head else LINEAR_MAX_BUCKET
        buckets = list(range(max_bucket + 1))
        if "linear" in self.force:
            choice = dict.fromkeys(buckets, self.force["linear"])
        else:
            choice = self.selector.choose(
                "linear", shape, buckets,
                {name: self._linear_probe(name, in_features, out_features, bias is not None)
                 for name in self.linear_candidates})
        self.linear_choices[shape + ("/lm_head" if lm_head else "")] = choice
        built = {}
        for name in dict.fromkeys(choice.values()):
            try:
                built[name] = self._make_linear(name, weight, bias)
            except RuntimeError:  # oneDNN could not pack this weight: MKL instead
                built[name] = _Mm(weight, bias)
        return _Bucketed([built[choice[b]] for b in buckets])

    def _linear_probe(self, name: str, in_features: int, out_features: int, has_bias: bool):
        """``make(rows)``: the candidate built on several weight copies; calls under
        ``_STREAM_MAX_ROWS`` rows run all, so weights stream from DRAM as in a step."""
        built: list = []

        def make(rows: int) -> Callable[[], object]:
            if not built:
                copies = max(1, min(32, _STREAM_BYTES // (4 * in_features * out_features)))
                weight = torch.full((out_features, in_features), in_features ** -0.5)
                bias = torch.zeros(out_features) if has_bias else None
                built.extend(self._make_linear(name, weight.clone(), bias)
                             for _ in range(copies))
            kernels = built if rows < _STREAM_MAX_ROWS else built[:1]
            x = torch.full((rows, in_features), 0.5)

            def run() -> None:
                with torch.inference_mode():
                    for kernel in kernels:
                        kernel(x)
            return run
        return make

    # -- elementwise (C where built and the module computes the kernel's formula) --------
    def add_norm(self, norm, hidden, delta):
        if self.c_elementwise is not None and norm.weight is not None:
            return self.c_elementwise.add_rms_norm(hidden, delta, norm.weight, norm.eps)
        return super().add_norm(norm, hidden, delta)

    def act_mul(self, act, act_is_silu, gate_up):
        if self.c_elementwise is not None and act_is_silu:
            return self.c_elementwise.silu_mul(gate_up)
        return super().act_mul(act, act_is_silu, gate_up)

    def rope_kv(self, q, k, v, cos, sin, kv_layer, slots, qk=None):
        if self.c_elementwise is not None and cos.shape[-1] == q.shape[-1]:  # full rotary
            self.c_elementwise.rope_kv(q, k, v, cos, sin, kv_layer, slots)
            return q
        return super().rope_kv(q, k, v, cos, sin, kv_layer, slots, qk)

    def prepare_attention(self, num_kv_heads, group, head_dim, block_size, softcap):
        """Measure (or read) the decode layout per row bucket and chunk kernel per length bucket.
        Soft-capped logits (Gemma 2) have neither a paged nor a pdlab chunk kernel."""
        self._prepare_chunk_attention(num_kv_heads, group, head_dim, softcap)
        buckets = list(range(DECODE_MAX_BUCKET + 1))
        candidates = self.decode_candidates if softcap is None else ["planned"]
        if "decode_attention" in self.force and self.force["decode_attention"] in candidates:
            self.decode_choices = dict.fromkeys(buckets, self.force["decode_attention"])
            return
        shape = f"{num_kv_heads}x{group}x{head_dim}/B{block_size}"
        self.decode_choices = self.selector.choose(
            "decode_attention", shape, buckets,
            {name: self._decode_probe(name, num_kv_heads, group, head_dim, block_size)
             for name in candidates})

    def _prepare_chunk_attention(self, num_kv_heads, group, head_dim, softcap) -> None:
        buckets = list(range(CHUNK_MAX_BUCKET + 1))
        if softcap is not None or CPU_FLASH is None or len(self.chunk_candidates) == 1:
            self.chunk_choices = dict.fromkeys(buckets, "flash")
            return
        if "chunk_attention" in self.force:
            self.chunk_choices = dict.fromkeys(buckets, self.force["chunk_attention"])
            return

        def probe(name: str):
            def make(n: int) -> Callable[[], object]:  # a first chunk of n tokens, one layer
                gen = torch.Generator().manual_seed(n)
                q = torch.randn(n, num_kv_heads * group, head_dim, generator=gen)
                k, v = torch.randn(2, num_kv_heads, n, head_dim, generator=gen)
                q4, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]
                return lambda: self._chunk_kernel(name, q4, k4, v4, 0, head_dim ** -0.5)
            return make
        self.chunk_choices = self.selector.choose(
            "chunk_attention", f"{num_kv_heads}x{group}x{head_dim}", buckets,
            {name: probe(name) for name in self.chunk_candidates})

    def _decode_probe(self, name: str, num_kv_heads: int, group: int, head_dim: int,
                      block_size: int):
        """``make(rows)``: ``rows`` decode rows of ``DECODE_PROBE_CONTEXT`` tokens in consecutive
        blocks, one layer (``planned``'s best case against the paged kernel)."""
        def make(rows: int) -> Callable[[], object]:
            gen = torch.Generator().manual_seed(rows)
            per_row = -(-DECODE_PROBE_CONTEXT // block_size)
            kv_layer = torch.randn(2, num_kv_heads, rows * per_row, block_size, head_dim,
                                   generator=gen)
            q = torch.randn(rows, num_kv_heads * group, head_dim, generator=gen)
            if name == "paged":
                tables = torch.arange(rows * per_row).view(rows, per_row).contiguous()
                lens = torch.full((rows,), DECODE_PROBE_CONTEXT, dtype=torch.long)
                return lambda: self.kernels.decode_attention(q, kv_layer, tables, lens,
                                                             head_dim ** -0.5)
            kv = kv_layer.view(2, num_kv_heads, rows, per_row * block_size, head_dim)
            k, v = (kv[i].transpose(0, 1)[:, :, :DECODE_PROBE_CONTEXT] for i in (0, 1))
            return lambda: sdpa(q.view(rows, num_kv_heads, group, head_dim), k, v)
        return make

    def decode_layout(self, num_rows, softcap):
        return kernel_choice.choice_for(self.decode_choices, num_rows, DECODE_MAX_BUCKET,
                                        "planned")

    def decode_attention(self, q, kv_layer, block_tables, lens, scale):
        return self.kernels.decode_attention(q, kv_layer, block_tables, lens, scale)

    def chunk_attention(self, q4, k4, v4, start, scale):
        """The kernel measured fastest for this chunk length. With torch's flash kernel a later
        chunk is two calls (prefix unmasked, own causal diagonal) merged by log-sum-exp: SDPA with
        the lower-right bias takes the math path on CPU, materialising every score."""
        name = kernel_choice.choice_for(self.chunk_choices, q4.shape[2], CHUNK_MAX_BUCKET,
                                        "flash")
        return self._chunk_kernel(name, q4, k4, v4, start, scale)

    def _chunk_kernel(self, name, q4, k4, v4, start, scale):
        d = q4.shape[-1]
        if (name in ("pdlab", "pdlab512") and k4.stride()[2:] == (d, 1) and q4.stride(3) == 1
                and k4.stride() == v4.stride()):
            kernel = (self.kernels.causal_attention512 if name == "pdlab512"
                      else self.kernels.causal_attention)
            out = kernel(q4[0].transpose(0, 1), k4[0], v4[0], start,
                         d ** -0.5 if scale is None else scale)
            return out.transpose(0, 1)[None]
        if start == 0 or CPU_FLASH is None:
            return super().chunk_attention(q4, k4, v4, start, scale)
        return _merge_lse(CPU_FLASH(q4, k4[:, :, :start], v4[:, :, :start], scale=scale),
                          CPU_FLASH(q4, k4[:, :, start:], v4[:, :, start:], is_causal=True,
                                    scale=scale))

    def describe(self):
        cpu = kernel_choice.cpu_info()
        return {"backend": self.name, "cpu_model": cpu["model"],
                "cpu_family_model": f"{cpu['family']}/{cpu['model_id']}",
                "cpu_isa": kernel_choice.isa_summary(cpu["flags"]),
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "isa_env": {name: os.environ[name] for name in kernel_choice.ISA_ENV
                            if os.environ.get(name)},
                "threads": self.threads,
                "c_kernels": (None if self.kernels is None else
                              "scalar" if not self.kernels.linear_vectorized else
                              "avx2-fma+avx512f" if self.kernels.linear_avx512 else "avx2-fma"),
                "forced": self.force,
                "linear": {shape: kernel_choice.describe_buckets(c)
                           for shape, c in self.linear_choices.items()},
                "decode_attention": (kernel_choice.describe_buckets(self.decode_choices)
                                     if self.decode_choices else "planned"),
                "chunk_attention": (kernel_choice.describe_buckets(self.chunk_choices)
                                    if self.chunk_choices else "flash"),
                "malloc": host_memory.describe()}

    def summary(self):
        d = self.describe()
        linear = "; ".join(f"{shape} {c}" for shape, c in d["linear"].items())
        return (f"kernels: cpu backend on {d['cpu_model']} ({d['cpu_isa']}; torch "
                f"{d['torch_cpu_capability']}{'; caps ' + str(d['isa_env']) if d['isa_env'] else ''}"
                f"), {d['threads']} thread(s); linear {linear}; decode attention "
                f"{d['decode_attention']}; chunk attention {d['chunk_attention']}; malloc "
                f"{d['malloc']}")


_SELECTORS: dict[tuple, kernel_choice.KernelSelector] = {}


def selector_for(threads: int, kernels: cpu_kernels.Kernels | None
                 ) -> kernel_choice.KernelSelector:
    """The process's selector per machine, thread count and C build (shared by its runners),
    cached under ``$PDLAB_CACHE_DIR/kernels``."""
    build = None if kernels is None else kernels.path.parent.name
    key = kernel_choice.machine_key(threads, build)
    root = cache_dir() / "kernels"
    path = kernel_choice.cache_path(key, root)
    ident = (str(path),)
    if ident not in _SELECTORS:
        _SELECTORS[ident] = kernel_choice.KernelSelector(key, path)
    return _SELECTORS[ident]


def select_ops(device: torch.device, weight_dtype: torch.dtype,
               kv_dtype: torch.dtype) -> TorchOps:
    """``CpuOps`` for a float32 model on CPU, else ``TorchOps`` (``PDLAB_FORCE_KERNELS=
    backend=torch`` forces it on CPU too). Call it after the process's torch thread count is set
    (the one-thread rule). On CPU it also keeps freed activations mapped (once per process).

    Raises:
        ValueError: a malformed or unavailable ``$PDLAB_FORCE_KERNELS``."""
    force = _parse_force(os.environ.get(FORCE_ENV, ""))
    if device.type == "cpu":  # every CPU forward, reference or not: engine/host_memory.py
        host_memory.keep_freed_memory()
    if (device.type != "cpu" or weight_dtype != torch.float32
            or force.pop("backend", "cpu") == "torch"):
        return TorchOps()
    kernels = cpu_kernels.load()  # None where switched off (PDLAB_CPU_KERNELS=0) or unbuildable
    threads = torch.get_num_threads()
    return CpuOps(kernels, kv_dtype == torch.float32, selector_for(threads, kernels), force)
