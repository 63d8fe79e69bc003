"""glibc's malloc thresholds raised (``engine/host_memory.py``) or left alone, side by side.

Each contender is a child process of this one with ``PDLAB_MALLOC_TUNING`` set to 1 (the
engine's default: thresholds raised once) or 0 (glibc as it is), crossed with the GEMM the
engine runs: the per-machine choice (``native``) or oneDNN forced for every projection
(``PDLAB_FORCE_KERNELS=linear=onednn``, the library vLLM's CPU build runs, and the one
pdlab's selector picked for large row counts on an AVX-512 Zen 4). A child loads SmolLM2,
runs the job once to warm up, then ``--runs`` times, and reports per run its wall time,
minor page faults and system CPU time (``getrusage``). Rounds alternate the contenders; a
figure is the minimum over every run of every round (faults and system time: the last run's).

The job (one thread, pinned): the prefill of ``benchmarks.vs_vllm``, its 16 ShareGPT
prompts (seed 0, 1,723 tokens) with ``max_tokens=1``. Decode steps are left out: their
activations (kilobytes at B = 16) come from the heap either way; a run with 16 decode steps
after the prefill faulted as often as the prefill alone.

    python -m benchmarks.host_memory [--rounds 2] [--runs 2]

Prints one row per contender, and the ratio of its wall time to the same GEMM's untuned one;
where ``.venv-vllm`` exists (or ``$PDLAB_VLLM_VENV``), a last row for vLLM's CPU build on
the same prefill in its own process on the same core (``VLLMPeer.run_rusage``), after
pdlab's rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from benchmarks import print_table, vllm_peer, vs_vllm
from engine.config import ModelConfig
from engine.model import load_model

MAX_TOKENS = 1  # prefill and the first token
KERNELS = {"native": "", "onednn": "linear=onednn"}


def vllm_runs(core: int, rounds: int, runs: int) -> list[list[float]]:
    """vLLM's CPU build on the same prefill (its own malloc and oneDNN), one warm-up then
    ``rounds * runs`` runs: ``[seconds, minor faults, system seconds]`` each."""
    prompts = vs_vllm.workload_prompts(load_model(ModelConfig("smollm2-135m")).tokenizer)
    with vllm_peer.VLLMPeer(max(map(len, prompts)) + 32, vs_vllm.BUDGET, [core]) as peer:
        peer.run_rusage(prompts, MAX_TOKENS)
        return [list(peer.run_rusage(prompts, MAX_TOKENS)) for _ in range(rounds * runs)]


def child(runs: int) -> None:
    """Run the prefill once to warm up, then ``runs`` times (``vs_vllm.PdlabSide.run``);
    print one JSON line of per-run ``[seconds, minor faults, system seconds]`` and the
    engine's malloc line."""
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig("smollm2-135m"))
    prompts = vs_vllm.workload_prompts(loaded.tokenizer)
    side = vs_vllm.PdlabSide(loaded, max(map(len, prompts)) + 32, len(prompts))

    def once() -> list[float]:
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds, _ = side.run(prompts, MAX_TOKENS)
        after = resource.getrusage(resource.RUSAGE_SELF)
        return [seconds, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime]

    once()
    print(json.dumps({"runs": [once() for _ in range(runs)],
                      "malloc": side.engine.runner.ops.describe().get("malloc", "")}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per child")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.runs)
        return 0
    core = sorted(os.sched_getaffinity(0))[-1]
    contenders = [(kernels, tuning) for kernels in KERNELS for tuning in ("1", "0")]
    results: dict[tuple, list] = {c: [] for c in contenders}
    malloc: dict[tuple, str] = {}
    print(f"one thread pinned to core {core}; {args.rounds} rounds x {args.runs} runs")
    for _ in range(args.rounds):
        for kernels, tuning in contenders:
            env = dict(os.environ, PDLAB_MALLOC_TUNING=tuning, PDLAB_FORCE_KERNELS=KERNELS[kernels])
            out = subprocess.run(["taskset", "-c", str(core), sys.executable, "-m",
                                  "benchmarks.host_memory", "--child", "--runs", str(args.runs)],
                                 env=env, capture_output=True, text=True, check=True)
            reply = json.loads(out.stdout.strip().splitlines()[-1])
            results[(kernels, tuning)] += reply["runs"]
            malloc[(kernels, tuning)] = reply["malloc"]
    rows = []
    for kernels, tuning in contenders:
        runs = results[(kernels, tuning)]
        best = min(r[0] for r in runs)
        rows.append([kernels, malloc[(kernels, tuning)], best, runs[-1][1], runs[-1][2],
                     best / min(r[0] for r in results[(kernels, "0")])])
    if vllm_peer.available():  # after pdlab's rounds: the peer's process holds the core
        runs = vllm_runs(core, args.rounds, args.runs)
        rows.append(["vLLM's CPU build (oneDNN)", "vLLM's process as it runs",
                     min(r[0] for r in runs), runs[-1][1], runs[-1][2], ""])
    print_table(["GEMM", "malloc", "prefill s", "minor faults", "system s", "/ untuned"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
