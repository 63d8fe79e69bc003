"""ScheduledBatch -> logits: the only code that calls the model.

One step is one forward over every scheduled token, prompt chunks and decodes together:

1. The new tokens of all requests are packed into one ``[N]`` sequence with their positions.
2. Each layer projects Q/K/V for all N tokens at once (one fused matmul), applies RoPE with
   the model's own rotary module, and writes only the new K/V into the requests' KV slots.
3. Attention: single-token entries (decodes) run as batched SDPAs over views of the slots
   ``[a:b, :, :T]`` with a per-row length mask (no copy of the cache). The decode rows are
   split into a few slot ranges (``_group_decodes``) so that short rows do not read up to the
   longest row's length when a few requests hold long contexts. GQA without copying K/V:
   the G query heads that share a KV head are folded into the query-length axis,
   ``[H_q, 1, D] -> [H_kv, G, D]``. Each multi-token prompt chunk runs flash attention over
   its own slot at the cost of the causal FLOPs (``_chunk_attention``: ``is_causal`` for a
   first chunk; prefix + causal diagonal merged by log-sum-exp for a later one).
4. Only the last position of each request that completes this step goes through the final
   norm and LM head.

The layers' own norms, activation and rotary module are called, so RoPE and normalisation
are exactly transformers'. The projections use the layers' own weights through ``_Linear``:
on CPU in float32 each weight is reordered once into oneDNN's blocked layout (Q/K/V fused into
one matmul, gate/up into another), which runs the small-M matmuls of decode steps 1.2-1.7x
faster than the default BLAS path on the CPUs measured (benchmarks/README.md); results agree
with ``F.linear`` to float32 rounding. Elsewhere ``_Linear`` is plain ``F.linear``. The
reordered weights (a second copy of the projection and LM-head weights) are built once per
model and shared by every runner of that model. Only the attention over the KV store is pdlab's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.kv_cache import KVStore
from engine.scheduler import ScheduledBatch

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_BATCH_HINT = 16  # oneDNN's reorder takes an M hint; the packed weight serves any M
# CPU flash attention returning (out [B, H, L, D], logsumexp [B, H, L]); GQA without a copy.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """As transformers' ``rotate_half`` (Llama RoPE, Su et al. 2021)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Linear:
    """One or more projections of the same input, run as one matmul where possible:
    ``x [N, in] -> (x @ W_i.T + b_i for each module i)``.

    CPU float32 (and oneDNN present): the modules' weights are concatenated and reordered
    once into oneDNN's blocked layout (a copy); each call is one ``_linear_pointwise`` whose
    output is split into per-module views. Otherwise: one ``F.linear`` per module, no copy.
    """

    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self.packed = self.bias = None
        weight = modules[0].weight
        if not (_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32):
            return
        with torch.no_grad():
            weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else weight
            if any(m.bias is not None for m in modules):
                self.bias = torch.cat([m.bias if m.bias is not None else
                                       weight.new_zeros(m.out_features) for m in modules])
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                      _PACK_BATCH_HINT)
            except RuntimeError:  # this build's oneDNN cannot pack it: plain F.linear
                self.bias = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.packed is None:
            return tuple(F.linear(x, m.weight, m.bias) for m in self.modules)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)


@dataclass
class _Layer:
    """One decoder layer's modules, projections grouped by shared input."""

    input_norm: torch.nn.Module
    qkv: _Linear  # -> q [N, H_q*D], k [N, H_kv*D], v [N, H_kv*D]
    o: _Linear
    post_norm: torch.nn.Module
    gate_up: _Linear  # -> gate [N, I], up [N, I]
    down: _Linear
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm, _Linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                   _Linear([attn.o_proj]), layer.post_attention_layernorm,
                   _Linear([mlp.gate_proj, mlp.up_proj]), _Linear([mlp.down_proj]), mlp.act_fn)


# Prepared layers per model, shared by every runner (and engine) of that model.
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepare(model) -> tuple[list[_Layer], _Linear]:
    key = (model.lm_head.weight.data_ptr(), model.lm_head.weight.dtype)  # moved/cast: redo
    cached = _PREPARED.get(model)
    if cached is None or cached[0] != key:
        cached = (key, [_Layer.of(layer) for layer in model.model.layers],
                  _Linear([model.lm_head]))
        _PREPARED[model] = cached
    return cached[1], cached[2]


# Grouping decode rows (see ``_group_decodes``): one more SDPA call costs about as much as
# reading this many tokens of one layer's K/V (~20 us vs ~0.1 us/token on the CPU measured).
_DECODE_CALL_COST_TOKENS = 256
_GROUP_DP_UNITS = 32  # split-point candidates in _group_decodes (see there)


@dataclass
class _DecodeGroup:
    """Decode rows whose slots lie in ``[slot_start, slot_start + num_slots)``, attended by
    one SDPA over that slot range's view ``[:, :, :ctx_len]`` (no copy of the cache)."""

    slot_start: int
    num_slots: int
    ctx_len: int  # the longest row's KV length
    mask: torch.Tensor | None  # [num_slots, 1, 1, ctx_len] True = attend; None: all full
    token_start: int | None  # set when row r is slot slot_start + r and token token_start + r
    local_slots: torch.Tensor | None  # [b] slot - slot_start of each row (gather path)
    token_idx: torch.Tensor | None  # [b] token index of each row (gather path)


@dataclass
class _StepLayout:
    """Index tensors shared by every layer of one step."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    token_slots: torch.Tensor  # [N]
    decode_groups: list[_DecodeGroup]  # the single-token entries, by slot range
    chunks: list[tuple[int, int, int, int]]  # (token offset, n, slot, cached tokens)
    sample_idx: torch.Tensor  # [num_sampled] token index whose logits are needed


class ModelRunner:
    """Runs scheduled batches through a Llama-family model against a ``KVStore``."""

    def __init__(self, model, kv_store: KVStore, device: str = "cpu") -> None:
        self.model = model
        self.kv_store = kv_store
        self.device = torch.device(device)
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.layers, self.lm_head = _prepare(model)

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
        hidden = inner.embed_tokens(layout.input_ids)  # [N, hidden]
        cos, sin = inner.rotary_emb(hidden, layout.positions[None])  # [1, N, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [N, 1, D]
        for layer_idx, layer in enumerate(self.layers):
            x = self._attention(layer, layer_idx, layer.input_norm(hidden), cos, sin, layout)
            hidden = hidden + x
            gate, up = layer.gate_up(layer.post_norm(hidden))
            hidden = hidden + layer.down(layer.act(gate) * up)[0]
            if on_layer_done is not None:
                on_layer_done(layer_idx)
        last = inner.norm(hidden[layout.sample_idx])
        return self.lm_head(last)[0].float()

    def _attention(self, layer: _Layer, layer_idx: int, x: torch.Tensor, cos, sin,
                   layout: _StepLayout) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = layer.qkv(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_store, v_store = self.kv_store.layer_view(layer_idx)  # [S, H_kv, T_max, D]
        k_store[layout.token_slots, :, layout.positions] = k  # writes only the new tokens
        v_store[layout.token_slots, :, layout.positions] = v
        out = torch.empty_like(q)  # [N, H_q, D]
        for group in layout.decode_groups:
            self._decode_attention(q, k_store, v_store, group, out)
        for offset, n, slot, start in layout.chunks:
            ctx = start + n
            out[offset:offset + n] = self._chunk_attention(
                q[offset:offset + n], k_store[slot, :, :ctx], v_store[slot, :, :ctx], start)
        return layer.o(out.view(num_tokens, -1))[0]

    def _decode_attention(self, q, k_store, v_store, group: _DecodeGroup,
                          out: torch.Tensor) -> None:
        """One SDPA for ``group``'s rows over the slot view ``[a:b, :, :ctx_len]``; writes
        their outputs into ``out`` ``[N, H_q, D]``."""
        a, b = group.slot_start, group.slot_start + group.num_slots
        k, v = k_store[a:b, :, :group.ctx_len], v_store[a:b, :, :group.ctx_len]
        shape = (group.num_slots, self.num_kv_heads, self.group, self.head_dim)
        if group.token_start is not None:  # one row per slot, in slot order: no gather
            rows = slice(group.token_start, group.token_start + group.num_slots)
            res = F.scaled_dot_product_attention(q[rows].view(shape), k, v,
                                                 attn_mask=group.mask)  # [n, H_kv, G, D]
            out[rows] = res.reshape(group.num_slots, self.num_heads, self.head_dim)
            return
        q_slots = q.new_zeros(shape)  # idle slots inside the view get zero queries
        q_slots[group.local_slots] = q[group.token_idx].view(-1, *shape[1:])
        res = F.scaled_dot_product_attention(q_slots, k, v, attn_mask=group.mask)
        out[group.token_idx] = res[group.local_slots].reshape(-1, self.num_heads, self.head_dim)

    def _chunk_attention(self, q, k, v, start: int) -> torch.Tensor:
        """Attention of one prompt chunk over its slot: ``q [n, H_q, D]`` (positions
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
        q4, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]  # [1, H, len, D]
        if start == 0:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        elif _CPU_FLASH is not None and q.device.type == "cpu":
            out = _merge_lse(_CPU_FLASH(q4, k4[:, :, :start], v4[:, :, :start]),
                             _CPU_FLASH(q4, k4[:, :, start:], v4[:, :, start:], is_causal=True))
        else:
            bias = causal_lower_right(n, start + n)  # query i sees keys 0 .. start + i
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _layout(self, batch: ScheduledBatch) -> _StepLayout:
        ids, positions, slots, sample_idx = [], [], [], []
        decodes, chunks = [], []  # decodes: (slot, kv length, token index)
        offset = 0
        for i, (state, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = state.num_computed_tokens
            ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend([state.slot] * n)
            if n == 1:
                decodes.append((state.slot, start + 1, offset))
            else:
                chunks.append((offset, n, state.slot, start))
            if batch.completes(i):
                sample_idx.append(offset + n - 1)
            offset += n
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        groups = [self._decode_group(rows) for rows in _group_decodes(sorted(decodes))]
        return _StepLayout(as_long(ids), as_long(positions), as_long(slots), groups, chunks,
                           as_long(sample_idx))

    def _decode_group(self, rows: list[tuple[int, int, int]]) -> _DecodeGroup:
        """``rows``: (slot, kv length, token index), sorted by slot."""
        slot_start, ctx_len = rows[0][0], max(length for _, length, _ in rows)
        num_slots = rows[-1][0] - slot_start + 1
        dense = num_slots == len(rows) and all(t == rows[0][2] + r for r, (_, _, t) in enumerate(rows))
        mask = None
        if not dense or any(length != ctx_len for _, length, _ in rows):
            lens = [1] * num_slots  # idle slots in the range attend position 0 only
            for slot, length, _ in rows:
                lens[slot - slot_start] = length
            lens_t = torch.tensor(lens, device=self.device)
            mask = (torch.arange(ctx_len, device=self.device)[None, :] < lens_t[:, None])
            mask = mask[:, None, None, :]
        if dense:
            return _DecodeGroup(slot_start, num_slots, ctx_len, mask, rows[0][2], None, None)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return _DecodeGroup(slot_start, num_slots, ctx_len, mask, None,
                            as_long([s - slot_start for s, _, _ in rows]),
                            as_long([t for _, _, t in rows]))


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
    """Split decode rows (sorted by slot) into runs, each attended over one padded slot-range
    view. A run costs ``_DECODE_CALL_COST_TOKENS`` plus (slots spanned x longest KV length)
    token reads; dynamic programming over the split points finds the cheapest split, so a
    few long contexts no longer make every short row read (and mask) their length.

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
