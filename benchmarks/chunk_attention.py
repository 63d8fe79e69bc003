"""A prompt chunk's causal attention, the candidates the engine's CPU backend picks between
by chunk length (``engine.ops.CpuOps.chunk_attention``, measured per machine by
``engine.kernel_choice``), side by side:

- **flash**: torch's CPU flash kernel (``F.scaled_dot_product_attention(is_causal=True)``,
  GQA without a copy), what the backend runs for a first chunk without pdlab's kernel;
- **pdlab**: ``engine.cpu_kernels.causal_attention`` (the AVX2 GEMM blocks over the causal
  triangle, ``engine/cpu_kernels.c``);
- **pdlab512** (where the CPU has avx512f): ``engine.cpu_kernels.causal_attention512``
  (the same on the AVX-512 blocks).

One layer's first chunk of L tokens with SmolLM2-135M's heads (9 query / 3 KV heads of 64),
q rows of a fused QKV tensor and K/V rows of a store slice, as the runner passes them.
Prints each kernel's milliseconds, the causal GFLOP/s (4 L (L + 1) / 2 D H_q FLOPs) and
each pdlab kernel's time / flash's (< 1: pdlab's is faster). Timing does not depend on the values.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LENGTHS = [16, 32, 64, 128, 256, 512, 1024, 2048]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chunk_attention",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 10)
    lengths = args.lengths or ([64, 256, 1024] if args.quick else LENGTHS)
    print(setup_threads(args.threads))
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.linear_vectorized:
        print("pdlab's chunk attention is not available here (no compiler or no AVX2 + FMA)")
        return 1
    pdlab = {"pdlab": kernels.causal_attention,
             **({"pdlab512": kernels.causal_attention512} if kernels.linear_avx512 else {})}
    gen = torch.Generator().manual_seed(0)
    table = []
    for n in lengths:
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
        q = qkv[:, :HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        store = torch.randn(2, KV_HEADS, n + 16, HEAD_DIM, generator=gen)
        k, v = store[0, :, :n], store[1, :, :n]
        scale = HEAD_DIM ** -0.5
        contenders = {
            "flash": lambda: F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True,
                scale=scale),
            **{name: (lambda f=f: f(q, k, v, 0, scale)) for name, f in pdlab.items()},
        }
        with torch.inference_mode():
            t = {name: timing.min_s for name, timing in
                 measure_interleaved(contenders, repeats).items()}
        flops = 4 * n * (n + 1) / 2 * HEAD_DIM * HEADS
        table.append([n, *(f"{t[name] * 1e3:.3f}" for name in contenders),
                      *(f"{flops / t[name] / 1e9:.1f}" for name in contenders),
                      *(f"{t[name] / t['flash']:.2f}" for name in pdlab)])
    print(f"one layer's first-chunk causal attention, SmolLM2-135M heads ({HEADS} q / "
          f"{KV_HEADS} kv of {HEAD_DIM}) fp32; " + estimator_line(repeats))
    print_table(["L", *(f"{c} ms" for c in contenders), *(f"{c} GFLOP/s" for c in contenders),
                 *(f"{c} / flash" for c in pdlab)], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
