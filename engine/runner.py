"""ScheduledBatch -> logits: the only code that calls the model.

One step is one forward over every scheduled token, prompt chunks and decodes together:

1. The new tokens of all requests are packed into one ``[N]`` sequence with their positions.
2. Each layer projects Q/K/V for all N tokens at once (one matmul each), applies RoPE with
   the model's own rotary module, and writes only the new K/V into the requests' KV slots.
3. Attention: all single-token entries (decodes) run as one batched SDPA over a view of the
   slots ``[:S, :, :T]`` with a per-row length mask (no gather, no copy of the cache); each
   multi-token prompt chunk runs one SDPA over its own slot with a causal mask.
   GQA without copying K/V: the G query heads that share a KV head are folded into the
   query-length axis, ``[H_q, n, D] -> [H_kv, G*n, D]``.
4. Only the last position of each request that completes this step goes through the final
   norm and LM head.

The layers' own modules (norms, projections, MLP, rotary) are called, so weights and RoPE
are exactly transformers'; only the attention over the KV store is pdlab's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import KVStore
from engine.scheduler import ScheduledBatch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """As transformers' ``rotate_half`` (Llama RoPE, Su et al. 2021)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _StepLayout:
    """Index tensors shared by every layer of one step."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    token_slots: torch.Tensor  # [N]
    decode_token_idx: torch.Tensor  # [B] token index of each single-token entry
    decode_slots: torch.Tensor  # [B]
    decode_mask: torch.Tensor | None  # [S, 1, 1, T] True = attend
    chunks: list[tuple[int, int, int, int, torch.Tensor]]  # (offset, n, slot, ctx_len, mask)
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
        for layer_idx, layer in enumerate(inner.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            x = self._attention(layer.self_attn, layer_idx, x, cos, sin, layout)
            hidden = residual + x
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if on_layer_done is not None:
                on_layer_done(layer_idx)
        last = inner.norm(hidden[layout.sample_idx])
        return self.model.lm_head(last).float()

    def _attention(self, attn, layer_idx: int, x: torch.Tensor, cos, sin,
                   layout: _StepLayout) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = attn.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_store, v_store = self.kv_store.layer_view(layer_idx)  # [S, H_kv, T_max, D]
        k_store[layout.token_slots, :, layout.positions] = k  # writes only the new tokens
        v_store[layout.token_slots, :, layout.positions] = v
        out = torch.empty_like(q)  # [N, H_q, D]
        if layout.decode_mask is not None:
            out[layout.decode_token_idx] = self._decode_attention(q, k_store, v_store, layout)
        for offset, n, slot, ctx_len, mask in layout.chunks:
            out[offset:offset + n] = self._chunk_attention(
                q[offset:offset + n], k_store[slot, :, :ctx_len], v_store[slot, :, :ctx_len], mask)
        return attn.o_proj(out.view(num_tokens, -1))

    def _decode_attention(self, q, k_store, v_store, layout: _StepLayout) -> torch.Tensor:
        num_slots, _, _, ctx_len = layout.decode_mask.shape
        q_slots = q.new_zeros(num_slots, self.num_kv_heads, self.group, self.head_dim)
        q_slots[layout.decode_slots] = q[layout.decode_token_idx].view(
            -1, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(  # [S, H_kv, G, D]
            q_slots, k_store[:num_slots, :, :ctx_len], v_store[:num_slots, :, :ctx_len],
            attn_mask=layout.decode_mask)
        return out[layout.decode_slots].reshape(-1, self.num_heads, self.head_dim)

    def _chunk_attention(self, q, k, v, mask) -> torch.Tensor:
        n = q.shape[0]  # q [n, H_q, D]; k, v [H_kv, ctx, D]; mask [G*n, ctx]
        q = q.transpose(0, 1).reshape(self.num_kv_heads, self.group * n, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [H_kv, G*n, D]
        return out.view(self.num_heads, n, self.head_dim).transpose(0, 1)

    def _layout(self, batch: ScheduledBatch) -> _StepLayout:
        ids, positions, slots, sample_idx = [], [], [], []
        decode_idx, decode_slots, decode_lens, chunks = [], [], [], []
        offset = 0
        for i, (state, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = state.num_computed_tokens
            ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend([state.slot] * n)
            if n == 1:
                decode_idx.append(offset)
                decode_slots.append(state.slot)
                decode_lens.append(start + 1)
            else:
                chunks.append((offset, n, state.slot, start + n, self._causal_mask(start, n)))
            if batch.completes(i):
                sample_idx.append(offset + n - 1)
            offset += n
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        decode_mask = None
        if decode_slots:
            num_slots, ctx_len = max(decode_slots) + 1, max(decode_lens)
            lens = torch.ones(num_slots, dtype=torch.long)  # idle rows attend position 0 only
            lens[decode_slots] = torch.tensor(decode_lens)
            decode_mask = (torch.arange(ctx_len)[None, :] < lens[:, None])[:, None, None, :]
            decode_mask = decode_mask.to(self.device)
        return _StepLayout(as_long(ids), as_long(positions), as_long(slots), as_long(decode_idx),
                           as_long(decode_slots), decode_mask, chunks, as_long(sample_idx))

    def _causal_mask(self, start: int, n: int) -> torch.Tensor:
        """``[G*n, start+n]``: query i (position start+i) sees keys 0..start+i."""
        keys = torch.arange(start + n, device=self.device)
        queries = torch.arange(start, start + n, device=self.device)
        return (keys[None, :] <= queries[:, None]).repeat(self.group, 1)
