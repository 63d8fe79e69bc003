"""End to end against transformers: the same prompts, the same fixed output lengths.

Workload: 16 ShareGPT first turns (``experiments.workloads.sharegpt``, SmolLM2 tokenizer,
seed 0; chat template applied), each asked for exactly 64 output tokens, greedy, EOS
ignored. SmolLM2-135M, fp32, CPU. Three contenders, one after another in each round:

1. **engine**: a colocated ``Engine`` (16 KV slots, token budget 2048, chunked prefill),
   ``Engine.generate`` over all requests at once (``ignore_eos=True``). Building the engine
   (allocating its KV store) is untimed.
2. **generate_batch**: transformers' continuous batching, ``model.generate_batch`` with a
   KV cache sized for this workload (a ``ContinuousBatchingConfig`` whose ``num_blocks`` and
   ``max_batch_tokens`` match the engine's; left to itself it sizes the cache from the
   machine's whole RAM) and ``eos_token_id=-1`` (disabled).
3. **generate**: sequential ``model.generate`` per prompt, ``do_sample=False``,
   ``max_new_tokens=64`` with EOS disabled (``eos_token_id=-1``, so the lengths match
   ``ignore_eos`` without masking EOS out the way ``min_new_tokens`` would).

Greedy outputs of the engine and of generate_batch are compared token for token with
``generate()``; the engine must match all prompts (asserted). Each contender first runs a
small warm-up (2 prompts, 4 tokens), discarded.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks import add_common_args, print_table, setup_threads
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams
from experiments.timing import describe, measure, summarize
from experiments.workloads import sharegpt

TARGET_VS_BATCH = 3.0
TARGET_VS_GENERATE = 5.0
_ids = itertools.count()


class Contenders:
    """The three ways to run ``prompts`` for ``output_len`` tokens each; each run stores its
    outputs (token ids per prompt) in ``self.outputs[name]``."""

    def __init__(self, loaded, prompts: list[list[int]], output_len: int) -> None:
        self.loaded, self.model = loaded, loaded.model
        self.prompts, self.output_len = prompts, output_len
        self.outputs: dict[str, list[list[int]]] = {}
        self.budget = 2048
        max_len = max(len(p) for p in prompts) + output_len
        self.engine_config = EngineConfig(max_num_seqs=len(prompts), max_model_len=max_len + 1,
                                          max_num_batched_tokens=self.budget,
                                          enable_prefix_caching=False)
        self.engine: Engine | None = None
        pad = self.model.generation_config.pad_token_id
        self.gen_config = lambda: GenerationConfig(  # noqa: E731  (generate_batch mutates it)
            max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=pad)
        page = 256
        blocks_per_request = -(-max_len // page)
        self.cb_config = ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks_per_request * len(prompts) + 4,
            max_batch_tokens=self.budget, max_requests_per_batch=len(prompts))

    def build_engine(self) -> None:
        self.engine = Engine(self.loaded, self.engine_config)

    def run_engine(self) -> None:
        requests = [Request(f"vs{next(_ids)}", tuple(p),
                            SamplingParams(max_tokens=self.output_len, ignore_eos=True))
                    for p in self.prompts]
        out = self.engine.generate(requests)
        self.outputs["engine"] = [out[r.request_id] for r in requests]

    def run_generate_batch(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate_batch(self.prompts, generation_config=self.gen_config(),
                                            continuous_batching_config=self.cb_config,
                                            progress_bar=False)
        results = list(out.values())  # in input order
        self.outputs["generate_batch"] = [list(r.generated_tokens) for r in results]

    @torch.inference_mode()
    def run_generate(self) -> None:
        outputs = []
        for p in self.prompts:
            ids = torch.tensor([p])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      generation_config=self.gen_config())
            outputs.append(out[0, len(p):].tolist())
        self.outputs["generate"] = outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_transformers",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=None, help="default 16 (quick: 8)")
    parser.add_argument("--output-len", type=int, default=None, help="default 64 (quick: 32)")
    parser.add_argument("--skip-generate-batch", action="store_true")
    args = parser.parse_args(argv)
    repeats = args.repeats or 1
    num_prompts = args.num_prompts or (8 if args.quick else 16)
    output_len = args.output_len or (32 if args.quick else 64)
    print(setup_threads(args.threads))
    transformers.logging.set_verbosity_error()
    loaded = load_model(ModelConfig("smollm2-135m"))
    prompts = [list(r.prompt_token_ids) for r in sharegpt(loaded.tokenizer, num_prompts, seed=0)]
    lens = [len(p) for p in prompts]
    print(f"workload: {num_prompts} ShareGPT prompts (seed 0; {sum(lens)} prompt tokens, "
          f"{min(lens)}..{max(lens)} each) x {output_len} output tokens, greedy, EOS ignored")

    full, warm = Contenders(loaded, prompts, output_len), Contenders(loaded, prompts[:2], 4)
    names = ["engine", "generate"] + ([] if args.skip_generate_batch else ["generate_batch"])
    runs = {"engine": "run_engine", "generate_batch": "run_generate_batch",
            "generate": "run_generate"}
    setups = {"engine": "build_engine"}
    for name in names:  # warm-up: a small run of each, discarded
        if name in setups:
            getattr(warm, setups[name])()
        getattr(warm, runs[name])()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):  # interleaved rounds; each run is one `measure` (no extra warm-up)
        for name in names:
            setup = getattr(full, setups[name]) if name in setups else None
            samples[name].append(measure(getattr(full, runs[name]), 1, setup=setup,
                                         warmup=0).min_s)
    timings = {n: summarize(s) for n, s in samples.items()}

    reference = full.outputs["generate"]
    match = {n: sum(a == b for a, b in zip(full.outputs[n], reference)) for n in names}
    assert all(len(o) == output_len for o in full.outputs["engine"])
    total_tokens = num_prompts * output_len
    print(f"end to end, SmolLM2-135M fp32 CPU; estimator: {describe(repeats, 0)} per contender "
          "(after one small discarded warm-up run each); contenders interleaved")
    print_table(["contender", "total_s", "median_s", "output tok/s", "engine speedup",
                 "match generate()"],
                [[n, timings[n].min_s, timings[n].median_s, total_tokens / timings[n].min_s,
                  timings[n].min_s / timings["engine"].min_s, f"{match[n]}/{num_prompts}"]
                 for n in names])
    vs_generate = timings["generate"].min_s / timings["engine"].min_s
    line = (f"ratio speedup: engine vs sequential generate() {vs_generate:.2f}x "
            f"(target >= {TARGET_VS_GENERATE}: "
            f"{'met' if vs_generate >= TARGET_VS_GENERATE else 'NOT met'})")
    if "generate_batch" in timings:
        vs_batch = timings["generate_batch"].min_s / timings["engine"].min_s
        line += (f"; vs generate_batch {vs_batch:.2f}x (target >= {TARGET_VS_BATCH}: "
                 f"{'met' if vs_batch >= TARGET_VS_BATCH else 'NOT met'})")
    print(line + f"; engine greedy tokens match generate() on {match['engine']}/{num_prompts}")
    assert match["engine"] == num_prompts, "engine greedy output differs from generate()"
    return 0


if __name__ == "__main__":
    sys.exit(main())
