"""Benchmarks: scripts that print ratios measured side by side in one run (DESIGN §7).

Run each from the repository root with the project's Python::

    .venv/bin/python -m benchmarks.decode_step      [--quick]
    .venv/bin/python -m benchmarks.roofline         [--quick]
    .venv/bin/python -m benchmarks.vs_transformers  [--quick]
    .venv/bin/python -m benchmarks.prefill_scaling  [--quick] [--no-vllm]
    .venv/bin/python -m benchmarks.vs_vllm          [--quick]   (needs `make vllm-venv`)
    .venv/bin/python -m benchmarks.step_overhead    [--quick]
    .venv/bin/python -m benchmarks.paged_kv         [--quick]   (paged vs slot KV, issue 17)
    .venv/bin/python -m benchmarks.gemm_kernels     [--quick]

They are not timed tests. Every time comes from ``experiments.timing.measure`` (min of N
runs after a warm-up, median shown). Contenders are measured *interleaved*, one run of each
per round, so a burst of load from the rest of the machine hits all of them alike. By
default a benchmark runs on one thread pinned to one core (``--threads`` changes it), which
keeps the numbers stable on a shared machine.

This module holds the helpers they share: thread setup, the interleaved estimator, tables.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

import torch

from experiments import timing
from experiments.timing import Timing, describe


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, pinned to one core; 0 = leave as is)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per contender")


def setup_threads(threads: int) -> str:
    """Use ``threads`` torch threads, pinned to as many cores (the last ones, away from core 0
    where most other work lands); returns a line saying what was set."""
    if threads <= 0:
        return f"threads: torch default ({torch.get_num_threads()})"
    torch.set_num_threads(threads)
    cores = sorted(os.sched_getaffinity(0))
    pinned = cores[-threads:] if len(cores) >= threads else cores
    os.sched_setaffinity(0, pinned)
    return f"threads: {threads} (pinned to cores {pinned})"


def measure_interleaved(contenders: dict[str, Callable[[], object]], repeats: int, *,
                        setups: dict[str, Callable[[], object]] | None = None,
                        warmup: int = 1) -> dict[str, Timing]:
    """Time several callables side by side: each round runs every contender once, in the
    order given (``experiments.timing.measure_interleaved`` without a shuffle), so slow
    phases of a shared machine hit all of them alike.

    Returns:
        name -> ``Timing`` over the ``repeats`` rounds after ``warmup`` discarded rounds.
    """
    setups = setups or {}
    return timing.measure_interleaved({name: (setups.get(name), run)
                                       for name, run in contenders.items()},
                                      repeats, warmup=warmup, seed=None)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain-text table (also valid Markdown)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda xs: "| " + " | ".join(x.rjust(w) for x, w in zip(xs, widths)) + " |"  # noqa: E731
    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print(line(row))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def estimator_line(repeats: int, warmup: int = 1) -> str:
    return f"estimator: {describe(repeats, warmup)}; contenders interleaved round by round"
