"""The engine against this device's floors, measured in the same run.

1. Read bandwidth: ``x.sum()`` over a float32 tensor far larger than the last-level cache
   (default 1 GiB); bytes read / seconds.
2. GEMM rate at the engine's own shapes: each projection group of one decoder layer (Q/K/V
   fused, O, gate/up fused, down) as ``[M, in] x [in, out]`` with M = the prefill's token
   count and M = 16 (decode-like), through every kernel the engine picks between by row
   count (``engine.ops.CpuOps.linear``): the oneDNN-packed ``_linear_pointwise``, MKL's
   sgemm (``torch.mm``) and pdlab's own (``engine.cpu_kernels.linear``, where it builds). The
   fastest per shape is the floor: the best reached on these cores, not one square matmul.
   Also printed: the kernel the engine's selector chose for each shape at that row count.
3. **Decode** (memory floor): one ``Engine.step()`` decoding one request (B = 1) at a KV
   context of 128 tokens. Floor = weight bytes (every parameter read once per step; tied
   embeddings counted once) / read bandwidth.
4. **Prefill** (compute floor): the ``Engine.step()`` that prefills a prompt (default 256
   tokens) whole and samples its first token. Floor = layers x (sum over the four shapes of
   the best measured GEMM time at M = tokens) + (attention FLOPs over the causal triangle,
   ``4 * layers * q_heads * head_dim * T(T+1)/2``, + LM head of the last token) / the best
   GEMM rate measured.

All are interleaved round by round (min of N runs). Output: tables and the two ratios
engine / floor (1.0 would be the floor itself).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from benchmarks import (
    add_common_args,
    estimator_line,
    measure_interleaved,
    print_table,
    setup_threads,
)
from engine import kernel_choice
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model, weight_bytes
from engine.ops import CpuOps, select_ops
from engine.request import Request, SamplingParams

_ids = itertools.count()
KERNELS = ("onednn", "mkl", "pdlab", "pdlab-hwpf", "pdlab512")  # what gemm_contenders can time


def prefill_flops(model, num_tokens: int) -> int:
    """Matmul FLOPs of prefilling ``num_tokens`` tokens and computing the last one's logits."""
    cfg = model.config
    layer_params = sum(m.weight.numel() for layer in model.model.layers
                       for m in layer.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    causal_pairs = num_tokens * (num_tokens + 1) // 2
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * causal_pairs
    return 2 * layer_params * num_tokens + 2 * cfg.hidden_size * cfg.vocab_size + attention


def gemm_shapes(model) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection group of one decoder layer, as the engine runs them."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    return {"qkv": (cfg.hidden_size, qkv),
            "o": (cfg.num_attention_heads * head_dim, cfg.hidden_size),
            "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size)}


def gemm_contenders(shapes: dict[str, tuple[int, int]], rows: int) -> dict[str, object]:
    """``{"<shape>@<rows>/<kernel>": callable}`` for every GEMM candidate the engine's CPU
    backend has here (``CpuOps.linear_candidates``: MKL, the packed oneDNN where this torch
    has it, pdlab's kernel where it builds for AVX2/FMA and torch has one thread), each
    built as the backend builds it."""
    gen = torch.Generator().manual_seed(0)
    backend = select_ops(torch.device("cpu"), torch.float32, torch.float32)
    names = backend.linear_candidates if isinstance(backend, CpuOps) else ["mkl"]
    out = {}
    for name, (fan_in, fan_out) in shapes.items():
        weight = torch.randn(fan_out, fan_in, generator=gen) * fan_in ** -0.5
        x = torch.randn(rows, fan_in, generator=gen)
        for kernel in names:
            try:
                run = backend._make_linear(kernel, weight, None)
            except RuntimeError:  # oneDNN could not pack it
                continue
            out[f"{name}@{rows}/{kernel}"] = lambda x=x, run=run: run(x)
    return out


def _engine_pick(choice: dict[int, str] | None, rows: int) -> str:
    """The kernel the engine's selector runs for ``rows`` rows of a shape ('-': reference)."""
    if not choice:
        return "-"
    return choice[min(kernel_choice.bucket(rows), max(choice))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=128, help="decode KV context (B = 1)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="tensor summed, MiB")
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
                                          max_model_len=args.context + decode_tokens,
                                          enable_prefix_caching=False))
    decoder.add_request(Request("decode", prompt(args.context - 1),
                                SamplingParams(max_tokens=decode_tokens, ignore_eos=True)))
    decoder.step()
    prefiller = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=args.prompt_len + 1,
                                            max_num_batched_tokens=args.prompt_len,
                                            enable_prefix_caching=False))

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
    shapes = gemm_shapes(model)
    gemms = {**gemm_contenders(shapes, args.prompt_len), **gemm_contenders(shapes, 16)}
    with torch.inference_mode():
        timings = measure_interleaved(
            {"decode": decode, "prefill": prefill, "read": lambda: big.sum(), **gemms},
            repeats, setups={"prefill": queue_prompt})

    cfg = model.config
    bandwidth = big.numel() * big.element_size() / timings["read"].min_s  # bytes/s
    gemm_rows = []
    chosen = getattr(prefiller.runner.ops, "linear_choices", {})  # "in x out" -> bucket -> name
    best_s = {}  # (shape, rows) -> fastest kernel's seconds
    for rows in (args.prompt_len, 16):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"{name}@{rows}/"
            kernels = {k.split("/")[1]: timings[k].min_s for k in gemms if k.startswith(prefix)}
            best_s[(name, rows)] = min(kernels.values())
            flops = 2 * rows * fan_in * fan_out
            gemm_rows.append([f"{name} [{rows}x{fan_in}]x[{fan_in}x{fan_out}]",
                              *(f"{flops / kernels[k] / 1e9:.1f}" if k in kernels else "-"
                                for k in KERNELS),
                              f"{flops / best_s[(name, rows)] / 1e9:.1f}",
                              _engine_pick(chosen.get(f"{fan_in}x{fan_out}"), rows)])
    prefill_gemm_flops = 2 * args.prompt_len * sum(i * o for i, o in shapes.values())
    prefill_gemm_s = sum(best_s[(name, args.prompt_len)] for name in shapes)
    best_rate = prefill_gemm_flops / prefill_gemm_s  # FLOP/s over one layer's matmuls
    w_bytes = weight_bytes(model)
    memory_floor_s = w_bytes / bandwidth
    flops = prefill_flops(model, args.prompt_len)
    other_flops = flops - cfg.num_hidden_layers * prefill_gemm_flops  # attention + LM head
    compute_floor_s = cfg.num_hidden_layers * prefill_gemm_s + other_flops / best_rate
    decode_s, prefill_s = timings["decode"].min_s, timings["prefill"].min_s
    print(f"roofline, SmolLM2-135M fp32 CPU; {estimator_line(repeats)}")
    print(f"device: read bandwidth {bandwidth / 1e9:.2f} GB/s ({args.bandwidth_mib} MiB sum, "
          f"{timings['read'].min_s:.4f} s)")
    print("GEMM rate at the engine's shapes, GFLOP/s (best kernel per shape is the floor):")
    print(prefiller.runner.ops.summary())
    print_table(["shape", "oneDNN packed", "MKL mm", "pdlab", "pdlab-hwpf", "pdlab512", "best",
                 "engine picks"],
                gemm_rows)
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
          f"prefill (compute) {prefill_s / compute_floor_s:.2f} (best GEMM rate at "
          f"M={args.prompt_len}: {best_rate / 1e9:.1f} GFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
