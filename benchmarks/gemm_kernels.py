"""The two CPU GEMM kernels ``engine.runner._Linear`` picks between, by row count (issue 10).

For each projection group of SmolLM2-135M's layers (Q/K/V fused, O, gate/up fused, down) and
its LM head, ``x [M, in] @ W.T`` through MKL's sgemm (``F.linear``, weights as stored) and
through oneDNN's ``_linear_pointwise`` on the weight reordered once (the engine's packed
layout), at M = 1 (a decode step of one request) up to prompt-chunk sizes. Prints, per M,
the time ratio MKL / oneDNN per shape and over one layer's four matmuls (< 1: MKL faster).
Random float32 weights of the model's shapes (timing does not depend on the values); both
kernels interleaved, min of N rounds. ``_BLAS_MIN_ROWS`` and the one-row rule in
``engine/runner.py`` come from this table on the machine in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)

# (in, out) of SmolLM2-135M's projection groups and LM head (hidden 576, 9 q / 3 kv heads
# of 64, intermediate 1536, vocabulary 49152).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
          "lm_head": (576, 49152)}
ROWS = [1, 2, 8, 16, 32, 48, 64, 96, 128, 256, 1024, 2048]
LM_HEAD_MAX_ROWS = 64  # the LM head sees one row per sampled request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    rows_list = args.rows or ([1, 16, 64, 512] if args.quick else ROWS)
    print(setup_threads(args.threads))
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(fan_out, fan_in, generator=gen) * 0.05
               for name, (fan_in, fan_out) in SHAPES.items()}
    packed = {name: torch.ops.mkldnn._reorder_linear_weight(w, 16) for name, w in weights.items()}
    table = []
    for rows in rows_list:
        names = [n for n in SHAPES if n != "lm_head" or rows <= LM_HEAD_MAX_ROWS]
        inputs = {n: torch.randn(rows, SHAPES[n][0], generator=gen) for n in names}
        contenders = {}
        for n in names:
            x, w, p = inputs[n], weights[n], packed[n]
            contenders[f"{n}/mkl"] = lambda x=x, w=w: F.linear(x, w)
            contenders[f"{n}/onednn"] = lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], "")
        with torch.inference_mode():
            t = measure_interleaved(contenders, repeats)
        ratio = {n: t[f"{n}/mkl"].min_s / t[f"{n}/onednn"].min_s for n in names}
        layer = [n for n in names if n != "lm_head"]
        layer_ratio = (sum(t[f"{n}/mkl"].min_s for n in layer)
                       / sum(t[f"{n}/onednn"].min_s for n in layer))
        flops = 2 * rows * sum(SHAPES[n][0] * SHAPES[n][1] for n in layer)
        best_s = sum(min(t[f"{n}/mkl"].min_s, t[f"{n}/onednn"].min_s) for n in layer)
        table.append([rows, *(f"{ratio[n]:.2f}" if n in ratio else "-" for n in SHAPES),
                      f"{layer_ratio:.2f}", f"{flops / best_s / 1e9:.1f}"])
    print("MKL / oneDNN-packed time per matmul, SmolLM2-135M shapes fp32; "
          + estimator_line(repeats))
    print_table(["M", *SHAPES, "layer (4 matmuls)", "best GFLOP/s"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
