"""Benchmarks: scripts that print ratios measured side by side in one run.

Run each from the repository root with the project's Python::

    .venv/bin/python -m benchmarks.decode_step      [--quick]
    .venv/bin/python -m benchmarks.roofline         [--quick]
    .venv/bin/python -m benchmarks.vs_transformers  [--quick]
    .venv/bin/python -m benchmarks.prefill_scaling  [--quick] [--no-vllm]
    .venv/bin/python -m benchmarks.vs_vllm          [--quick]   (needs `make vllm-venv`)
    .venv/bin/python -m benchmarks.step_overhead    [--quick]
    .venv/bin/python -m benchmarks.paged_kv         [--quick]   (paged vs slot KV)
    .venv/bin/python -m benchmarks.gemm_kernels     [--quick]

They are not timed tests. Every time comes from ``experiments.timing.measure`` (min of N
runs after a warm-up, the median beside it). Contenders are measured *interleaved*, one run
of each per round, so a burst of load from the rest of the machine hits all of them alike. By
default a benchmark runs on one thread pinned to one core (``--threads`` changes it), which
keeps the numbers stable on a shared machine.

This module holds the helpers they share: thread setup, the interleaved estimator, tables.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine import kernel_choice
from experiments import timing
from experiments.timing import Timing, describe

# --isa: the environment each cap sets (and that native clears) on every side of a benchmark:
# oneDNN's and MKL's own variables and pdlab's C build (engine/cpu_kernels.py), so an AVX-512
# machine stands in for an AVX2-only one.
ISA_CAPS = {"native": {},
            "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                     "PDLAB_CPU_KERNELS_ISA": "avx2"}}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, pinned to one core; 0 = leave as is)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per contender")


def add_isa_arg(parser: argparse.ArgumentParser) -> None:
    """``--isa native|avx2`` (``ISA_CAPS``); the benchmark calls ``reexec_under_isa`` first."""
    parser.add_argument("--isa", choices=sorted(ISA_CAPS), default="native",
                        help="cap every side's GEMM ISA (avx2: an AVX-512 CPU run as AVX2-only)")


def isa_env(isa: str) -> dict[str, str]:
    """This process's environment with exactly ``ISA_CAPS[isa]`` among the ISA caps
    (``kernel_choice.ISA_ENV``)."""
    env = {k: v for k, v in os.environ.items() if k not in kernel_choice.ISA_ENV}
    return {**env, **ISA_CAPS[isa]}


def reexec_under_isa(module: str, isa: str, argv: list[str] | None) -> None:
    """Re-execute ``python -m module`` under ``isa_env(isa)`` unless already there: torch, MKL
    and oneDNN are loaded by now and read their caps only once, and a vLLM worker started
    later inherits the environment. Returns only when nothing needs to change."""
    want = isa_env(isa)
    if all(os.environ.get(k) == want.get(k) for k in kernel_choice.ISA_ENV):
        return
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, "-m", module, *args], want)


def isa_line(isa: str) -> str:
    """A header line: the ``--isa`` cap in force and the CPU's SIMD flags."""
    caps = dict(ISA_CAPS[isa]) or "none"
    return f"--isa {isa} (caps: {caps}); CPU flags: {kernel_choice.isa_summary()}"


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


def cpu_line() -> str:
    """This CPU as ``lscpu`` names it: model name, family, model, CPUs online."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown CPU (no lscpu)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda key: fields.get(key, "?").strip()  # noqa: E731
    return (f"{get('Model name')} (family {get('CPU family')} model {get('Model')}), "
            f"{get('CPU(s)')} CPUs")


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


def write_rows(rows: Sequence[dict], columns: Sequence[str], out: str | None, prefix: str,
               filename: str) -> Path:
    """``rows`` as ``<out>/<filename>`` (a CSV ``pd.read_csv`` reads; ``columns`` in order);
    ``out`` None: ``results/<prefix>-<local time>``. Prints and returns the file's path."""
    directory = Path(out or f"results/{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / filename
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return path
