"""Python overhead of a decode step's layout at many running requests.

SmolLM2-135M fp32, B requests (default 256) with prompts of 8..64 random tokens (seed 0),
prefilled untimed; then N decode steps at B rows. Each step's ``ModelRunner._layout`` (index
tensors, decode grouping, masks) and, inside it, ``_group_decodes`` are timed with
``time.perf_counter`` around the calls, and so is the whole ``Engine.step()``. Prints the
per-step seconds of each and their share of the step (target: a few percent).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import add_common_args, print_table, setup_threads
from engine import runner as runner_mod
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams


def _timed(fn, bucket: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - start)
    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    steps = args.repeats or (3 if args.quick else 8)
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    lengths = torch.randint(8, 65, (args.batch,), generator=gen).tolist()
    engine = Engine(loaded, EngineConfig(max_num_seqs=args.batch, max_model_len=64 + steps + 80,
                                         max_num_batched_tokens=2048,
                                         enable_prefix_caching=False))
    for i, n in enumerate(lengths):
        prompt = tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())
        engine.add_request(Request(f"o{i}", prompt,
                                   SamplingParams(max_tokens=steps + 64, ignore_eos=True)))
    while sum(s.num_decode_tokens == args.batch for s in engine.step_records) == 0:
        engine.step()  # prefill (untimed) until one step decodes all B rows
    layout_s, group_s, step_s = [], [], []
    runner = engine.runner
    original_layout, original_group = runner._layout, runner_mod._group_decodes
    runner._layout = _timed(original_layout, layout_s)
    runner_mod._group_decodes = _timed(original_group, group_s)
    try:
        for _ in range(steps):
            start = time.perf_counter()
            assert len(engine.step()) == args.batch
            step_s.append(time.perf_counter() - start)
    finally:
        runner._layout, runner_mod._group_decodes = original_layout, original_group
    best_step = min(step_s)
    print(f"decode step at B={args.batch} (prompts of {min(lengths)}..{max(lengths)} tokens), "
          f"SmolLM2-135M fp32; min over {steps} steps")
    print_table(["part", "seconds (min)", "seconds (median)", "share of step (min/min)"],
                [[name, min(xs), sorted(xs)[len(xs) // 2], min(xs) / best_step]
                 for name, xs in (("Engine.step", step_s), ("ModelRunner._layout", layout_s),
                                  ("  of which _group_decodes", group_s))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
