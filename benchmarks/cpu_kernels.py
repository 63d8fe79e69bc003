"""The engine with its fused CPU kernels against itself without them, side by side.

What is compared (SmolLM2-135M fp32, one pinned core): two Engines on the same model, one
whose runner uses ``engine/cpu_kernels.py`` (residual add + RMSNorm, RoPE + K/V write,
SiLU * up as one C call each; the GEMM for up to 256 rows; paged decode attention) and one
built as if they could not load (torch's GEMMs, SDPA, the modules' ops: what a machine
without a C compiler runs). Rows:

1. **decode B** for each ``--batch-sizes``: B random prompts of ``--context - 1`` tokens,
   prefilled untimed; then one ``Engine.step()`` (B decode tokens) per timed run, the two
   engines alternating, both caches growing alike.
2. **prefill P** for each ``--prompt-lengths``: one prompt of P random tokens,
   ``max_tokens=1`` (``Engine.generate``), alternating.

With ``--against REV`` a third contender, **REV**, runs ``engine/runner.py`` as it was at
git revision REV (e.g. the commit before the kernels) on the same model, so the whole
change (kernels plus the fewer-ops PyTorch path) is visible side by side. REV's runner runs
against this checkout's ``engine/cpu_kernels.py``, so REV must call only kernels whose
signatures are unchanged (e.g. 03548fa, before the GEMM and attention kernels).

Prints fused/torch (and fused/REV) per row (< 1: faster) and whether the greedy tokens agree
(they should: the kernels equal the ops they replace to float32 rounding).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch

from benchmarks import (add_common_args, estimator_line, measure_interleaved, print_table,
                        setup_threads)
from engine import cpu_kernels
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner


def _prompts(vocab_size: int, batch_size: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch_size, length), generator=gen).tolist()


_AGAINST: dict[str, type] = {}  # "REV" -> ModelRunner class of engine/runner.py at REV


def runner_at(rev: str) -> type:
    """``ModelRunner`` from ``engine/runner.py`` as committed at git revision ``rev``."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:engine/runner.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"runner_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:engine/runner.py", "exec"), module.__dict__)
    return module.ModelRunner


def _engines(loaded, max_num_seqs: int, max_model_len: int) -> dict[str, Engine]:
    names = ("fused", "torch", *_AGAINST)
    engines = {name: Engine(loaded, EngineConfig(max_num_seqs=max_num_seqs,
                                                 max_model_len=max_model_len,
                                                 max_num_batched_tokens=max(2048, max_model_len),
                                                 enable_prefix_caching=False))
               for name in names}
    if getattr(engines["fused"].runner.ops, "kernels", None) is None:
        raise RuntimeError("the CPU kernels did not build here: nothing to compare")
    engines["torch"].runner = _torch_runner(loaded, engines["torch"].kv_store)
    for rev, runner_cls in _AGAINST.items():
        engines[rev].runner = runner_cls(loaded.model, engines[rev].kv_store, "cpu")
    return engines


def _torch_runner(loaded, kv_store) -> ModelRunner:
    """A runner built as where the kernels cannot load: torch's GEMMs (oneDNN/MKL), SDPA,
    the modules' elementwise ops."""
    load = cpu_kernels.load
    cpu_kernels.load = lambda: None
    try:
        return ModelRunner(loaded.model, kv_store, "cpu")
    finally:
        cpu_kernels.load = load


def _row(name: str, t: dict, agree: str) -> list:
    row = [name, t["fused"].min_s, t["torch"].min_s, t["fused"].min_s / t["torch"].min_s]
    for rev in _AGAINST:
        row += [t[rev].min_s, t["fused"].min_s / t[rev].min_s]
    return row + [agree]


def decode_row(loaded, batch_size: int, context: int, repeats: int) -> list:
    max_tokens = repeats + 4  # never finishes while timed
    engines = _engines(loaded, batch_size, context + max_tokens + 1)
    prompts = _prompts(loaded.model.config.vocab_size, batch_size, context - 1, batch_size)
    for engine in engines.values():
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"d{i}", tuple(p), SamplingParams(
                max_tokens=max_tokens, ignore_eos=True)))
        engine.step()  # prefill all B whole

    def stepper(engine):
        return lambda: engine.step()
    t = measure_interleaved({n: stepper(e) for n, e in engines.items()}, repeats)
    tokens = {n: [e.states[f"d{i}"].token_ids[context - 1:] for i in range(batch_size)]
              for n, e in engines.items()}
    for engine in engines.values():
        for i in range(batch_size):
            engine.abort(f"d{i}")
    agree = min(sum(a == b for a, b in zip(tokens["fused"], tokens[n])) for n in tokens)
    return _row(f"decode B={batch_size}", t, f"{agree}/{batch_size}")


def prefill_row(loaded, length: int, repeats: int) -> list:
    engines = _engines(loaded, 1, length + 2)
    prompt = _prompts(loaded.model.config.vocab_size, 1, length, length)[0]
    outputs = {}

    def runner(name):
        def run():
            outputs[name] = engines[name].generate([Request(f"p{name}", tuple(prompt),
                                                            SamplingParams(max_tokens=1))])
        return run
    t = measure_interleaved({n: runner(n) for n in engines}, repeats)
    agree = all(outputs[n][f"p{n}"] == outputs["fused"]["pfused"] for n in engines)
    return _row(f"prefill P={length}", t, f"{int(agree)}/1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--context", type=int, default=128,
                        help="KV tokens per row at the first timed decode step (default 128)")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="also run engine/runner.py as at this git revision")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 10)
    print(setup_threads(args.threads))
    loaded = load_model(ModelConfig("smollm2-135m"))
    if args.against:
        _AGAINST[args.against] = runner_at(args.against)
    rows = [decode_row(loaded, b, args.context, repeats) for b in args.batch_sizes]
    rows += [prefill_row(loaded, p, max(2, repeats // 3)) for p in args.prompt_lengths]
    print(f"SmolLM2-135M fp32 CPU, fused kernels vs the pure-PyTorch path; "
          f"{estimator_line(repeats)} (prefill rows: {max(2, repeats // 3)})")
    extra = [h for rev in _AGAINST for h in (f"{rev}_s", f"fused/{rev}")]
    print_table(["row", "fused_s", "torch_s", "fused/torch", *extra, "greedy agree"], rows)
    print("ratio fused/torch: " + ", ".join(f"{r[0]}: {r[3]:.3f}" for r in rows))
    for i, rev in enumerate(_AGAINST):
        print(f"ratio fused/{rev}: " + ", ".join(f"{r[0]}: {r[5 + 2 * i]:.3f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
