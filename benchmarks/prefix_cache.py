"""Prefix caching side by side: pdlab with it on and off, and vLLM's CPU build with it on, on
the same shared-prefix and multi-turn workloads, in one run.

SmolLM2-135M, fp32, greedy, EOS ignored, token budget 2048, KV blocks of ``--block-size``
tokens on both sides (default 128, vLLM's CPU default):

1. shared prefixes: ``workloads.prefix_repetition``, 4 system prompts of 256 tokens x 8
   questions of 64, 16 output tokens, seed 0, all in one ``generate``;
2. multi-turn: ``workloads.sharegpt_conversations``, 8 conversations of 3 turns, each turn
   of all of them in one ``generate``, each side building histories from its own answers.

Every run starts from a cold cache. Time = the ``generate`` calls' wall time; hit rate =
prompt tokens found cached / prompt tokens. Contenders alternate on the same pinned core(s);
each figure is the minimum over ``--repeats`` rounds after a warm-up. Prints hit rate,
seconds and pdlab/vLLM (targets: hit rate within 1 point, time <= 1.0), outputs equal or not.

    python -m benchmarks.prefix_cache [--quick] [--no-vllm] [--threads 1]

``--admission KV_TOKENS`` runs the equal-KV-budget admission check instead: both engines get
KV_TOKENS of KV (vLLM: ``num_gpu_blocks_override`` = KV_TOKENS / block size + 1, its null
block), caching off, ``ADMISSION_REQUESTS`` ShareGPT first turns at once. Prints each side's
peak running requests, preemptions and usable KV tokens (target: pdlab's peak >= vLLM's),
and pdlab with ``--kv-reservation full`` beside them.

    python -m benchmarks.prefix_cache --admission 2048 --block-size 16"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from benchmarks import add_common_args, print_table, setup_threads, vllm_peer
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams
from experiments import workloads

BUDGET = 2048
BLOCK_SIZE = 128  # vLLM's CPU backend default
_ids = itertools.count()


def shared_prefix_rounds(quick: bool) -> list[list[workloads.WorkloadRequest]]:
    n = 16 if quick else 32
    return [workloads.prefix_repetition(n, seed=0, num_prefixes=4, prefix_len=256,
                                        suffix_len=64, output_len=16, token_range=(100, 49000))]


def conversations(tokenizer, quick: bool) -> list[workloads.Conversation]:
    return workloads.sharegpt_conversations(tokenizer, 4 if quick else 8, seed=0, min_turns=3,
                                            max_turns=3, max_output_len=32, max_total_len=1536,
                                            mean_think_time_s=0.0)


class PdlabSide:
    """``run(prompts, max_tokens) -> (seconds, outputs, cached tokens)`` on one Engine;
    ``reset()`` builds a new one (cold cache, untimed)."""

    def __init__(self, loaded, max_model_len: int, caching: bool, block_size: int) -> None:
        self.loaded, self.caching = loaded, caching
        self.config = EngineConfig(max_num_seqs=64, max_model_len=max_model_len,
                                   max_num_batched_tokens=BUDGET, enable_prefix_caching=caching,
                                   block_size=block_size)
        self.engine: Engine | None = None

    def reset(self) -> None:
        self.engine = Engine(self.loaded, self.config, quiet=True)

    def run(self, prompts: list[list[int]], max_tokens: list[int]):
        requests = [Request(f"pc{next(_ids)}", tuple(p), SamplingParams(max_tokens=m, ignore_eos=True))
                    for p, m in zip(prompts, max_tokens)]
        outputs = {r.request_id: [] for r in requests}
        cached = {}
        for r in requests:
            self.engine.add_request(r)
        start = time.perf_counter()
        while self.engine.has_unfinished():
            for out in self.engine.step():
                outputs[out.request_id].append(out.token_id)
                if out.index == 0:
                    cached[out.request_id] = out.num_cached_tokens or 0
        seconds = time.perf_counter() - start
        return seconds, [outputs[r.request_id] for r in requests], [cached[r.request_id] for r in requests]


class VLLMSide:
    def __init__(self, peer: vllm_peer.VLLMPeer) -> None:
        self.peer, self._reset = peer, False

    def reset(self) -> None:
        self._reset = True  # applied with the next generate, untimed

    def run(self, prompts: list[list[int]], max_tokens: list[int]):
        # one max_tokens per workload round (the rounds below keep them equal per call)
        assert len(set(max_tokens)) == 1, "vLLM side: one max_tokens per generate"
        seconds, outputs, cached = self.peer.run_cached(prompts, max_tokens[0], self._reset)
        self._reset = False
        return seconds, outputs, cached


def run_shared(side, rounds) -> tuple[float, list, int, int]:
    side.reset()
    seconds, outs, hits, queries = 0.0, [], 0, 0
    for items in rounds:
        s, o, c = side.run([list(r.prompt_token_ids) for r in items], [r.output_len for r in items])
        seconds += s
        outs += o
        hits += sum(c)
        queries += sum(r.num_prompt_tokens for r in items)
    return seconds, outs, hits, queries


def run_conversations(side, convs, output_len: int) -> tuple[float, list, int, int]:
    """Turn by turn; every turn asks for ``output_len`` tokens (one max_tokens per call)."""
    side.reset()
    convs = [workloads.Conversation(c.conversation_id,
                                    tuple(workloads.Turn(t.new_token_ids, output_len)
                                          for t in c.turns), c.source) for c in convs]
    replay = workloads.ConversationReplay(convs)
    items = replay.first_turns()
    seconds, outs, hits, queries = 0.0, [], 0, 0
    while items:
        s, o, c = side.run([list(r.prompt_token_ids) for r in items], [r.output_len for r in items])
        seconds += s
        outs += o
        hits += sum(c)
        queries += sum(r.num_prompt_tokens for r in items)
        items = [n for n in (replay.next_turn(r, out, 0.0) for r, out in zip(items, o)) if n]
    return seconds, outs, hits, queries


ADMISSION_REQUESTS = 32


def admission_requests(tokenizer) -> list[workloads.WorkloadRequest]:
    return workloads.sharegpt(tokenizer, ADMISSION_REQUESTS, seed=0, max_prompt_len=512,
                              max_output_len=128)


def pdlab_admission(loaded, requests, kv_tokens: int, block_size: int,
                    max_model_len: int, kv_reservation: str = "on_demand") -> dict:
    """pdlab's side of the admission check: one Engine with ``kv_tokens`` of KV
    (``kv_capacity_tokens``, blocks allocated per ``kv_reservation``, caching off), every
    request added at once,
    stepped to the end. Returns ``{"peak_running", "num_preemptions", "kv_blocks", "steps",
    "seconds"}`` as ``vllm_peer.VLLMPeer.admission`` does (peak: most requests in the
    scheduler's running list after a step)."""
    config = EngineConfig(max_num_seqs=256, max_model_len=max_model_len,
                          max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
                          block_size=block_size, kv_capacity_tokens=kv_tokens,
                          kv_reservation=kv_reservation)
    engine = Engine(loaded, config, quiet=True)
    for r in requests:
        engine.add_request(Request(f"adm{next(_ids)}", tuple(r.prompt_token_ids),
                                   SamplingParams(max_tokens=r.output_len, ignore_eos=True)))
    peak, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    return {"peak_running": peak, "num_preemptions": engine.scheduler.num_preemptions,
            "kv_blocks": engine.scheduler.capacity.num_blocks, "steps": steps,
            "seconds": time.perf_counter() - start}


def run_admission(loaded, kv_tokens: int, block_size: int, with_vllm: bool) -> int:
    """``--admission``: both sides at one KV budget; prints the table, returns the exit code."""
    if kv_tokens % block_size:
        raise ValueError(f"--admission {kv_tokens}: must be a multiple of --block-size {block_size}")
    requests = admission_requests(loaded.tokenizer)
    max_model_len = max(r.num_prompt_tokens + r.output_len for r in requests) + 1
    if max_model_len > kv_tokens:
        raise ValueError(f"--admission {kv_tokens}: below the longest request ({max_model_len - 1} tokens)")
    results = {"pdlab (on-demand)": pdlab_admission(loaded, requests, kv_tokens, block_size,
                                                    max_model_len),
               "pdlab (--kv-reservation full)": pdlab_admission(
                   loaded, requests, kv_tokens, block_size, max_model_len, "full")}
    if with_vllm:
        cores = sorted(os.sched_getaffinity(0))
        with vllm_peer.VLLMPeer(max_model_len, BUDGET, cores, block_size=block_size,
                                num_kv_blocks=kv_tokens // block_size + 1) as peer:
            print(f"vLLM {peer.version} (CPU build, prefix caching off) beside pdlab, cores {cores}")
            results["vLLM"] = peer.admission([list(r.prompt_token_ids) for r in requests],
                                             [r.output_len for r in requests])
    print(f"SmolLM2-135M fp32 CPU; {len(requests)} ShareGPT requests at once "
          f"({sum(r.num_prompt_tokens for r in requests)} prompt, "
          f"{sum(r.output_len for r in requests)} output tokens); KV budget {kv_tokens} tokens "
          f"in blocks of {block_size}; prefix caching off")
    print_table(["engine", "KV tokens", "peak running", "preemptions", "steps", "seconds"],
                [[n, r["kv_blocks"] * block_size, r["peak_running"], r["num_preemptions"],
                  r["steps"], r["seconds"]] for n, r in results.items()])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--no-vllm", action="store_true", help="pdlab only")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="KV block tokens on both sides (default 128, vLLM's CPU default)")
    parser.add_argument("--admission", type=int, default=None, metavar="KV_TOKENS",
                        help="run the equal-KV-budget admission check at KV_TOKENS instead")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    if not args.no_vllm and not vllm_peer.available():
        print(f"{vllm_peer.VENV_PYTHON} not found: run `make vllm-venv` (or pass --no-vllm)")
        return 2
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    if args.admission is not None:
        return run_admission(loaded, args.admission, args.block_size, not args.no_vllm)
    shared = shared_prefix_rounds(args.quick)
    convs = conversations(loaded.tokenizer, args.quick)
    turn_len = 32
    longest = max(max(r.num_prompt_tokens + r.output_len for r in shared[0]),
                  max(c.num_prompt_tokens(c.num_turns - 1) + turn_len for c in convs))
    max_model_len = longest + 1
    sides = {"pdlab": PdlabSide(loaded, max_model_len, True, args.block_size),
             "pdlab (no cache)": PdlabSide(loaded, max_model_len, False, args.block_size)}
    peer = None
    if not args.no_vllm:
        cores = sorted(os.sched_getaffinity(0))
        peer = vllm_peer.VLLMPeer(max_model_len, BUDGET, cores, enable_prefix_caching=True,
                                  block_size=args.block_size)
        sides["vLLM"] = VLLMSide(peer)
        print(f"vLLM {peer.version} (CPU build, prefix caching on) beside pdlab, cores {cores}")
    jobs = {"shared prefixes": lambda side: run_shared(side, shared),
            "multi-turn": lambda side: run_conversations(side, convs, turn_len)}
    best = {(j, s): float("inf") for j in jobs for s in sides}
    result = {}
    try:
        for round_idx in range(repeats + 1):  # round 0: warm-up, discarded
            for job, fn in jobs.items():
                for name, side in sides.items():
                    seconds, outs, hits, queries = fn(side)
                    result[(job, name)] = (outs, hits, queries)
                    if round_idx:
                        best[(job, name)] = min(best[(job, name)], seconds)
    finally:
        if peer is not None:
            peer.close()
    rows = []
    for job in jobs:
        for name in sides:
            outs, hits, queries = result[(job, name)]
            ratio = ""
            if name != "vLLM" and "vLLM" in sides:
                ratio = f"{best[(job, name)] / best[(job, 'vLLM')]:.2f}"
            rows.append([job, name, f"{100 * hits / queries:.1f}%", f"{queries - hits}",
                         best[(job, name)], ratio])
    print(f"SmolLM2-135M fp32 CPU, KV blocks of {args.block_size} tokens; seconds: min of "
          f"{repeats} alternating rounds after a warm-up")
    print_table(["workload", "engine", "hit rate", "prefill tokens", "seconds", "/vLLM"], rows)
    for job in jobs:
        ref = result[(job, "pdlab (no cache)")][0]
        same = {n: sum(a == b for a, b in zip(result[(job, n)][0], ref)) for n in sides}
        print(f"{job}: outputs equal to pdlab without caching, token for token: "
              + ", ".join(f"{n} {k}/{len(ref)}" for n, k in same.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
