"""Placements on a multi-turn chat workload, at ``make run`` scale: one
``pdlab compare`` of ``colocated:2`` under ``--policy cache_aware``, ``disagg:1p1d`` and
``conditional:1p1d`` on ``--dataset multiturn`` (ShareGPT conversations replayed closed
loop, prefix caching on), with its seeds' 95% intervals, and the prefix-cache hit rate and
the prefill each placement skipped.

A thin driver: every number comes from ``pdlab compare``'s own ``summary.csv``
(``experiments.analysis.summary_table``; hit rate and skipped prefill are
``engine.metrics.summarize``'s ``prefix_hit_rate`` / ``prefill_tokens_skipped``, seed
means) formatted by ``experiments.report``. Only ``colocated:2`` has a pool of two for
``cache_aware`` to choose from. Every run starts with empty prefix caches
(``Deployment.reset_prefix_cache``), so a run's hits are its own.

Defaults (SmolLM2-135M, the model ``make run`` uses): 6 conversations of up to 3 turns per
seed, answers capped at 16 tokens, ``--max-model-len 1024`` (a conversation stops before a
turn that would not fit), mean think time 0.5 s, conversations started at 0.5/s, seeds 0
and 1, Ray workers on the default devices (one per core). ``--model``, ``--rates``,
``--seeds``, ``--num-conversations``, ``--max-turns`` change them; anything after ``--`` goes
to ``pdlab compare`` as is (e.g. ``-- --slo-ttft-s 4``).

    python -m benchmarks.multiturn_placements [--out DIR] [--seeds 3] [-- compare options]

Writes ``DIR`` (``pdlab compare``'s results directory) and ``DIR/multiturn_placements.md``
(the table printed at the end).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from experiments import cli
from experiments.report import collapse_intervals, format_value

PLACEMENTS = "colocated:2,disagg:1p1d,conditional:1p1d"
COLUMNS = ["placement", "rate", "num_requests", "num_failed", "slo_attainment", "ttft_p50_s",
           "tpot_p50_s", "e2e_p50_s", "prefix_hit_rate", "prefill_tokens_skipped",
           "kv_bytes_saved_total"]


def compare_argv(args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    """The ``pdlab compare`` command line this benchmark runs."""
    return ["compare", "--placements", PLACEMENTS, "--policy", "cache_aware",
            "--dataset", "multiturn", "--model", args.model,
            "--num-requests", str(args.num_conversations), "--max-turns", str(args.max_turns),
            "--think-time-s", str(args.think_time_s), "--max-output-len", str(args.max_output_len),
            "--max-model-len", str(args.max_model_len), "--rates", args.rates,
            "--seeds", str(args.seeds), "--out", str(out), *extra]


def table(summary: pd.DataFrame) -> str:
    """The benchmark's table (Markdown) from a ``summary.csv``: ``COLUMNS``, intervals as
    ``mean [lo, hi]``."""
    keep = [c for c in summary.columns
            if c in COLUMNS or c.removesuffix("_ci_lo").removesuffix("_ci_hi") in COLUMNS]
    df = collapse_intervals(summary[keep])[COLUMNS]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(v if isinstance(v, str) else format_value(c, v)
                                for c, v in zip(COLUMNS, row)) + " |"
              for row in df.itertuples(index=False, name=None)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-conversations", type=int, default=6)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--think-time-s", type=float, default=0.5)
    p.add_argument("--max-output-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--rates", default="0.5", help="conversations started per second")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default=None,
                   help="results directory (default: results/multiturn-placements-<time>)")
    args = p.parse_args(argv)
    out = Path(args.out or f"results/multiturn-placements-{time.strftime('%Y%m%d-%H%M%S')}")
    command = compare_argv(args, out, extra)
    print("pdlab " + " ".join(command), flush=True)
    start = time.perf_counter()
    code = cli.main(command)
    if code:
        return code
    text = table(pd.read_csv(out / "summary.csv"))
    wall = time.perf_counter() - start
    report = (f"`pdlab {' '.join(command)}` ({wall:.0f} s wall)\n\n{text}\n\n"
              "prefix_hit_rate: prompt tokens found cached / prompt tokens; "
              "prefill_tokens_skipped: those tokens, per seed (mean); kv_bytes_saved_total: "
              "prompt KV a decode worker already held and was not sent.\n")
    (out / "multiturn_placements.md").write_text(report)
    print("\n" + report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
