"""ScheduledBatch -> logits: the only code that calls the model.

One step is one forward over every scheduled token, prompt chunks and decodes together:

1. The new tokens of all requests are packed into one ``[N]`` sequence with their positions.
2. Each layer projects Q/K/V for all N tokens in one fused matmul, applies RoPE with the model's
   own rotary tables, and writes the new K/V into the requests' KV blocks at flat positions
   ``block * B + offset`` (``ops.rope_kv``).
3. Decode rows are attended in the layout the backend picks for the row count
   (``ops.decode_layout``): ``"planned"``, batched SDPAs over strided views of the store where
   the rows' blocks are consecutive, split by KV length, else gathered (``_plan_decodes``), GQA
   folded into the query-length axis without copying K/V; or ``"paged"``, one
   ``ops.decode_attention`` call per layer reading each row's blocks in place. Each prompt
   chunk runs flash attention over its request's blocks at the cost of the causal FLOPs
   (``ops.chunk_attention``).
4. Only the last position of each request completing this step reaches the final norm and head.

Every kernel with more than one implementation is the backend's (``engine/ops.py``, chosen once
by ``ops.select_ops``). A fused kernel stands in for a module only where it reproduces the
module's output bit for bit on a probe input at ``_prepare``; anything else (q/k norms, sandwich
norms, GELU, partial rotary) runs its own module, so the forward is transformers' to float32
rounding. One residual block (``_Layer``) covers every family ``engine/model.py`` accepts. Q/K/V
and gate/up are fused into one matmul each, the modules' weights becoming views of the fused
tensor; prepared layers are built once per model and backend and shared by its runners.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from engine import ops as ops_mod
from engine.kv_cache import KVSpec, KVStore, kv_budget_bytes, kv_cache_num_blocks
from engine.ops import TorchOps, sdpa
from engine.request import RequestState
from engine.sampler import Sampler
from engine.scheduler import ScheduledBatch


class KVLayout(NamedTuple):
    """The KV store a runner choice sizes (``budget_bytes``: for the start-up line)."""

    spec: KVSpec
    num_blocks: int
    budget_bytes: int


class StepTokens(NamedTuple):
    """``tokens[j]`` of ``states[j]`` (None: ``errors[j]``); ``logprobs[request_id]``."""

    tokens: list[int | None]
    errors: dict[int, str]
    logprobs: dict[str, tuple[float, tuple]]


class Runner(Protocol):
    """An engine's step runner (``ModelRunner``, ``EmulatedRunner``, ``DriverRunner``), in step
    order: ``begin()`` -> the start stamp; ``execute`` starts the step (it may run on);
    ``tokens`` -> ``StepTokens``; ``end_s(start_s)`` -> the tokens' stamp; ``finish(idle)``
    blocks until the device is done -> lateness (held / modelled) when emulated, else None;
    ``finish(lead_s=...)`` may return up to that long before, while ``busy``, until
    ``wait_end`` (emulated: the next step's host work overlaps the device's step)."""

    ops: Any

    def begin(self) -> float: ...

    def execute(self, batch: ScheduledBatch,
                on_layer_done: Callable[[int], None] | None = None) -> Any: ...

    def tokens(self, states: list[RequestState], output: Any) -> StepTokens: ...

    def end_s(self, start_s: float) -> float: ...

    def finish(self, idle: Callable[[float], None] | None = None,
               lead_s: float = 0.0) -> float | None: ...

    busy: bool

    def wait_end(self, idle: Callable[[float], None] | None = None) -> None: ...

    def forget(self, request_id: str) -> None: ...


class RunnerChoice(Protocol):
    """How an engine's steps run, chosen at deployment (``OnWeights``, ``Emulation``):
    ``kv_layout`` sizes the KV store (ValueError: not this model's), ``runner`` runs on it."""

    def kv_layout(self, loaded, config, max_model_len: int) -> KVLayout: ...

    def runner(self, loaded, kv_store: KVStore, config) -> Runner: ...


class OnWeights:
    """Steps computed by the model's weights on ``config.device`` (``ModelRunner``); the KV
    budget is the device's (``engine.kv_cache.kv_budget_bytes``)."""

    def kv_layout(self, loaded, config, max_model_len: int) -> KVLayout:
        budget = kv_budget_bytes(config, config.device)
        return KVLayout(loaded.kv_spec, kv_cache_num_blocks(config, loaded.kv_spec,
                                                            config.device, budget,
                                                            max_model_len), budget)

    def runner(self, loaded, kv_store: KVStore, config) -> ModelRunner:
        return ModelRunner(loaded.model, kv_store, config.device,
                           Sampler(loaded.eos_token_ids))  # min_tokens masks EOS too


def _histories(states: list[RequestState]) -> list[tuple[list[int], int]] | None:
    """(prompt + outputs, prompt length) of the sampled rows, or None when no row has a penalty."""
    if not any(s.sampling.has_penalties for s in states):
        return None
    return [(s.token_ids, s.num_prompt_tokens) for s in states]


class _Linear:
    """One or more projections of the same input as one matmul (``ops.linear``):
    ``x [N, in] -> (x @ W_i.T + b_i for each module i)``, split into per-module views. Fused
    modules' weights are concatenated once, each module's ``weight`` becoming a view of its
    rows (no second copy; transformers' own forward reads the same memory)."""

    def __init__(self, modules: list[torch.nn.Linear], split: list[int] | None = None,
                 ops: TorchOps | None = None, lm_head: bool = False) -> None:
        self.modules = modules
        # A fused module (Phi-3's qkv_proj, gate_up_proj) is one matmul split into ``split``.
        self.sizes = split or [m.out_features for m in modules]
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
            self.fused = (ops or TorchOps()).linear(self.weight.detach(), self.bias, lm_head)
        # ``fused(x [N, in])`` -> the unsplit output ``[N, sum(sizes)]`` (contiguous)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.fused(x)
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)


def _probe(width: int, device) -> torch.Tensor:
    """A fixed ``[2, width]`` float32 input for checking a module's formula at _prepare."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, width, generator=gen) * 3).to(device)


@dataclass
class _Norm:
    """An RMSNorm module, plus the fused path's ``w'`` where it is the plain form ``out = w' *
    (x * rsqrt(mean(x^2, -1) + eps))`` (Zhang & Sennrich 2019): ``w' = weight`` (Llama-style)
    or ``1 + weight`` (Gemma). The form must reproduce the module's output bit for bit on a
    probe input at _prepare, else ``weight`` is None and the module's own forward runs."""

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

    with optional norms (None: identity); Llama's ``post_attention_layernorm`` is
    ``mlp_norm``, Gemma's is ``attn_out_norm``.
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
    def of(cls, layer, cfg, per_type_rope: bool, ops: TorchOps) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        linear = lambda mods, split=None: _Linear(mods, split, ops)  # noqa: E731
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
_ANNOUNCED: set[str] = set()  # backend summaries already printed by this process


def _prepare(model, ops: TorchOps) -> tuple[list[_Layer], _Norm, _Linear]:
    """The model's layers as ``_Layer``s, its final norm and LM head, built once per model
    (and per backend configuration: the projections' packed weights depend on it)."""
    weight = model.lm_head.weight
    key = (weight.data_ptr(), weight.dtype, ops.cache_key)  # moved/cast/other kernels: redo
    cached = _PREPARED.get(model)
    if cached is None or cached[0] != key:
        per_type_rope = hasattr(model.model.rotary_emb, "layer_types")  # Gemma 3
        cached = (key, [_Layer.of(layer, model.config, per_type_rope, ops)
                        for layer in model.model.layers],
                  _Norm.of(model.model.norm), _Linear([model.lm_head], ops=ops, lm_head=True),
                  dict(ops.linear_choices))
        _PREPARED[model] = cached
    else:  # built by another runner's backend: record the choices they run (describe())
        ops.linear_choices.update(cached[4])
    return cached[1], cached[2], cached[3]


# Grouping decode rows (``_group_decodes``): one more gather + SDPA call costs about as much as
# reading this many tokens of one layer's K/V.
_DECODE_CALL_COST_TOKENS = 256
_GROUP_DP_UNITS = 32  # split-point candidates in _group_decodes (see there)


@dataclass
class _DecodeGroup:
    """Decode rows attended by one call: SDPA over ``[num_rows, H_kv, ctx_len, D]`` K and V,
    a strided view (row r from flat token ``token_offset + r * stride_tokens``) or gathered
    (``block_idx``); or the C paged kernel (``block_tables``)."""

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
    """Runs scheduled batches through a supported decoder model against a paged ``KVStore``;
    requests name their KV by ``RequestState.block_ids``."""

    def __init__(self, model, kv_store: KVStore, device: str = "cpu",
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.sampler = sampler or Sampler()
        self.kv_store = kv_store
        self.device = torch.device(device)
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.ops = ops_mod.select_ops(self.device, model.lm_head.weight.dtype,
                                      kv_store.kv.dtype)
        self.layers, self.final_norm, self.lm_head = _prepare(model, self.ops)
        # The same in every layer of every supported family; None = SDPA's default 1/sqrt(D).
        self.scale = self.layers[0].scale
        self.scale = None if self.scale == self.head_dim ** -0.5 else self.scale
        self.softcap = self.layers[0].softcap
        assert all(layer.scale == self.layers[0].scale and layer.softcap == self.softcap
                   for layer in self.layers), "per-layer attention scale/soft-cap"
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3
        self.ops.prepare_attention(self.num_kv_heads, self.group, self.head_dim,
                                   kv_store.block_size, self.softcap)
        self._decode_planners = {"planned": self._plan_decodes,
                                 "paged": lambda decodes: [self._paged_group(decodes)]}
        summary = self.ops.summary()
        if summary not in _ANNOUNCED:  # once per process and backend configuration
            _ANNOUNCED.add(summary)
            print(f"pdlab: {summary}", file=sys.stderr)
        self._gather_buf = torch.empty(0, dtype=kv_store.kv.dtype, device=self.device)
        self._kv_views: tuple = (None, [])  # (store tensor, [(layer view, flat view)])

    def begin(self) -> float:
        return time.time()

    def tokens(self, states: list[RequestState], logits: torch.Tensor) -> StepTokens:
        """The sampler's pick from row ``j`` of ``logits`` for ``states[j]``."""
        tokens, errors = self.sampler.sample_rows(
            logits, [s.request_id for s in states], [s.sampling for s in states],
            [s.num_output_tokens for s in states], _histories(states))
        lp_rows = [j for j, s in enumerate(states) if s.sampling.logprobs is not None]
        logprobs = {}
        if lp_rows:  # only rows that asked pay for a log_softmax
            by_row = self.sampler.logprobs(logits, lp_rows, tokens,
                                           [states[j].sampling.logprobs for j in lp_rows])
            logprobs = {states[j].request_id: v for j, v in by_row.items()}
        return StepTokens(tokens, errors, logprobs)

    def end_s(self, start_s: float) -> float:
        return time.time()  # the forward ran in ``execute``

    busy = False  # the forward ran in ``execute``

    def finish(self, idle: Callable[[float], None] | None = None,
               lead_s: float = 0.0) -> None:
        return None  # nothing in flight

    def wait_end(self, idle: Callable[[float], None] | None = None) -> None:
        return None

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step (counters not yet advanced) -> float32 logits ``[num_sampled, vocab]``,
        one row per entry ``i`` with ``batch.completes(i)``, in batch order.
        ``on_layer_done(layer)`` runs once that layer's K/V are in the store."""
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
        """``hidden += delta`` in place (when given), then ``norm(hidden)`` ``[N, H]``
        (``ops.add_norm``)."""
        return self.ops.add_norm(norm, hidden, delta)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` ``[N, H]``: gate and up one matmul, then
        ``ops.act_mul``."""
        return layer.down.fused(self.ops.act_mul(layer.act, layer.act_is_silu,
                                                 layer.gate_up.fused(x)))

    def _rope_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """``{rope_key: (cos, sin)}``, each ``[N, R]`` (``R`` < D for partial rotary), from the
        model's own rotary module, so every RoPE scaling follows transformers."""
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
        # q and k still adjacent in qkv (no q/k norm made new tensors): one RoPE over both
        q = self.ops.rope_kv(q, k, v, cos, sin, kv_layer, layout.token_slots,
                             qkv if layer.q_norm is None else None)
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

    def _decode_attention(self, q, layer_idx: int, kv_layer,
                          group: _DecodeGroup) -> torch.Tensor:
        """One call (C paged kernel or SDPA) for ``group``'s rows: ``q [N, H_q, D]`` over
        ``kv_layer [2, H_kv, NB, B, D]`` -> ``[num_rows, H_q, D]`` (row r is token
        ``token_start + r``, or ``token_idx[r]``)."""
        n, heads, head_dim, ctx = group.num_rows, self.num_kv_heads, self.head_dim, group.ctx_len
        if group.token_start == 0 and n == q.shape[0]:
            q_rows = q
        elif group.token_start is not None:
            q_rows = q[group.token_start:group.token_start + n]
        else:
            q_rows = q.index_select(0, group.token_idx)
        if group.block_tables is not None:  # paged, in place (``_paged_group``)
            return self.ops.decode_attention(q_rows, kv_layer, group.block_tables,
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
        res = sdpa(q_rows.view(n, heads, self.group, head_dim), k, v, attn_mask=group.mask,
                    scale=self.scale, softcap=self.softcap)  # [n, H_kv, G, D]
        return res.reshape(n, self.num_heads, head_dim)

    def _chunk_attention(self, q, k, v, start: int) -> torch.Tensor:
        """Attention of one prompt chunk over its request's KV: ``q [n, H_q, D]`` (positions
        ``start .. start+n-1``), ``k, v [H_kv, start+n, D]`` (the cached prefix, then the
        chunk's own K/V) -> ``[n, H_q, D]``; no ``[n, ctx]`` mask is built, so the cost
        follows the causal FLOPs (``ops.chunk_attention``)."""
        if self.softcap is not None:  # soft-capped logits (Gemma 2): the eager form, masked
            return self._capped_chunk_attention(q, k, v, start)
        q4, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]  # [1, H, len, D]
        return self.ops.chunk_attention(q4, k4, v4, start, self.scale)[0].transpose(0, 1)

    def _capped_chunk_attention(self, q, k, v, start: int) -> torch.Tensor:
        """``_chunk_attention`` with attention-logit soft-capping: GQA folded into the query
        axis ``[H_kv, G*n, D]`` and an explicit causal mask ``[G*n, start+n]`` (soft-capping
        has no flash kernel; the families that use it have short contexts)."""
        n = q.shape[0]
        keys = torch.arange(start + n, device=q.device)
        mask = (keys[None, :] <= torch.arange(start, start + n, device=q.device)[:, None])
        q = q.transpose(0, 1).reshape(self.num_kv_heads, self.group * n, self.head_dim)
        out = sdpa(q, k, v, attn_mask=mask.repeat(self.group, 1), scale=self.scale,
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
        # the backend's layout for this many rows: planned SDPA groups or one paged call
        groups = (self._decode_planners[self.ops.decode_layout(len(decodes), self.softcap)](
            decodes) if decodes else [])
        return _StepLayout(self._long(ids), self._long(positions), self._long(slots), groups,
                           chunks, self._long(sample_idx))

    def _long(self, xs: list[int]) -> torch.Tensor:
        """``xs`` as an int64 tensor on the runner's device."""
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _query_rows(self, tokens: list[int]) -> tuple[int | None, torch.Tensor | None]:
        """``(tokens[0], None)`` when the step tokens ``tokens`` are consecutive (q a slice),
        else ``(None, their indices)`` (q gathered)."""
        if all(t == tokens[0] + r for r, t in enumerate(tokens)):
            return tokens[0], None
        return None, self._long(tokens)

    def _paged_group(self, decodes: list[tuple[int, int, list[int]]]) -> _DecodeGroup:
        """Decode rows ``(kv length, token index, block ids)`` -> one group for the C paged
        kernel, which reads each row's blocks in place to its own length."""
        block_size = self.kv_store.block_size
        used = [table[:-(-length // block_size)] for length, _, table in decodes]
        width = max(len(u) for u in used)
        return _DecodeGroup(
            len(decodes), max(length for length, _, _ in decodes), 0, 0, None, None,
            *self._query_rows([token for _, token, _ in decodes]),
            block_tables=self._long([u + [0] * (width - len(u)) for u in used]),
            lens=self._long([length for length, _, _ in decodes]))

    def _plan_decodes(self, decodes: list[tuple[int, int, list[int]]]) -> list[_DecodeGroup]:
        """Decode rows ``(kv length, token index, block ids)`` -> SDPA groups. Rows with
        consecutive blocks, sorted by start, form strided views over runs of equal spacing,
        split by ``_group_decodes``; a view reads ``ctx_len`` tokens past a shorter row's end
        (finite, masked out), so a piece that would read past the store's end is split into
        single rows. The other rows are one gathered group."""
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


def _group_decodes(rows: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split decode rows ``(rank, kv length, token index)`` (sorted by rank; the runner ranks
    them by KV length) into runs, each gathered and attended as one padded batch. A run
    costs ``_DECODE_CALL_COST_TOKENS`` plus (ranks spanned x longest KV length) token reads;
    dynamic programming over the split points finds the cheapest split, so a few long
    contexts do not make every short row read (and mask) their length. The DP is quadratic
    in its split points, so it considers at most ~2 x ``_GROUP_DP_UNITS``: every
    ``ceil(len(rows) / _GROUP_DP_UNITS)`` rows and the ``_GROUP_DP_UNITS`` largest jumps in
    KV length between neighbours; up to that many rows it is exact."""
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
