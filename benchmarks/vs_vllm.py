"""pdlab's Engine against vLLM's CPU build, side by side in one run.

Needs ``.venv-vllm`` (``make vllm-venv``); ``make bench-vllm`` runs this. Both engines run on
the same pinned core(s) (``--threads``), alternating run by run, each figure the minimum over
``--repeats`` rounds after a warm-up. SmolLM2-135M fp32, greedy, EOS ignored, prefix caching
off on both (rounds repeat prompts), token budget 2048. vLLM runs offline (``vllm.LLM``) in a
subprocess (``benchmarks.vllm_peer``), timed inside it.

Rows (the 16 ShareGPT prompts of ``benchmarks.vs_transformers``):

1. 16x64: all 16 prompts x 64 output tokens;
2. prefill: all 16 prompts, ``max_tokens=1``;
3. decode B for B in 1, 16, 64: B prompts added at once with ``max_tokens = 1 + K``, each
   ``step()`` timed; one decode step = the median of the full decode steps (exactly B
   tokens, none a request's first or last: ``decode_step_s``), the same rule on both sides.

Prints pdlab/vLLM per row (target <= 1.0) and how many 16x64 outputs are equal token for token.

``--isa avx2`` caps both sides alike (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
``PDLAB_CPU_KERNELS_ISA``), so an AVX-512 machine stands in for an AVX2-only one; ``native``
(default) clears them. The process re-executes itself with that environment. The header
prints what each side's GEMM ran on (``benchmarks.gemm_isa``) and pdlab's kernel record."""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

from benchmarks import (add_common_args, add_isa_arg, gemm_isa, isa_line, print_table,
                        reexec_under_isa, setup_threads, vllm_peer)
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams
from experiments.workloads import sharegpt

BUDGET = 2048
OUTPUT_LEN = 64
# K decode steps per decode row: at B = 64 (6,892 prompt tokens, 4 prefill steps at the
# 2048 budget) ~40 of them are full decode steps.
DECODE_STEPS = 48
_ids = itertools.count()


class PdlabSide:
    """``run(prompts, max_tokens) -> (seconds, outputs)`` on one Engine sized for 64 rows."""

    def __init__(self, loaded, max_model_len: int, max_num_seqs: int) -> None:
        self.engine = Engine(loaded, EngineConfig(max_num_seqs=max_num_seqs,
                                                  max_model_len=max_model_len,
                                                  max_num_batched_tokens=BUDGET,
                                                  enable_prefix_caching=False))

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        requests = self._requests(prompts, max_tokens)
        start = time.perf_counter()
        out = self.engine.generate(requests)
        return time.perf_counter() - start, [out[r.request_id] for r in requests]

    def step_times(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        """``VLLMPeer.step_times`` on this engine: every prompt added at once, each
        ``Engine.step()`` timed: ``[[seconds, tokens, first tokens, finished requests], ...]``."""
        for r in self._requests(prompts, max_tokens):
            self.engine.add_request(r)
        steps = []
        while self.engine.has_unfinished():
            start = time.perf_counter()
            out = self.engine.step()
            seconds = time.perf_counter() - start
            steps.append([seconds, len(out.tokens), sum(t.index == 0 for t in out.tokens),
                          len(out.finished)])
        return steps

    @staticmethod
    def _requests(prompts: list[list[int]], max_tokens: int) -> list[Request]:
        return [Request(f"vv{next(_ids)}", tuple(p),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for p in prompts]


def workload_prompts(tokenizer) -> list[list[int]]:
    """The rows' prompts: 16 ShareGPT prompts, seed 0 (1,723 tokens with SmolLM2's tokenizer)."""
    return [list(r.prompt_token_ids) for r in sharegpt(tokenizer, 16, seed=0)]


def decode_step_s(steps: list[list[float]], batch: int) -> float:
    """The median seconds of the full decode steps among ``steps`` (rows ``[seconds, tokens,
    first tokens, finished requests]``, one per engine step): those that made exactly
    ``batch`` tokens, none of them a request's first, and finished no request.

    Raises:
        ValueError: no step was a full decode step (K too small for the prefill to end
            before the first request finishes).
    """
    full = [s[0] for s in steps if s[1] == batch and s[2] == 0 and s[3] == 0]
    if not full:
        raise ValueError(f"no full decode step at B = {batch} among {len(steps)} steps")
    return statistics.median(full)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    add_isa_arg(parser)
    args = parser.parse_args(argv)
    reexec_under_isa("benchmarks.vs_vllm", args.isa, argv)
    if not vllm_peer.available():
        print(f"{vllm_peer.VENV_PYTHON} not found: run `make vllm-venv` first")
        return 2
    repeats = args.repeats or (1 if args.quick else 3)
    batch_sizes = [1, 16] if args.quick else args.batch_sizes
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    prompts = workload_prompts(loaded.tokenizer)
    max_model_len = max(len(p) for p in prompts) + OUTPUT_LEN + 1
    cores = sorted(os.sched_getaffinity(0))
    num_seqs = max(16, *batch_sizes)
    sides = {"pdlab": PdlabSide(loaded, max_model_len, num_seqs)}
    sides["vLLM"] = vllm_peer.VLLMPeer(max_model_len, BUDGET, cores)
    print(f"vLLM {sides['vLLM'].version} (CPU build, prefix caching off) and pdlab, both on "
          f"cores {cores}, token budget {BUDGET}")
    print(isa_line(args.isa))
    vllm_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name, python, env in (("pdlab", sys.executable, dict(os.environ)),
                              ("vLLM", vllm_peer.VENV_PYTHON, vllm_env)):
        seen = gemm_isa.probe(python, env)
        print(f"{name} GEMM ISA (library verbose): oneDNN via {seen['onednn_via']}: isa "
              f"{seen['onednn_isa']}, kernel {seen['onednn_kernel']}; MKL: {seen['mkl_isa']}")
    print(f"pdlab {sides['pdlab'].engine.runner.ops.summary()}")
    cycled = lambda b: [prompts[i % len(prompts)] for i in range(b)]  # noqa: E731
    jobs = {"16x64": (prompts, OUTPUT_LEN), "prefill": (prompts, 1)}
    for b in batch_sizes:
        jobs[f"B={b}"] = (cycled(b), 1 + DECODE_STEPS)
    best = {(job, side): float("inf") for job in jobs for side in sides}
    outputs = {}
    try:
        for round_idx in range(repeats + 1):  # round 0: warm-up, discarded
            for job, (job_prompts, max_tokens) in jobs.items():
                for side_name, side in sides.items():
                    if job.startswith("B="):
                        seconds = decode_step_s(side.step_times(job_prompts, max_tokens),
                                                len(job_prompts))
                    else:
                        seconds, outputs[(job, side_name)] = side.run(job_prompts, max_tokens)
                    if round_idx:
                        best[(job, side_name)] = min(best[(job, side_name)], seconds)
    finally:
        sides["vLLM"].close()

    rows = []
    for name, job in (("16 prompts x 64 tokens", "16x64"),
                      ("prefill only (max_tokens=1)", "prefill")):
        rows.append([name, best[(job, "pdlab")], best[(job, "vLLM")],
                     best[(job, "pdlab")] / best[(job, "vLLM")]])
    for b in batch_sizes:
        rows.append([f"decode step B={b} (median)", best[(f"B={b}", "pdlab")],
                     best[(f"B={b}", "vLLM")], best[(f"B={b}", "pdlab")] / best[(f"B={b}", "vLLM")]])
    print(f"SmolLM2-135M fp32 CPU; seconds, min of {repeats} alternating rounds after a warm-up")
    print_table(["row", "pdlab_s", "vLLM_s", "pdlab/vLLM"], rows)
    equal = sum(a == b for a, b in zip(outputs[("16x64", "pdlab")], outputs[("16x64", "vLLM")]))
    worst = max(r[3] for r in rows)
    print(f"ratio pdlab/vLLM worst {worst:.2f} (target <= 1.0: "
          f"{'met' if worst <= 1.0 else 'NOT met'}); greedy 16x64 outputs equal token for "
          f"token: {equal}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
