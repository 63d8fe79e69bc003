"""pdlab's paged decode attention (``engine/cpu_kernels.c``) of this tree against the one of
an earlier commit, side by side in one run.

Both C sources are built (``cpu_kernels.build``; the old one read with ``git show
REV:engine/cpu_kernels.c`` into a temporary file) and called on the same tensors: SmolLM2-135M's heads (3 KV
heads, 3 query heads each, 64 dims), KV blocks of 16 tokens, B rows of contexts 38-437
tokens (``38 + 97 i mod 400``), each row's blocks consecutive as the first-fit allocator
gives them. Two cache states: **hot** (the call repeated on the same K/V, which then sits in
L2/L3) and **evicted** (a 64 MB buffer summed before each call, as a decode step's weights
pass between two layers' attention). The builds alternate call by call; a figure is the
median of ``--calls`` calls after 5 discarded ones.

    python -m benchmarks.decode_attention [--rev 1bee126] [--calls 60]

Prints ms per call and new / old per (B, cache state). ``--rev`` defaults to the commit
before the 8-keys-at-a-time scores (``pd_block_scores``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import print_table, setup_threads
from engine import cpu_kernels

KV_HEADS, GROUP, DIM, BLOCK = 3, 3, 64, 16


def inputs(rows: int):
    """``(q, store, tables, lens)`` for ``rows`` decode rows (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    ctxs = [38 + (i * 97) % 400 for i in range(rows)]
    blocks = [math.ceil(c / BLOCK) for c in ctxs]
    store = torch.randn(2, KV_HEADS, sum(blocks), BLOCK, DIM, generator=gen)
    tables = torch.zeros(rows, max(blocks), dtype=torch.int64)
    start = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = torch.arange(start, start + n)
        start += n
    q = torch.randn(rows, KV_HEADS * GROUP, DIM, generator=gen)
    return q, store, tables, torch.tensor(ctxs, dtype=torch.int64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="1bee126", help="the commit to compare against")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args(argv)
    print(setup_threads(1))
    old_source = subprocess.run(["git", "show", f"{args.rev}:engine/cpu_kernels.c"],
                                capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        old_path = Path(tmp) / "cpu_kernels.c"
        old_path.write_text(old_source)
        builds = {"new": cpu_kernels.Kernels(cpu_kernels.build()),
                  args.rev: cpu_kernels.Kernels(cpu_kernels.build(source_path=old_path))}
    evict = torch.randn(16 << 20)  # 64 MB
    rows_out = []
    for rows in args.rows:
        q, store, tables, lens = inputs(rows)
        outs = {name: k.decode_attention(q, store, tables, lens, DIM ** -0.5)
                for name, k in builds.items()}
        torch.testing.assert_close(outs["new"], outs[args.rev], rtol=1e-5, atol=1e-5)
        for state in ("hot", "evicted"):
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.calls + 5):
                for name, k in builds.items():
                    if state == "evicted":
                        evict.sum()
                    start = time.perf_counter()
                    k.decode_attention(q, store, tables, lens, DIM ** -0.5)
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t[5:]) * 1e3 for name, t in times.items()}
            kv_mb = int(lens.sum()) * KV_HEADS * DIM * 4 * 2 / 1e6
            rows_out.append([rows, state, kv_mb, med["new"], med[args.rev],
                             med["new"] / med[args.rev]])
    print_table(["B", "K/V", "KV MB", "new ms", f"{args.rev} ms", "new / old"], rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
