"""The engine's decode step against a bare transformers forward of the same batch.

What is compared, at each batch size B (SmolLM2-135M, fp32, CPU):

1. B random prompts of ``context - 1`` tokens each (equal lengths) are prefilled, untimed,
   into both contenders: the engine (its own KV store) and a transformers ``DynamicCache``.
2. **engine**: one whole ``Engine.step()`` (schedule, runner forward over B decode tokens,
   greedy sampling, counter update), i.e. everything a serving step pays.
3. **bare**: ``model(next_ids [B, 1], past_key_values=cache)`` and the greedy ``argmax`` of
   its logits: transformers' own forward, no scheduler, no sampler objects.
4. The two alternate round by round; both caches grow by one token per timed step, so the
   k-th timed step of each runs at the same context ``context + k``.

Output: a table per B (min and median seconds) and ``ratio engine/bare`` lines; the target
is <= 1.10 at every B. Greedy tokens of the two are compared as a sanity check.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from transformers import DynamicCache

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from engine.request import Request, SamplingParams

TARGET = 1.10


def _prompts(vocab_size: int, batch_size: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch_size, length), generator=gen).tolist()


def compare(loaded: LoadedModel, batch_size: int, context: int, repeats: int) -> dict:
    """Prefill both contenders, then time interleaved decode steps; returns a result row."""
    model = loaded.model
    prompts = _prompts(model.config.vocab_size, batch_size, context - 1, seed=batch_size)
    max_tokens = repeats + 4  # never finishes while being timed
    engine = Engine(loaded, EngineConfig(max_num_seqs=batch_size,
                                         max_model_len=context + max_tokens + 1,
                                         max_num_batched_tokens=batch_size * context,
                                         enable_prefix_caching=False))
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"d{i}", tuple(p), SamplingParams(max_tokens=max_tokens,
                                                                     ignore_eos=True)))
    engine.step()  # prefill all B prompts whole (samples each one's first token)
    assert all(not s.is_prefilling for s in engine.states.values())

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(torch.tensor(prompts), past_key_values=cache, use_cache=True)
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True), "tokens": []}

    @torch.inference_mode()
    def bare() -> None:
        logits = model(state["next"], past_key_values=cache, use_cache=True).logits
        state["next"] = logits[:, -1].argmax(-1, keepdim=True)
        state["tokens"].append(state["next"][:, 0].tolist())

    def step() -> None:
        if len(engine.step()) != batch_size:
            raise RuntimeError("decode step did not produce a token for every request")

    timings = measure_interleaved({"engine": step, "bare": bare}, repeats)
    engine_tokens = [engine.states[f"d{i}"].token_ids[context - 1:] for i in range(batch_size)]
    bare_tokens = [[first] + [row[i] for row in state["tokens"]]
                   for i, first in enumerate(out.logits[:, -1].argmax(-1).tolist())]
    agree = sum(e == b for e, b in zip(engine_tokens, bare_tokens))
    for i in range(batch_size):
        engine.abort(f"d{i}")
    assert engine.is_empty()
    t_engine, t_bare = timings["engine"], timings["bare"]
    return {"B": batch_size, "context": context, "engine_s": t_engine.min_s,
            "engine_median_s": t_engine.median_s, "bare_s": t_bare.min_s,
            "bare_median_s": t_bare.median_s, "ratio": t_engine.min_s / t_bare.min_s,
            "tokens_agree": f"{agree}/{batch_size}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128,
                        help="KV tokens per row at the first timed step (default 128)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 20)
    print(setup_threads(args.threads))
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values -> cache rename
    loaded = load_model(ModelConfig("smollm2-135m"))
    rows = [compare(loaded, b, args.context, repeats) for b in args.batch_sizes]
    print(f"decode step, SmolLM2-135M fp32 CPU, equal per-row KV lengths; {estimator_line(repeats)}")
    print("engine = Engine.step() (schedule + forward + greedy sample + update); "
          "bare = transformers forward with DynamicCache + argmax")
    print_table(["B", "context", "engine_s", "engine_median_s", "bare_s", "bare_median_s",
                 "engine/bare", "tokens_agree"],
                [[r["B"], r["context"], r["engine_s"], r["engine_median_s"], r["bare_s"],
                  r["bare_median_s"], r["ratio"], r["tokens_agree"]] for r in rows])
    worst = max(r["ratio"] for r in rows)
    ok = all(r["ratio"] <= TARGET for r in rows)
    print("ratio engine/bare: " + ", ".join(f"B={r['B']}: {r['ratio']:.3f}" for r in rows)
          + f" (max {worst:.3f}; target <= {TARGET}: {'met' if ok else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
