"""The paged KV cache against the slot store it replaced, side by side in one run.

1. decode step: at each batch size B, B decode rows at equal KV lengths (``--context``)
   through two ``ModelRunner``s of SmolLM2-135M holding the same KV: this tree's paged runner
   and the slot-based runner of commit ``SLOT_COMMIT``, loaded from git into private modules.
   They alternate round by round (``measure_interleaved``); each timed call is one
   ``runner.execute``. Target: paged / slot <= 1.05 at every B; the logits must agree to
   float32 rounding. ``--layouts``: ``strided`` (equally spaced runs, one view), ``runs``
   (consecutive blocks, uneven starts) and ``scattered`` (the gather path).
2. build: an ``Engine`` with ``max_num_seqs=256, max_model_len=2048`` under
   ``kv_cache_memory_gb=2``: seconds and KV bytes (targets < 1 s, <= 2 GiB), beside the slot
   store's bytes for the same limits (not built) and the time of zero-filling a 16-slot store.
3. capacity: how many ShareGPT requests fit at once at full length in 2 GiB: pdlab's blocks
   of 16 against vLLM's CPU rule (``num_blocks = memory // bytes_per_block``, block 128, one
   null block). Concurrency = usable blocks / mean blocks per request.

Output: tables and ``ratio paged/slot`` / ``build`` / ``capacity`` lines with the targets."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import GIB, KVStore
from engine.model import LoadedModel, load_model, load_tokenizer
from engine.runner import ModelRunner
from engine.scheduler import ScheduledBatch
from experiments.workload_spec import WorkloadSpec
from experiments.workloads import sharegpt

SLOT_COMMIT = "3ed2280"  # main before the paged KV cache
VLLM_CPU_BLOCK_SIZE = 128  # vllm/platforms/cpu.py: the CPU backend's default block size
TARGET_RATIO = 1.05
ROOT = Path(__file__).resolve().parents[1]


def load_slot_runner(commit: str = SLOT_COMMIT) -> types.ModuleType:
    """The slot-based ``engine/runner.py`` of ``commit`` with that commit's ``KVStore``, as
    private modules (``_slot_kv_cache``, ``_slot_runner``); its ``ModelRunner`` and
    ``KVStore`` are attributes of the returned module.

    Raises:
        RuntimeError: ``git show`` fails (not a git checkout, or the commit is missing).
    """
    def source(path: str) -> str:
        done = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"git show {commit}:{path} failed: {done.stderr.strip()}")
        return done.stdout

    kv_mod = types.ModuleType("_slot_kv_cache")
    sys.modules["_slot_kv_cache"] = kv_mod  # dataclasses look their module up while building
    exec(compile(source("engine/kv_cache.py"), "_slot_kv_cache.py", "exec"), kv_mod.__dict__)
    text = source("engine/runner.py").replace("from engine.kv_cache import KVStore",
                                              "from _slot_kv_cache import KVStore")
    runner_mod = types.ModuleType("_slot_runner")
    sys.modules["_slot_runner"] = runner_mod
    exec(compile(text, "_slot_runner.py", "exec"), runner_mod.__dict__)
    runner_mod.KVStore = kv_mod.KVStore
    return runner_mod


class _Row:
    """A decode row both runners accept: ``slot`` for the old one, ``block_ids`` for the new."""

    def __init__(self, token_ids: list[int], slot: int, block_ids: list[int]) -> None:
        self.token_ids, self.slot, self.block_ids = token_ids, slot, block_ids
        self.num_computed_tokens = len(token_ids) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefilling(self) -> bool:
        return False


LAYOUTS = ("strided", "runs", "scattered")


def block_tables(layout: str, batch_size: int, blocks_per_row: int) -> tuple[list[list[int]], int]:
    """Per-row block ids for ``layout`` (see the module doc) and the store's block count."""
    rng = random.Random(batch_size)
    if layout == "runs":  # a gap of 1-3 free blocks after each row: uneven starts
        tables, start = [], 0
        for _ in range(batch_size):
            tables.append(list(range(start, start + blocks_per_row)))
            start += blocks_per_row + rng.randint(1, 3)
        return tables, start
    order = list(range(batch_size * blocks_per_row))
    if layout == "scattered":
        rng.shuffle(order)
    return ([order[r * blocks_per_row:(r + 1) * blocks_per_row] for r in range(batch_size)],
            len(order))


def compare_decode(loaded: LoadedModel, slot_mod, batch_size: int, context: int, repeats: int,
                   block_size: int, layout: str) -> dict:
    """Time one decode forward of B rows at KV length ``context`` on both runners."""
    spec, model = loaded.kv_spec, loaded.model
    gen = torch.Generator().manual_seed(batch_size)
    tables, num_blocks = block_tables(layout, batch_size, -(-context // block_size))
    rows, kvs = [], []
    for r in range(batch_size):
        tokens = torch.randint(3, model.config.vocab_size, (context,), generator=gen).tolist()
        rows.append(_Row(tokens, r, tables[r]))
        kvs.append(torch.randn(spec.kv_shape(context - 1), generator=gen) * 0.5)  # cached prefix
    slot_store = slot_mod.KVStore(spec, batch_size, context)
    paged_store = KVStore(spec, num_blocks, block_size)
    for row, kv in zip(rows, kvs):
        slot_store.write(row.slot, kv)
        paged_store.write(row.block_ids, kv)
    slot_runner = slot_mod.ModelRunner(model, slot_store)
    paged_runner = ModelRunner(model, paged_store)
    batch = ScheduledBatch()
    for row in rows:
        batch.add(row, 1)
    logits = {"slot": slot_runner.execute(batch), "paged": paged_runner.execute(batch)}
    max_diff = (logits["slot"] - logits["paged"]).abs().max().item()
    timings = measure_interleaved({"slot": lambda: slot_runner.execute(batch),
                                   "paged": lambda: paged_runner.execute(batch)}, repeats)
    t_slot, t_paged = timings["slot"], timings["paged"]
    return {"layout": layout, "B": batch_size, "context": context, "slot_s": t_slot.min_s,
            "slot_median_s": t_slot.median_s, "paged_s": t_paged.min_s,
            "paged_median_s": t_paged.median_s, "ratio": t_paged.min_s / t_slot.min_s,
            "max_logit_diff": max_diff}


def measure_build(loaded: LoadedModel) -> dict:
    """Seconds and bytes of building the paged engine at 256 x 2048 under 2 GiB, and of
    zero-filling the slot store of ``max_num_seqs=16`` x 2048 (the old default)."""
    config = EngineConfig(max_num_seqs=256, max_model_len=2048, kv_cache_memory_gb=2.0)
    start_s = time.perf_counter()
    engine = Engine(loaded, config)
    build_s = time.perf_counter() - start_s
    paged_bytes = engine.kv_store.num_bytes
    blocks, tokens = engine.kv_store.num_blocks, engine.kv_store.num_tokens
    del engine
    spec = loaded.kv_spec
    start_s = time.perf_counter()
    slot = torch.zeros((spec.num_layers, 2, 16, spec.num_kv_heads, 2048, spec.head_dim))
    slot16_s = time.perf_counter() - start_s
    slot16_bytes = slot.numel() * slot.element_size()
    del slot
    return {"build_s": build_s, "paged_bytes": paged_bytes, "blocks": blocks, "tokens": tokens,
            "slot256_bytes": 256 * 2048 * spec.bytes_per_token, "slot16_s": slot16_s,
            "slot16_bytes": slot16_bytes}


def measure_capacity(loaded: LoadedModel, num_requests: int, budget_gib: float = 2.0) -> dict:
    """Concurrent ShareGPT requests at full length in ``budget_gib`` (module doc, part 3)."""
    spec = WorkloadSpec()  # pdlab's default ShareGPT filters
    tokenizer = load_tokenizer(ModelConfig("smollm2-135m"))
    reqs = sharegpt(tokenizer, num_requests, seed=0, min_prompt_len=spec.min_prompt_len,
                    max_prompt_len=spec.max_prompt_len, max_total_len=2048)
    lengths = [len(r.prompt_token_ids) + r.output_len for r in reqs]
    budget, per_token = int(budget_gib * GIB), loaded.kv_spec.bytes_per_token
    out = {"mean_len": sum(lengths) / len(lengths), "bytes_per_token": per_token}
    for name, block, reserved in (("pdlab", 16, 0), ("vllm", VLLM_CPU_BLOCK_SIZE, 1)):
        blocks = budget // (block * per_token) - reserved
        mean_blocks = sum(-(-n // block) for n in lengths) / len(lengths)
        out[name] = {"block_size": block, "blocks": blocks, "tokens": blocks * block,
                     "concurrent": blocks / mean_blocks}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paged_kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=384,
                        help="KV tokens per row (default 384, about a ShareGPT request)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--no-build", action="store_true", help="skip the build measurement")
    parser.add_argument("--capacity-requests", type=int, default=500,
                        help="ShareGPT requests in the capacity comparison (0 = skip it)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    slot_mod = load_slot_runner()
    rows = [compare_decode(loaded, slot_mod, b, args.context, repeats, args.block_size, layout)
            for layout in args.layouts for b in args.batch_sizes]
    print(f"decode forward (runner.execute), SmolLM2-135M fp32 CPU, equal KV lengths, block "
          f"{args.block_size}; {estimator_line(repeats)}")
    print_table(["layout", "B", "context", "slot_s", "slot_median_s", "paged_s",
                 "paged_median_s", "paged/slot", "max |logit diff|"],
                [[r["layout"], r["B"], r["context"], r["slot_s"], r["slot_median_s"],
                  r["paged_s"], r["paged_median_s"], r["ratio"], r["max_logit_diff"]]
                 for r in rows])
    for layout in args.layouts:
        mine = [r for r in rows if r["layout"] == layout]
        ok = all(r["ratio"] <= TARGET_RATIO for r in mine)
        print(f"ratio paged/slot ({layout}): "
              + ", ".join(f"B={r['B']}: {r['ratio']:.3f}" for r in mine)
              + (f" (target <= {TARGET_RATIO}: {'met' if ok else 'NOT met'})"
                 if layout == "strided" else ""))
    if not args.no_build:
        b = measure_build(loaded)
        ok = b["build_s"] < 1.0 and b["paged_bytes"] <= 2 * GIB
        print(f"build: Engine(max_num_seqs=256, max_model_len=2048, kv_cache_memory_gb=2) took "
              f"{b['build_s']:.3f} s, KV {b['blocks']} blocks = {b['tokens']} tokens = "
              f"{b['paged_bytes'] / GIB:.3f} GiB (target < 1 s and <= 2 GiB: "
              f"{'met' if ok else 'NOT met'}); a slot store of the same shape would be "
              f"{b['slot256_bytes'] / GIB:.1f} GiB; zero-filling the old default slot store "
              f"(16 x 2048, {b['slot16_bytes'] / GIB:.2f} GiB) took {b['slot16_s']:.2f} s")
    if args.capacity_requests:
        c = measure_capacity(loaded, args.capacity_requests)
        p, v = c["pdlab"], c["vllm"]
        print(f"capacity in 2 GiB ({c['bytes_per_token']} bytes/token; {args.capacity_requests} "
              f"ShareGPT requests, mean {c['mean_len']:.0f} tokens at full length): pdlab "
              f"{p['blocks']} blocks of {p['block_size']} = {p['tokens']} tokens, "
              f"{p['concurrent']:.1f} requests at once; vLLM CPU (VLLM_CPU_KVCACHE_SPACE=2, "
              f"its formula) {v['blocks']} usable blocks of {v['block_size']} = {v['tokens']} "
              f"tokens, {v['concurrent']:.1f} at once (target pdlab >= vLLM: "
              f"{'met' if p['concurrent'] >= v['concurrent'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
