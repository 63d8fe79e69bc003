"""The CPU GEMM kernels the engine's CPU backend picks between, by row count
(``engine.ops.CpuOps.linear``, measured per machine by ``engine.kernel_choice``).

One "step sweep" per row count M: the matmuls of a whole SmolLM2-135M forward (30 layers x
Q/K/V fused, O, gate/up fused, down; plus the LM head for M <= 64, the rows a decode step
samples), each layer with its own random float32 weights, so, as in a real step, the 540 MB
of weights stream from DRAM rather than sit in cache. Three kernels run the same sweep,
interleaved round by round:

- **mkl**: MKL's sgemm (``torch.mm`` on the weight as stored: what ``F.linear`` runs);
- **onednn**: oneDNN's ``_linear_pointwise`` on the weight reordered once (M hint 16);
- **pdlab**: ``engine.cpu_kernels.linear`` on the weight packed once into 16-column panels
  (the 6 x 16 AVX2/FMA kernel in ``engine/cpu_kernels.c``);
- **pdlab512** (where the CPU has avx512f): ``engine.cpu_kernels.linear512`` on 32-column
  panels (the 12 x 32 AVX-512 kernel).

Prints each sweep's time, GFLOP/s, and the ratios pdlab / best of torch's two, pdlab512 /
best of torch's two and MKL / oneDNN (< 1: the first is faster). The engine takes no
crossover from this table: it measures the candidates per shape class on the machine it runs
on (``engine.kernel_choice``); this sweep shows the same comparison over a whole forward. Timing does not depend on the
weights' values.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine import cpu_kernels

# (in, out) of SmolLM2-135M's projection groups and LM head (hidden 576, 9 q / 3 kv heads
# of 64, intermediate 1536, vocabulary 49152).
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate_up, down
NUM_LAYERS = 30
LM_HEAD = (576, 49152)
ROWS = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512]
LM_HEAD_MAX_ROWS = 64  # the LM head sees one row per sampled request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    rows_list = args.rows or ([1, 16, 64, 256] if args.quick else ROWS)
    print(setup_threads(args.threads))
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.linear_vectorized:
        print("pdlab's GEMM kernel is not available here (no compiler or no AVX2/FMA)")
        return 1
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [LM_HEAD]
    weights = [torch.randn(n, k, generator=gen) * 0.05 for k, n in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    panels = [kernels.pack_linear(w) for w in weights]
    avx512 = kernels.linear_avx512
    panels512 = [kernels.pack_linear512(w) for w in weights] if avx512 else []
    table = []
    for rows in rows_list:
        count = len(shapes) if rows <= LM_HEAD_MAX_ROWS else len(shapes) - 1
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        sweep = list(zip(shapes[:count], weights, onednn, panels))
        contenders = {
            "mkl": lambda: [torch.mm(inputs[k], w.t()) for (k, _), w, _, _ in sweep],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[k], p, None, "none",
                                                                  [], "")
                               for (k, _), _, p, _ in sweep],
            "pdlab": lambda: [kernels.linear(inputs[k], p, None, n)
                              for (k, n), _, _, p in sweep],
        }
        if avx512:
            contenders["pdlab512"] = lambda: [kernels.linear512(inputs[k], p, None, n)
                                              for (k, n), p in zip(shapes[:count], panels512)]
        with torch.inference_mode():
            t = {name: timing.min_s for name, timing in
                 measure_interleaved(contenders, repeats).items()}
        flops = 2 * rows * sum(k * n for k, n in shapes[:count])
        table.append([rows, "yes" if count == len(shapes) else "no",
                      *(f"{t[name] * 1e3:.1f}" for name in contenders),
                      f"{flops / t['pdlab'] / 1e9:.1f}",
                      f"{t['pdlab'] / min(t['mkl'], t['onednn']):.2f}",
                      *([f"{flops / t['pdlab512'] / 1e9:.1f}",
                         f"{t['pdlab512'] / min(t['mkl'], t['onednn']):.2f}"] if avx512 else []),
                      f"{t['mkl'] / t['onednn']:.2f}"])
    print(f"one forward's matmuls (30 layers, distinct weights), SmolLM2-135M shapes fp32; "
          + estimator_line(repeats))
    print_table(["M", "LM head", "mkl ms", "onednn ms", "pdlab ms",
                 *(["pdlab512 ms"] if avx512 else []), "pdlab GFLOP/s", "pdlab / best torch",
                 *(["pdlab512 GFLOP/s", "pdlab512 / best torch"] if avx512 else []),
                 "mkl / onednn"], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
