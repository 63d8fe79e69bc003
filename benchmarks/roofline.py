"""The engine against this device's floors, measured in the same run.

1. Read bandwidth: ``x.sum()`` over a float32 tensor far larger than the last-level cache
   (default 1 GiB); bytes read / seconds.
2. Matmul rate: a square float32 matmul (default 2048); ``2 n^3`` FLOPs / seconds.
3. **Decode** (memory floor): one ``Engine.step()`` decoding one request (B = 1) at a KV
   context of 128 tokens. Floor = weight bytes (every parameter read once per step; tied
   embeddings counted once) / read bandwidth.
4. **Prefill** (compute floor): the ``Engine.step()`` that prefills a 256-token prompt whole
   and samples its first token. FLOPs = 2 * (decoder-layer matmul parameters) * tokens
   + 2 * hidden * vocab (LM head, last token only) + attention (QK^T and AV over the causal
   triangle: 4 * layers * q_heads * head_dim * T(T+1)/2). Floor = FLOPs / matmul rate.

All four are interleaved round by round (min of N runs). Output: a table and the two ratios
engine / floor (1.0 would be the floor itself).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams

_ids = itertools.count()


def weight_bytes(model) -> int:
    """Bytes of every parameter (shared tensors, e.g. tied embeddings, counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prefill_flops(model, num_tokens: int) -> int:
    """Matmul FLOPs of prefilling ``num_tokens`` tokens and computing the last one's logits."""
    cfg = model.config
    layer_params = sum(m.weight.numel() for layer in model.model.layers
                       for m in layer.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    causal_pairs = num_tokens * (num_tokens + 1) // 2
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * causal_pairs
    return 2 * layer_params * num_tokens + 2 * cfg.hidden_size * cfg.vocab_size + attention


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=128, help="decode KV context (B = 1)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="tensor summed, MiB")
    parser.add_argument("--matmul-n", type=int, default=2048)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    model, vocab = loaded.model, loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = lambda n: tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())  # noqa: E731

    # decode: one request prefilled to context - 1 tokens + its first token, then B = 1 steps
    decode_tokens = 2 * repeats + 8
    decoder = Engine(loaded, EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.context,
                                          max_model_len=args.context + decode_tokens))
    decoder.add_request(Request("decode", prompt(args.context - 1),
                                SamplingParams(max_tokens=decode_tokens, ignore_eos=True)))
    decoder.step()
    prefiller = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=args.prompt_len + 1,
                                            max_num_batched_tokens=args.prompt_len))

    def queue_prompt() -> None:
        prefiller.add_request(Request(f"p{next(_ids)}", prompt(args.prompt_len),
                                      SamplingParams(max_tokens=1)))

    def prefill() -> None:
        if len(prefiller.step()) != 1:
            raise RuntimeError("the prompt did not prefill whole in one step")

    def decode() -> None:
        if len(decoder.step()) != 1:
            raise RuntimeError("the decode step produced no token")

    big = torch.ones(args.bandwidth_mib * 2**20 // 4)
    a, b = torch.randn(args.matmul_n, args.matmul_n), torch.randn(args.matmul_n, args.matmul_n)
    timings = measure_interleaved(
        {"decode": decode, "prefill": prefill, "read": lambda: big.sum(),
         "matmul": lambda: torch.mm(a, b)},
        repeats, setups={"prefill": queue_prompt})

    bandwidth = big.numel() * big.element_size() / timings["read"].min_s  # bytes/s
    flops_rate = 2 * args.matmul_n ** 3 / timings["matmul"].min_s
    w_bytes = weight_bytes(model)
    memory_floor_s = w_bytes / bandwidth
    flops = prefill_flops(model, args.prompt_len)
    compute_floor_s = flops / flops_rate
    decode_s, prefill_s = timings["decode"].min_s, timings["prefill"].min_s
    print(f"roofline, SmolLM2-135M fp32 CPU; {estimator_line(repeats)}")
    print(f"device: read bandwidth {bandwidth / 1e9:.2f} GB/s ({args.bandwidth_mib} MiB sum, "
          f"{timings['read'].min_s:.4f} s); matmul {flops_rate / 1e9:.1f} GFLOP/s "
          f"({args.matmul_n}^3, {timings['matmul'].min_s:.4f} s)")
    print_table(
        ["phase", "engine_s", "engine_median_s", "work", "floor_s", "engine/floor",
         "achieved"],
        [["decode B=1 ctx " + str(args.context), decode_s, timings["decode"].median_s,
          f"{w_bytes / 1e6:.1f} MB weights", memory_floor_s, decode_s / memory_floor_s,
          f"{w_bytes / decode_s / 1e9:.2f} GB/s"],
         [f"prefill {args.prompt_len} tok", prefill_s, timings["prefill"].median_s,
          f"{flops / 1e9:.1f} GFLOP", compute_floor_s, prefill_s / compute_floor_s,
          f"{flops / prefill_s / 1e9:.1f} GFLOP/s"]])
    print(f"ratio engine/floor: decode (memory) {decode_s / memory_floor_s:.2f}, "
          f"prefill (compute) {prefill_s / compute_floor_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
