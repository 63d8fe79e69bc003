"""Prefill cost per prompt token from 128 to 2048 tokens, chunked or not.

One prompt of P random token ids (seed 0; ids 3.. so none is BOS/EOS), prefill only
(``max_tokens=1``), SmolLM2-135M fp32 on the pinned core(s), for P in {128, 256, 512, 1024,
2048}. Contenders, interleaved round by round (min of N rounds):

1. **pdlab**: a colocated ``Engine`` (one slot), ``Engine.generate`` of the one request,
   token budget >= P (the prompt runs whole in one step).
2. **pdlab@512**: the same with chunked prefill at a token budget of 512 (the ``make run``
   default): a 2048-token prompt runs as four chunks, each attending to the cached prefix.
3. **transformers**: ``model(ids, logits_to_keep=1)`` (sdpa attention; one forward, no cache
   kept), the logits of the last token.
4. **vLLM** and **vLLM@512** (only when ``.venv-vllm`` exists): vLLM's CPU build offline,
   prefix caching off, token budget 2048 and 512 (``benchmarks.vllm_peer``); its time is
   ``LLM.generate``'s wall time inside its process.

Prints ms per prompt token for each, pdlab / vLLM, and pdlab's ms/token relative to its own
at P = 128 (targets: <= 1.15 at P = 1024 and 2048, chunked and not; pdlab / vLLM <= 1.0), and
how many contenders' first tokens equal transformers' argmax.

``--isa avx2`` caps every contender alike (oneDNN, MKL and pdlab's C build:
``benchmarks.ISA_CAPS``, as in ``benchmarks.vs_vllm``), so an AVX-512 machine stands in for
an AVX2-only one; each pdlab engine prints its kernel choice on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

from benchmarks import (add_common_args, add_isa_arg, isa_line, print_table, reexec_under_isa,
                        setup_threads, vllm_peer)
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams
from experiments.timing import summarize

LENGTHS = (128, 256, 512, 1024, 2048)
CHUNK_BUDGET = 512
TARGET_FLAT = 1.15
_ids = itertools.count()


def _pdlab(loaded, prompt: list[int], budget: int):
    engine = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=len(prompt) + 1,
                                         max_num_batched_tokens=budget,
                                         enable_prefix_caching=False))

    def run() -> tuple[float, int]:
        request = Request(f"ps{next(_ids)}", tuple(prompt), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        out = engine.generate([request])[request.request_id]
        return time.perf_counter() - start, out[0]
    return run


def _transformers(model, prompt: list[int]):
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def run() -> tuple[float, int]:
        start = time.perf_counter()
        logits = model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits
        return time.perf_counter() - start, int(logits[0, -1].argmax())
    return run


def _vllm(peer, prompt: list[int]):
    def run() -> tuple[float, int]:
        seconds, outputs = peer.run([prompt], 1)
        return seconds, outputs[0][0]
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefill_scaling",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if installed")
    add_isa_arg(parser)
    args = parser.parse_args(argv)
    reexec_under_isa("benchmarks.prefill_scaling", args.isa, argv)
    repeats = args.repeats or (2 if args.quick else 3)
    lengths = args.lengths or ([128, 512, 1024] if args.quick else list(LENGTHS))
    print(setup_threads(args.threads))
    print(isa_line(args.isa))
    loaded = load_model(ModelConfig("smollm2-135m"))
    model = loaded.model
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in lengths}
    peers = {}
    if vllm_peer.available() and not args.no_vllm:
        cores = sorted(os.sched_getaffinity(0))
        peers = {"vLLM": vllm_peer.VLLMPeer(max(lengths) + 1, max(lengths), cores),
                 "vLLM@512": vllm_peer.VLLMPeer(max(lengths) + 1, CHUNK_BUDGET, cores)}
        print(f"vLLM {peers['vLLM'].version} (CPU build, prefix caching off) on cores {cores}")
    else:
        print("vLLM: .venv-vllm not found (make vllm-venv) or --no-vllm: column skipped")
    try:
        contenders = {n: {"pdlab": _pdlab(loaded, p, max(n, CHUNK_BUDGET)),
                          "pdlab@512": _pdlab(loaded, p, CHUNK_BUDGET),
                          "transformers": _transformers(model, p),
                          **{name: _vllm(peer, p) for name, peer in peers.items()}}
                     for n, p in prompts.items()}
        names = list(contenders[lengths[0]])
        samples = {(n, c): [] for n in lengths for c in names}
        first = {}
        for round_idx in range(repeats + 1):  # round 0 is a discarded warm-up
            for n in lengths:
                for c in names:
                    seconds, token = contenders[n][c]()
                    first[(n, c)] = token
                    if round_idx:
                        samples[(n, c)].append(seconds)
    finally:
        for peer in peers.values():
            peer.close()
    ms = {key: summarize(s).min_s * 1e3 / key[0] for key, s in samples.items()}
    print(f"prefill only, one prompt of P tokens, SmolLM2-135M fp32 CPU; ms per prompt token, "
          f"min of {repeats} interleaved rounds after one warm-up")
    has_vllm = bool(peers)
    headers = ["P", *[f"{c} ms/tok" for c in names], "pdlab/P128", "pdlab@512/P128"]
    if has_vllm:
        headers += ["pdlab/vLLM", "pdlab@512/vLLM@512"]
    rows = []
    base = lengths[0]
    for n in lengths:
        row = [n, *[ms[(n, c)] for c in names], ms[(n, "pdlab")] / ms[(base, "pdlab")],
               ms[(n, "pdlab@512")] / ms[(base, "pdlab@512")]]
        if has_vllm:
            row += [ms[(n, "pdlab")] / ms[(n, "vLLM")], ms[(n, "pdlab@512")] / ms[(n, "vLLM@512")]]
        rows.append(row)
    print_table(headers, rows)
    agree = {c: sum(first[(n, c)] == first[(n, "transformers")] for n in lengths) for c in names}
    print("first token equals transformers' argmax: "
          + ", ".join(f"{c} {agree[c]}/{len(lengths)}" for c in names if c != "transformers"))
    long = [n for n in lengths if n >= 1024]
    flat = max((ms[(n, c)] / ms[(base, c)] for n in long for c in ("pdlab", "pdlab@512")),
               default=float("nan"))
    line = (f"ratio pdlab ms/token at P>=1024 vs P={base}: worst {flat:.2f} "
            f"(target <= {TARGET_FLAT}: {'met' if flat <= TARGET_FLAT else 'NOT met'})")
    if has_vllm:
        worst = max(max(ms[(n, "pdlab")] / ms[(n, "vLLM")],
                        ms[(n, "pdlab@512")] / ms[(n, "vLLM@512")]) for n in lengths)
        verdict = "met" if worst <= 1.0 else "NOT met"
        line += f"; pdlab/vLLM worst {worst:.2f} (target <= 1.0: {verdict})"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
