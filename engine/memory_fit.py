"""Does an instance of a given TP and PP fit its devices' memory? Weights per device from a
model's ``config.json`` (no weights read) plus the minimum KV cache, against the memory the KV
budget rule may use (torch-free).

Weights (Llama-shaped), per layer: Q and O ``hidden * H_q * D`` each, K and V ``hidden * H_kv
* D`` each, gate, up and down ``hidden * I`` each (plus biases where ``attention_bias`` /
``mlp_bias``; Qwen2 always has Q/K/V biases), two norms of ``hidden``; the embedding and LM head
``vocab * hidden`` each (one tensor when tied), a final norm. This gives the published
parameter counts (Llama-3.1-8B 8,030,261,248; 70B 70,553,706,496).

Split (``engine.parallel``'s layout): at TP ``t`` a rank holds ``1/t`` of Q, O, gate, up and
down, its KV heads of K and V, and the norms, embedding and head whole (split ``1/t`` with
``vocab_parallel``, as vLLM does). At PP ``p`` a stage holds ``ceil(L / p)`` layers, the first
the embedding, the last the head and final norm (a tied pair is two copies across stages).
The device that holds most is the one checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.kv_heads import kv_heads_of
from engine.placement import check_tp


@dataclass(frozen=True)
class Geometry:
    """A model's shapes, read from its ``config.json`` (``from_config``)."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: dict) -> Geometry:
        """From a Hugging Face ``config.json`` dict (``head_dim`` defaults to hidden over
        heads; Qwen2's Q/K/V biases are implied by its architecture)."""
        heads = config["num_attention_heads"]
        attention_bias = bool(config.get("attention_bias", False))
        qwen2 = "Qwen2ForCausalLM" in (config.get("architectures") or [])
        return cls(hidden=config["hidden_size"], num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads", heads),
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"],
                   num_layers=config["num_hidden_layers"], vocab=config["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=attention_bias or qwen2, o_bias=attention_bias,
                   mlp_bias=bool(config.get("mlp_bias", False)))

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one rank at TP ``tp``."""
        q = self.num_heads // tp * self.head_dim
        kv = len(kv_heads_of(0, tp, self.num_kv_heads)) * self.head_dim
        inter = self.intermediate // tp
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        attention += (q + 2 * kv) * self.qkv_bias + self.hidden * self.o_bias
        mlp = 3 * self.hidden * inter + (2 * inter + self.hidden) * self.mlp_bias
        return attention + mlp + 2 * self.hidden

    def params(self) -> int:
        """Every parameter of the model (tied embedding and head once)."""
        return (self.num_layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2)
                + self.hidden)

    def device_params(self, tp: int = 1, pp: int = 1, vocab_parallel: bool = False) -> int:
        """Parameters on the device that holds most at TP ``tp`` and PP ``pp``; ValueError for
        a TP the heads do not allow or that does not divide the intermediate size, or a PP
        above the layer count."""
        check_tp(tp, self.num_heads, self.num_kv_heads)
        if self.intermediate % tp or (vocab_parallel and self.vocab % tp):
            raise ValueError(f"TP {tp} does not divide the intermediate size {self.intermediate}"
                             + (f" or the vocabulary {self.vocab}" if vocab_parallel else ""))
        if not 1 <= pp <= self.num_layers:
            raise ValueError(f"PP {pp} must be in [1, {self.num_layers}] (the layers)")
        table = self.vocab * self.hidden // (tp if vocab_parallel else 1)
        layers = math.ceil(self.num_layers / pp) * self.layer_params(tp)
        if pp == 1:
            return layers + table * (1 if self.tied else 2) + self.hidden
        return layers + table + self.hidden  # the first or last stage: one table each

    def kv_bytes_per_token(self, itemsize: int, tp: int = 1, pp: int = 1) -> int:
        """KV bytes one token takes on one device: ``2 * ceil(L / pp) * local KV heads * D *
        itemsize`` (``engine.kv_cache.KVSpec.bytes_per_token`` of the device's share)."""
        local = len(kv_heads_of(0, tp, self.num_kv_heads))
        return 2 * math.ceil(self.num_layers / pp) * local * self.head_dim * itemsize


def check_fits(geometry: Geometry, itemsize: int, tp: int, pp: int, device_memory_bytes: int,
               min_kv_tokens: int, utilization: float = 1.0, vocab_parallel: bool = False,
               what: str = "an instance", device: str = "the device") -> int:
    """Refuse, with one line (``prefill TP 1 does not fit an H100: 131 GiB of weights + 0.5 GiB
    of KV for 1024 tokens > 72 GiB (0.9 of 80 GiB)``) or ``device_params``' ValueError, an
    instance whose weights plus the KV of ``min_kv_tokens`` tokens exceed ``utilization *
    device_memory_bytes`` on its fullest device; else the bytes left there for more KV."""
    weights = geometry.device_params(tp, pp, vocab_parallel) * itemsize
    kv = geometry.kv_bytes_per_token(itemsize, tp, pp) * min_kv_tokens
    usable = int(utilization * device_memory_bytes)
    if weights + kv > usable:
        gib = 1 << 30
        raise ValueError(
            f"{what} at TP {tp}, PP {pp} does not fit {device}: {weights / gib:.3g} GiB of "
            f"weights + {kv / gib:.3g} GiB of KV for {min_kv_tokens} tokens > "
            f"{usable / gib:.3g} GiB ({utilization:g} of {device_memory_bytes / gib:.3g} GiB)")
    return usable - weights - kv
