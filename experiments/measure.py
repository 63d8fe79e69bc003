"""The measurement helpers of ``pdlab profile``, ``kv-cost`` and ``interference`` (and the
benchmarks): engine steps set up untimed and run once per timed run (a prefill of P tokens, a decode
step of B requests at context C, a mixed step), the model loaded for measuring, the results' place
and header. On one emulated device (``kv-cost --device emu:i``) a prefill's seconds are the ones the
emulated runner holds that step for (``modelled_prefill``), not a timing. Every time is
``experiments.timing``'s estimator (min of N runs after ``WARMUP`` warm-ups, median beside it)."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch

from engine.config import DTYPES, EngineConfig, ModelConfig
from engine.emulated import Emulation
from engine.engine import Engine
from engine.model import LoadedModel, ModelLoadError, load_geometry, load_model
from engine.request import Request, SamplingParams
from experiments.options import (check_device, check_model, check_out, device_arg,
                                 measure_device_arg, option_error, positive_int)
from deployment.placement import emulation_for
from experiments.timing import Timing, device_sync, measure

WARMUP = 1

_request_ids = itertools.count()


def random_prompt(gen: torch.Generator, vocab_size: int, length: int) -> tuple[int, ...]:
    """``length`` token ids drawn uniformly by ``gen`` from [3, vocab) (clear of the usual
    BOS/EOS/PAD ids; [0, vocab) for a vocabulary of 3 or fewer)."""
    low = 3 if vocab_size > 3 else 0
    return tuple(torch.randint(low, vocab_size, (length,), generator=gen).tolist())


def random_request(gen: torch.Generator, loaded: LoadedModel, prompt_len: int,
                   max_tokens: int) -> Request:
    """A request of a ``prompt_len``-token random prompt that produces exactly ``max_tokens``
    tokens (``ignore_eos``), with a fresh id."""
    return Request(f"profile-{next(_request_ids)}",
                   random_prompt(gen, loaded.vocab_size, prompt_len),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def tick(progress) -> None:
    """Advance a progress bar (tqdm) by one, if there is one."""
    if progress is not None:
        progress.update(1)


def prefill_engine(loaded: LoadedModel, max_prompt_len: int, device: str = "cpu",
                   emulation: Emulation | None = None) -> Engine:
    """A one-slot engine whose token budget runs a prompt of ``max_prompt_len`` whole (on
    ``emulation``'s device when given: ``loaded`` is then a geometry)."""
    budget = max(max_prompt_len, 1)
    return Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=max(max_prompt_len + 1, 2),
                                       max_num_batched_tokens=budget, device=device),
                  quiet=emulation is not None, emulation=emulation)


def prefill_point(engine: Engine, prompt_len: int, seed: int = 0) -> tuple[Callable, Callable]:
    """``(setup, run)`` of one prefill measurement: ``setup`` queues a ``prompt_len``-token
    prompt (``max_tokens=1``), ``run`` is the single ``engine.step()`` that prefills it whole
    (and samples its only token), so the request finishes and frees its KV."""
    gen = torch.Generator().manual_seed(seed)

    def setup() -> None:
        engine.add_request(random_request(gen, engine.loaded, prompt_len, max_tokens=1))

    def run() -> None:
        outputs = engine.step()
        if len(outputs) != 1 or engine.step_records[-1].num_prefill_tokens != prompt_len:
            raise RuntimeError(f"prefill of {prompt_len} tokens did not run whole in one step")
    return setup, run


def time_prefill(engine: Engine, prompt_len: int, repeats: int, seed: int = 0) -> Timing:
    """Time the single ``engine.step()`` that prefills a ``prompt_len``-token prompt whole
    (and samples its only token); queueing the request is untimed (``prefill_point``)."""
    setup, run = prefill_point(engine, prompt_len, seed)
    timing = measure(run, repeats, setup=setup, warmup=WARMUP,
                     sync=device_sync(engine.config.device))
    assert engine.is_empty(), "prefill requests must finish and free their KV"
    return timing


def profile_prefill(loaded: LoadedModel, prompt_lens: Sequence[int], repeats: int,
                    device: str = "cpu", seed: int = 0, progress=None) -> pd.DataFrame:
    """Prefill time per prompt length.

    Returns:
        One row per P: ``prompt_len, prefill_s`` (min), ``prefill_median_s``,
        ``per_token_s`` (= prefill_s / P), ``num_runs``."""
    engine = prefill_engine(loaded, max(prompt_lens), device)
    rows = []
    for p in prompt_lens:
        rows.append(prefill_row(time_prefill(engine, p, repeats, seed + p), p))
        tick(progress)
    return pd.DataFrame(rows)


def modelled_prefill(loaded: LoadedModel, emulation: Emulation, prompt_lens: Sequence[int],
                     seed: int = 0, progress=None) -> pd.DataFrame:
    """Prefill seconds per prompt length on an emulated device: the seconds the emulated runner
    holds the whole-prompt step for (``EmulatedRunner.last_modelled_s``, the profile's prefill
    fit). Nothing is timed. Returns ``profile_prefill``'s columns (``num_runs`` 1)."""
    engine = prefill_engine(loaded, max(prompt_lens), "cpu", emulation)
    rows = []
    for p in prompt_lens:
        setup, run = prefill_point(engine, p, seed + p)
        setup()
        run()
        s = engine.runner.last_modelled_s
        rows.append(prefill_row(Timing(s, s, 1, (s,)), p))
        tick(progress)
    return pd.DataFrame(rows)


def prefill_row(t: Timing, prompt_len: int) -> dict:
    return {"prompt_len": prompt_len, "prefill_s": t.min_s, "prefill_median_s": t.median_s,
            "per_token_s": t.min_s / prompt_len, "num_runs": t.num_runs}


def decode_point(loaded: LoadedModel, batch_size: int, context_len: int, repeats: int,
                 device: str = "cpu", seed: int = 0) -> tuple[Callable, Callable]:
    """``(run, close)`` of one decode measurement: an engine whose ``batch_size`` requests each hold
    ``context_len`` tokens of KV (their prefill runs here, untimed); ``run`` is one decode step over
    all of them (``WARMUP + repeats`` runs fit before they finish), ``close`` aborts them."""
    max_tokens = WARMUP + repeats + 2  # never finishes while being timed
    budget = max(batch_size, min(batch_size * context_len, 4096))
    engine = Engine(loaded, EngineConfig(max_num_seqs=batch_size,
                                         max_model_len=context_len + max_tokens,
                                         max_num_batched_tokens=budget, device=device))
    gen = torch.Generator().manual_seed(seed)
    # the prompt is context_len - 1 tokens: its prefill samples one token, so the first
    # decode step runs with context_len tokens in the KV (context_len - 1 cached + 1 new)
    requests = [random_request(gen, loaded, max(context_len - 1, 1), max_tokens)
                for _ in range(batch_size)]
    for request in requests:
        engine.add_request(request)
    while any(s.is_prefilling or s.num_output_tokens == 0 for s in engine.states.values()):
        engine.step()

    def run() -> None:
        outputs = engine.step()
        record = engine.step_records[-1]
        if len(outputs) != batch_size or record.num_prefill_tokens != 0:
            raise RuntimeError(f"decode step ran {len(outputs)} of {batch_size} requests")

    def close() -> None:
        for request in requests:
            engine.abort(request.request_id)
        assert engine.is_empty()
    return run, close


def decode_row(t: Timing, batch_size: int, context_len: int) -> dict:
    return {"batch_size": batch_size, "context_len": context_len, "step_s": t.min_s,
            "step_median_s": t.median_s, "per_token_s": t.min_s / batch_size,
            "num_runs": t.num_runs}


def mixed_point(loaded: LoadedModel, batch_size: int, context_len: int, prompt_len: int,
                repeats: int, device: str = "cpu", seed: int = 0
                ) -> tuple[Callable, Callable, Callable]:
    """``(setup, run, close)`` of one mixed measurement: an engine whose ``batch_size``
    requests each hold ``context_len`` tokens of KV (prefilled here, untimed); ``setup``
    queues a new ``prompt_len``-token prompt, ``run`` is the step that decodes the batch and
    prefills that prompt whole (it stops after its first token), ``close`` aborts the batch."""
    max_tokens = WARMUP + repeats + 2
    budget = max(prompt_len + batch_size, min(batch_size * context_len, 4096))
    engine = Engine(loaded, EngineConfig(max_num_seqs=batch_size + 1,
                                         max_model_len=max(context_len + max_tokens, prompt_len + 1),
                                         max_num_batched_tokens=budget, device=device))
    gen = torch.Generator().manual_seed(seed)
    decoders = [random_request(gen, loaded, max(context_len - 1, 1), max_tokens)
                for _ in range(batch_size)]
    for request in decoders:
        engine.add_request(request)
    while any(s.is_prefilling or s.num_output_tokens == 0 for s in engine.states.values()):
        engine.step()

    def setup() -> None:
        engine.add_request(random_request(gen, loaded, prompt_len, max_tokens=1))

    def run() -> None:
        engine.step()
        record = engine.step_records[-1]
        if record.num_prefill_tokens != prompt_len or record.num_decode_tokens != batch_size:
            raise RuntimeError(f"mixed step ran {record.num_prefill_tokens} prompt and "
                               f"{record.num_decode_tokens} decode tokens, not {prompt_len} "
                               f"and {batch_size}")

    def close() -> None:
        for request in decoders:
            engine.abort(request.request_id)
        assert engine.is_empty()
    return setup, run, close


def mixed_row(t: Timing, prompt_len: int, batch_size: int, context_len: int) -> dict:
    return {"prompt_len": prompt_len, "batch_size": batch_size, "context_len": context_len,
            "step_s": t.min_s, "step_median_s": t.median_s, "num_runs": t.num_runs}


def add_measure_args(parser: argparse.ArgumentParser, default_out: str,
                     emulated: bool = False) -> None:
    """Options of the commands that measure one model on one device (``profile``,
    ``kv-cost``, ``interference``); ``emulated``: ``--device`` may also be ``emu:i``, with
    ``--device-profile`` and ``--emu-kv-scale`` (``kv-cost``)."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, tiny-random-llama, or a local HF model directory "
                             "(default: smollm2-135m)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="(default: float32)")
    if emulated:
        parser.add_argument("--device", default="cpu", type=measure_device_arg,
                            help="cpu, cuda:i, or emu:i: an emulated device timed by "
                                 "--device-profile (default: cpu)")
        fields = EngineConfig.__dataclass_fields__
        parser.add_argument("--device-profile", default=None,
                            help=fields["device_profile"].metadata["help"])
        parser.add_argument("--emu-kv-scale", default=1.0, type=float,
                            help=fields["emu_kv_scale"].metadata["help"] + " (default: 1)")
    else:
        parser.add_argument("--device", default="cpu", type=device_arg,
                            help="cpu or cuda:i (default: cpu)")
    parser.add_argument("--repeats", default=5, type=positive_int,
                        help="timed runs per point after 1 warm-up; the estimator is their "
                             "minimum (default: 5)")
    parser.add_argument("--seed", default=0, type=int, help="random prompt ids (default: 0)")
    parser.add_argument("--threads", default=1, type=positive_int,
                        help="torch intra-op threads (default: 1, steady on a shared CPU; "
                             "a pdlab CPU worker also runs one thread per core it owns)")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: results/{default_out}-<timestamp>)")


def out_dir(args: argparse.Namespace, name: str) -> Path:
    path = Path(args.out) if args.out else Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_for(args: argparse.Namespace, emulation: Emulation | None = None) -> LoadedModel | None:
    """Apply ``--threads`` and load the model of ``args`` (on an emulated device, its geometry in
    the profile's dtype: no weights); prints the error and returns None when it cannot."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if emulation is not None:
        try:
            return load_geometry(ModelConfig(args.model, emulation.device.dtype))
        except (ModelLoadError, ValueError) as err:
            print(f"error: --model {args.model}: {err}", file=sys.stderr)
            return None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: CUDA is not available here (use cpu)", file=sys.stderr)
        return None
    try:
        return load_model(ModelConfig(args.model, args.dtype), device=args.device)
    except (ModelLoadError, ValueError) as err:
        print(f"error: --model {args.model}: {err}", file=sys.stderr)
        return None


def run_header(loaded: LoadedModel, args: argparse.Namespace,
               emulation: Emulation | None = None) -> str:
    threads = torch.get_num_threads()
    devices = getattr(args, "devices", None)  # interference and kv-cost have no --devices
    where = (f"devices {','.join(devices)} at once (one process each, one thread per core)"
             if devices else f"device {args.device}")
    if emulation is not None:
        e = emulation.describe()
        where += (f" (emulated: {e['device_name']} from {args.device_profile}, source "
                  f"{e['source']}, KV scale {e['kv_scale']:g}; KV on this host's CPU)")
    return (f"model {loaded.name} ({args.dtype}), {where}, torch {torch.__version__}, "
            f"{threads} intra-op threads")


def check_measure_args(args: argparse.Namespace) -> ModelConfig:
    """The options ``add_measure_args`` adds: the model exists (its config file, no weights),
    ``--out`` is not a file, a ``cuda:i`` device exists. Returns the model.

    Raises:
        ValueError: ``argument --x: ...``."""
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    check_out(args.out)
    check_device(args.device)
    return model


def emulation_of(args: argparse.Namespace) -> Emulation | None:
    """The ``Emulation`` of ``--device emu:i`` (None for a real device), by the rules of
    ``deployment.placement.emulation_for``; ``--dtype`` must be the profile's.

    Raises:
        ValueError: ``argument --x: ...``."""
    engine = EngineConfig(device_profile=args.device_profile, emu_kv_scale=args.emu_kv_scale)
    emulation = emulation_for((args.device,), ModelConfig(args.model, args.dtype), engine,
                              whole_kv_caches=False)  # only the measured prompts' blocks
    if emulation is not None and emulation.device.dtype != args.dtype:
        raise option_error("--dtype", f"the device profile {args.device_profile} is "
                                      f"{emulation.device.dtype}, not {args.dtype}: pass "
                                      f"--dtype {emulation.device.dtype}")
    return emulation
