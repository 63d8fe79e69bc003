"""``pdlab profile``: the phase profile of one model on one device, through pdlab's own Engine.

1. Prefill: for each prompt length P, the one ``Engine.step()`` that prefills it whole is timed.
2. Decode vs context: B requests prefilled to context C, then single decode steps timed.
3. Decode vs batch: B requests at a fixed context; a least-squares line ``t = a + b*B``, R².
4. Mixed steps: B decodes beside one P-token prompt prefilled whole in the same step.
5. Derived: a prompt token's cost over an output token's, and a P x G table of TTFT and total
   time (prefill + G-1 decode steps from the context line).
6. The device profile (``planner.latency``): step models fitted on each point's median run, and
   per ``--transports`` transport a transfer model fitted on ``pdlab kv-cost``'s measurement.

``--from-silicon-db SYSTEM --backend vllm|sglang|trtllm --model CONFIG_DIR`` writes a GPU's
profile from NVIDIA's database instead (``planner.silicon``), with decode_check.csv (decode at
B = 1, 16, 64 against the database's TPOT); ``--tp T --pp P`` profile an instance of T x P GPUs
(the database's TP steps, PP as ``planner.latency`` models it), refused when it does not fit. Every time is the min of N runs after 1 warm-up, the
median beside it; steps 1-4 are interleaved (``timing.measure_interleaved``), so drift moves all
points alike. Outputs: prefill.csv, decode_context.csv, decode_batch.csv, mixed.csv,
pg_table.csv, kv_cost.csv, device_profile.json, summary.md, profile.png."""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import queue
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from engine.config import ModelConfig, cpu_cores_of
from engine.kv_cache import KVSpec
from engine.model import (SMOLLM2_NAME, TINY_NAMES, LoadedModel, cache_dir, load_model,
                          model_context_len, weight_bytes)
from experiments import measure, plots, transfer_cost
from experiments.measure import (WARMUP, add_measure_args, decode_point, decode_row, load_for,
                                 mixed_point, mixed_row, out_dir, prefill_engine, prefill_point,
                                 prefill_row, run_header, tick)
from experiments.options import (check_model, check_out, existing_device_set, int_list,
                                 option_error, positive_int, transport_list)
from experiments.report import markdown_table
from experiments.results import cpu_model
from experiments.timing import describe, device_sync, measure_interleaved
from engine.memory_fit import Geometry, check_fits
from planner import latency, silicon, sizes

DEFAULT_PROMPT_LENS = (1, 4, 16, 64, 128, 256, 512)
DEFAULT_CONTEXTS = (16, 64, 256, 1024)
# The context sweep also runs batched: at B = 1 a context token's cost is lost in the steps'
# noise, and B = 8 moves the step several times as much, so the coefficient is measurable.
DEFAULT_CONTEXT_BATCH_SIZES = (1, 8)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_BATCH_CONTEXT = 64
DEFAULT_PG_PROMPTS = (64, 256, 512)
DEFAULT_PG_OUTPUTS = (16, 64, 256)
DEFAULT_MIXED_PROMPTS = (64, 256)
DEFAULT_MIXED_BATCH_SIZES = (1, 4, 16)
DEFAULT_PROFILE_TRANSPORTS = ("inprocess",)
INTERLEAVED = "; every point once per round, rounds shuffled"
HELP = "prefill/decode phase profile of a model"
@dataclass(frozen=True)
class LinearFit:
    """Least-squares line ``y = a + b * x`` and its coefficient of determination."""

    a: float
    b: float
    r2: float

    def __call__(self, x):
        return self.a + self.b * np.asarray(x, dtype=float)


def fit_linear(x: Sequence[float], y: Sequence[float]) -> LinearFit:
    """Fit ``y = a + b * x`` by least squares (``numpy.polyfit`` degree 1); R² = 1 - SS_res /
    SS_tot, clipped to [0, 1] (1.0 when y is constant and fitted exactly).

    Raises:
        ValueError: fewer than two points, or x and y of different lengths."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.shape != ys.shape or xs.size < 2:
        raise ValueError(f"fit needs >= 2 points and x, y of equal length, got {xs.size} and {ys.size}")
    b, a = np.polyfit(xs, ys, 1)
    ss_res = float(np.sum((ys - (a + b * xs)) ** 2))
    ss_tot = float(np.sum((ys - ys.mean()) ** 2))
    r2 = 1.0 if ss_tot == 0.0 else 1.0 - ss_res / ss_tot
    return LinearFit(float(a), float(b), float(min(max(r2, 0.0), 1.0)))


def _context_seed(seed: int, batch_size: int, context_len: int) -> int:
    return seed + context_len + 100_003 * (batch_size - 1)  # B = 1 keeps its old seeds


def single_row(decode_context: pd.DataFrame) -> pd.DataFrame:
    """The context sweep's rows at its smallest batch size (B = 1 by default)."""
    return decode_context[decode_context["batch_size"] == decode_context["batch_size"].min()]


def profile_interleaved(loaded: LoadedModel, prompt_lens: Sequence[int], contexts: Sequence[int],
                        batch_sizes: Sequence[int], batch_context: int,
                        mixed_prompts: Sequence[int], mixed_batch_sizes: Sequence[int],
                        repeats: int, device: str = "cpu", seed: int = 0, progress=None,
                        context_batch_sizes: Sequence[int] = DEFAULT_CONTEXT_BATCH_SIZES
                        ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Every point of the four sweeps measured in interleaved rounds, each set up first,
    untimed (``timing.measure_interleaved``).

    Returns:
        ``(prefill, decode_context, decode_batch, mixed)``: prefill has the columns of
        ``profile_prefill``; the two decode sweeps one row per (batch size, context):
        ``batch_size, context_len, step_s`` (min), ``step_median_s``, ``per_token_s``
        (= step_s / B), ``num_runs``; mixed one row per (prompt length, batch size):
        ``prompt_len, batch_size, context_len, step_s``, ``step_median_s``, ``num_runs``."""
    points, closes = {}, []
    engine = prefill_engine(loaded, max(prompt_lens), device)
    for p in prompt_lens:
        points["prefill", p] = prefill_point(engine, p, seed + p)
    for kind, sizes in (("context", list(itertools.product(context_batch_sizes, contexts))),
                        ("batch", [(b, batch_context) for b in batch_sizes])):
        for b, c in sizes:
            run, close = decode_point(loaded, b, c, repeats, device,
                                      _context_seed(seed, b, c) if kind == "context" else seed + b)
            points[kind, b, c] = (None, run)
            closes.append(close)
    for p, b in itertools.product(mixed_prompts, mixed_batch_sizes):
        setup, run, close = mixed_point(loaded, b, batch_context, p, repeats, device, seed + p + b)
        points["mixed", p, b] = (setup, run)
        closes.append(close)
    timings = measure_interleaved(points, repeats, warmup=WARMUP, sync=device_sync(device),
                                  seed=seed, on_run=lambda: tick(progress))
    for close in closes:
        close()
    assert engine.is_empty(), "prefill requests must finish and free their KV"
    prefill = pd.DataFrame([prefill_row(timings["prefill", p], p) for p in prompt_lens])
    context = pd.DataFrame([decode_row(timings["context", b, c], b, c)
                            for b, c in itertools.product(context_batch_sizes, contexts)])
    batch = pd.DataFrame([decode_row(timings["batch", b, batch_context], b, batch_context)
                          for b in batch_sizes])
    mixed = pd.DataFrame([mixed_row(timings["mixed", p, b], p, b, batch_context)
                          for p, b in itertools.product(mixed_prompts, mixed_batch_sizes)],
                         columns=["prompt_len", "batch_size", "context_len", "step_s",
                                  "step_median_s", "num_runs"])
    return prefill, context, batch, mixed


def fit_device_profile(result: "ProfileResult", loaded: LoadedModel, dtype: str, device: str,
                       kv_table: pd.DataFrame | None = None):
    """The ``planner.latency.DeviceProfile`` of a profile run: step models fitted on the median
    times of its prefill, decode (both sweeps) and mixed rows; one transfer model per transport on
    the whole-request rows of ``kv_table`` (``kv_cost.kv_cost_table``); the model's weight bytes
    and, on CUDA, the device's memory (``mem_get_info``'s total).

    Raises:
        ValueError: too few points for a fit."""
    # the simulator needs a step's typical time, not its fastest: the fits take medians
    F = latency.StepFeatures
    prefill = [(F(int(p), int(p) * int(p)), float(t))
               for p, t in zip(result.prefill["prompt_len"], result.prefill["prefill_median_s"])]
    decode = [(F(batch_size=int(b), sum_context=int(b) * int(c)), float(t))
              for df in (result.decode_context, result.decode_batch)
              for b, c, t in zip(df["batch_size"], df["context_len"], df["step_median_s"])]
    mixed = [(F(int(p), int(p) * int(p), int(b), int(b) * int(c)), float(t))
             for p, b, c, t in zip(result.mixed["prompt_len"], result.mixed["batch_size"],
                                   result.mixed["context_len"], result.mixed["step_median_s"])] \
        if result.mixed is not None and len(result.mixed) else []
    pre, dec, mix = latency.fit_step_models(prefill, decode, mixed)
    transfers = {}
    if kv_table is not None and len(kv_table):
        whole = kv_table[kv_table["mode"] == "whole"]
        for name, g in whole.groupby("transport", sort=False):
            transfers[str(name)] = latency.fit_transfer(list(g["kv_bytes"]), list(g["transfer_s"]))
    kind = "cuda" if device.startswith("cuda") else "cpu"
    name = torch.cuda.get_device_name(device) if kind == "cuda" else (cpu_model() or "cpu")
    # DeviceProfile.kv_budget_bytes needs the device's memory (the total the engine's reads)
    memory_bytes = int(torch.cuda.mem_get_info(torch.device(device))[1]) if kind == "cuda" else None
    return latency.DeviceProfile(
        model=loaded.name, dtype=dtype, device_kind=kind, device_name=name,
        num_threads=torch.get_num_threads(), kv_bytes_per_token=loaded.kv_spec.bytes_per_token,
        prefill=pre, decode=dec, mixed=mix, transfers=transfers,
        notes={"torch": torch.__version__, "estimator": result.estimator, "fitted_on": "median",
               "created": time.strftime("%Y-%m-%dT%H:%M:%S")},
        max_prefill_tokens=int(result.prefill["prompt_len"].max()),
        device_memory_bytes=memory_bytes, weight_bytes=weight_bytes(loaded.model))


def token_cost_ratio(prefill: pd.DataFrame, decode_batch: pd.DataFrame) -> dict:
    """A prompt token's cost (prefill_s / P at the largest P) over an output token's cost
    (decode step at the smallest B, per token)."""
    big = prefill.loc[prefill["prompt_len"].idxmax()]
    one = decode_batch.loc[decode_batch["batch_size"].idxmin()]
    return {"prompt_len": int(big["prompt_len"]), "prompt_token_s": float(big["per_token_s"]),
            "batch_size": int(one["batch_size"]), "context_len": int(one["context_len"]),
            "output_token_s": float(one["per_token_s"]),
            "ratio": float(big["per_token_s"] / one["per_token_s"])}


def pg_table(prefill: pd.DataFrame, context_fit: LinearFit, prompt_lens: Sequence[int],
             output_lens: Sequence[int], min_step_s: float = 0.0) -> pd.DataFrame:
    """TTFT and total time of one request alone, for each prompt length P and output length G.

    TTFT = measured prefill time of P (must be a row of ``prefill``). The first output token comes
    out of the prefill step, the other G-1 from decode steps at contexts P+1 .. P+G-1, each
    estimated by ``context_fit`` (step_s = a + b * context, fitted on the B = 1 sweep) and never
    below ``min_step_s`` (the fastest measured step).

    Returns:
        ``prompt_len, output_len, ttft_s, decode_s, total_s, prompt_share`` (= ttft_s / total_s)."""
    by_p = dict(zip(prefill["prompt_len"], prefill["prefill_s"]))
    rows = []
    for p, g in itertools.product(prompt_lens, output_lens):
        if p not in by_p:
            raise ValueError(f"prompt length {p} has no measured prefill time")
        contexts = np.arange(p + 1, p + g)  # G-1 decode steps
        steps_s = np.maximum(context_fit(contexts), min_step_s)
        decode_s = float(np.sum(steps_s)) if contexts.size else 0.0
        total_s = by_p[p] + decode_s
        rows.append({"prompt_len": p, "output_len": g, "ttft_s": by_p[p], "decode_s": decode_s,
                     "total_s": total_s, "prompt_share": by_p[p] / total_s})
    return pd.DataFrame(rows)


@dataclass
class ProfileResult:
    prefill: pd.DataFrame
    decode_context: pd.DataFrame
    decode_batch: pd.DataFrame
    batch_fit: LinearFit
    context_fit: LinearFit
    ratio: dict
    pg: pd.DataFrame
    estimator: str
    notes: list[str]
    mixed: pd.DataFrame | None = None


def cap_lengths(loaded: LoadedModel, prompt_lens, contexts, pg_prompts, pg_outputs, batch_context,
                repeats) -> tuple[list, list, list, list, list[str]]:
    """Drop sweep points the model's context cannot hold; returns the kept lists and notes."""
    limit = loaded.max_context_len
    decode_room = WARMUP + repeats + 2
    notes = []

    def keep(name, values, fits):
        kept = [v for v in values if fits(v)]
        if len(kept) < len(values):
            notes.append(f"{name}: dropped {[v for v in values if not fits(v)]} "
                         f"(model context {limit} tokens)")
        return kept

    prompt_lens = keep("prompt lengths", prompt_lens, lambda p: p + 1 <= limit)
    contexts = keep("decode contexts", contexts, lambda c: c + decode_room <= limit)
    pg_prompts = keep("P x G prompts", pg_prompts, lambda p: p + 1 <= limit)
    pg_outputs = keep("P x G outputs", pg_outputs,
                      lambda g: max(pg_prompts, default=0) + g <= limit)
    if batch_context + decode_room > limit:
        raise ValueError(f"batch context {batch_context} + {decode_room} decode steps exceeds "
                         f"the model context {limit}")
    return prompt_lens, contexts, pg_prompts, pg_outputs, notes


def run_profile(loaded: LoadedModel, prompt_lens=DEFAULT_PROMPT_LENS, contexts=DEFAULT_CONTEXTS,
                batch_sizes=DEFAULT_BATCH_SIZES, batch_context: int = DEFAULT_BATCH_CONTEXT,
                pg_prompts=DEFAULT_PG_PROMPTS, pg_outputs=DEFAULT_PG_OUTPUTS, repeats: int = 5,
                device: str = "cpu", seed: int = 0, show_progress: bool = True,
                mixed_prompts=DEFAULT_MIXED_PROMPTS,
                mixed_batch_sizes=DEFAULT_MIXED_BATCH_SIZES,
                context_batch_sizes=DEFAULT_CONTEXT_BATCH_SIZES) -> ProfileResult:
    """The whole profile (module docstring); prefill rows are ``prompt_lens`` and the P x G
    prompts together; mixed prompts over the model's context are dropped (noted)."""
    prompt_lens, contexts, pg_prompts, pg_outputs, notes = cap_lengths(
        loaded, list(prompt_lens), list(contexts), list(pg_prompts), list(pg_outputs),
        batch_context, repeats)
    if len(contexts) < 2 or len(batch_sizes) < 2 or not prompt_lens:
        raise ValueError("need >= 1 prompt length, >= 2 decode contexts and >= 2 batch sizes "
                         "(after capping by the model context)")
    all_prompts = sorted(set(prompt_lens) | set(pg_prompts))
    limit = loaded.max_context_len
    kept = [p for p in mixed_prompts if p + 1 <= limit]
    if len(kept) < len(mixed_prompts):
        notes.append(f"mixed prompts: dropped {[p for p in mixed_prompts if p + 1 > limit]} "
                     f"(model context {limit} tokens)")
    mixed_prompts = kept
    total = (len(all_prompts) + len(contexts) * len(context_batch_sizes) + len(batch_sizes)
             + len(mixed_prompts) * len(mixed_batch_sizes)) * (WARMUP + repeats)
    with tqdm(total=total, desc="profile", unit="run", disable=not show_progress,
              file=sys.stderr) as bar:
        prefill, decode_context, decode_batch, mixed = profile_interleaved(
            loaded, all_prompts, contexts, batch_sizes, batch_context, mixed_prompts,
            mixed_batch_sizes, repeats, device, seed, bar, context_batch_sizes)
    return derive(prefill, decode_context, decode_batch, mixed, max(prompt_lens), pg_prompts,
                  pg_outputs, describe(repeats, WARMUP) + INTERLEAVED, notes)


def derive(prefill: pd.DataFrame, decode_context: pd.DataFrame, decode_batch: pd.DataFrame,
           mixed: pd.DataFrame, ratio_prompt_len: int, pg_prompts: Sequence[int],
           pg_outputs: Sequence[int], estimator: str, notes: list[str]) -> ProfileResult:
    """The ``ProfileResult`` of measured sweeps: the batch and context lines, the token cost
    ratio at prompt ``ratio_prompt_len`` (module docstring, step 5) and the P x G table."""
    batch_fit = fit_linear(decode_batch["batch_size"], decode_batch["step_s"])
    one = single_row(decode_context)
    context_fit = fit_linear(one["context_len"], one["step_s"])
    ratio = token_cost_ratio(prefill[prefill["prompt_len"] <= ratio_prompt_len], decode_batch)
    pg = pg_table(prefill, context_fit, pg_prompts, pg_outputs, min_step_s=float(one["step_s"].min()))
    return ProfileResult(prefill, decode_context, decode_batch, batch_fit, context_fit, ratio,
                         pg, estimator, notes, mixed)


def pooled(results: Sequence[ProfileResult], devices: Sequence[str]) -> ProfileResult:
    """One profile from the same sweeps measured on several devices at once
    (``profile_on_devices``): per point the fastest run of any device (``*_s``, the estimator), the
    median of the devices' medians (``*_median_s``, what the device profile is fitted on) and every
    run counted; the lines, ratio and P x G table derived again.

    Raises:
        ValueError: no results, or results of different sweeps."""
    if not results:
        raise ValueError("pooled needs at least one profile")

    def pool(frames: list[pd.DataFrame], keys: list[str]) -> pd.DataFrame:
        if any(list(f[keys].itertuples(index=False)) != list(frames[0][keys].itertuples(index=False))
               for f in frames):
            raise ValueError("profiles of different sweeps cannot be pooled")
        agg = {c: ("median" if c.endswith("_median_s") else "sum" if c == "num_runs" else "min")
               for c in frames[0].columns if c not in keys}
        return (pd.concat(frames).groupby(keys, sort=False, as_index=False).agg(agg)
                [list(frames[0].columns)])

    first = results[0]
    frames = {name: pool([getattr(r, name) for r in results], keys) for name, keys in (
        ("prefill", ["prompt_len"]), ("decode_context", ["batch_size", "context_len"]),
        ("decode_batch", ["batch_size", "context_len"]),
        ("mixed", ["prompt_len", "batch_size", "context_len"]))}
    return derive(frames["prefill"], frames["decode_context"], frames["decode_batch"],
                  frames["mixed"], int(first.ratio["prompt_len"]),
                  list(dict.fromkeys(first.pg["prompt_len"])), list(dict.fromkeys(first.pg["output_len"])),
                  f"{first.estimator}; measured on {','.join(devices)} at once, pooled (fastest "
                  "run, median of the devices' medians)", first.notes)


def _profile_process(device: str, model: ModelConfig, kwargs: dict, start, results) -> None:
    """One process of ``profile_on_devices``: puts ``(device, result, error)`` on ``results``."""
    try:
        if device.startswith("cpu"):
            cores = cpu_cores_of(device)
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        loaded = load_model(model, device="cpu" if device.startswith("cpu") else device)
        start.wait()
        result = run_profile(loaded, device="cpu" if device.startswith("cpu") else device,
                             show_progress=False, **kwargs)
        results.put((device, result, None))
    except BaseException as err:  # the parent must hear of it, not wait forever
        start.abort()
        results.put((device, None, f"{type(err).__name__}: {err}"))


def profile_on_devices(model: ModelConfig, devices: Sequence[str], **kwargs) -> ProfileResult:
    """``run_profile`` on every device of ``devices`` at once, each in its own process bound to
    it, then ``pooled``: a placement's workers share memory bandwidth and cache, which a profile
    of one device beside idle ones never sees.

    Raises:
        ValueError: a device's process failed (its error named)."""
    ctx = multiprocessing.get_context("spawn")  # no forked torch / Ray state
    start, results = ctx.Barrier(len(devices)), ctx.Queue()
    procs = [ctx.Process(target=_profile_process, args=(d, model, kwargs, start, results))
             for d in devices]
    for proc in procs:
        proc.start()
    got = {}
    try:
        while len(got) < len(devices):
            try:
                device, result, error = results.get(timeout=5.0)
            except queue.Empty:  # a process killed outright (OOM) reports nothing: look
                dead = [(d, p.exitcode) for d, p in zip(devices, procs)
                        if d not in got and not p.is_alive()]
                if dead and results.empty():
                    raise ValueError(f"profile on {dead[0][0]} died (exit code "
                                     f"{dead[0][1]}) before reporting") from None
                continue
            if error is not None:
                raise ValueError(f"profile on {device} failed: {error}")
            got[device] = result
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return pooled([got[d] for d in devices], devices)


def _fit_text(name: str, fit: LinearFit, x: str) -> str:
    return f"{name}: step_s = {fit.a:.6g} + {fit.b:.6g} * {x}   (R^2 = {fit.r2:.4f})"


def _ratio_text(ratio: dict) -> str:
    return (f"prompt token / output token cost: {ratio['ratio']:.4g} "
            f"(prefill {ratio['prompt_token_s'] * 1e3:.4g} ms/token at P={ratio['prompt_len']}; "
            f"decode {ratio['output_token_s'] * 1e3:.4g} ms/token at B={ratio['batch_size']}, "
            f"context {ratio['context_len']})")


def summary_markdown(result: ProfileResult, header: str) -> str:
    r = result
    parts = [f"# pdlab profile\n\n{header}\n\nEstimator: {r.estimator}.\n",
             "## Prefill (one step, whole prompt)\n", markdown_table(r.prefill),
             "\n## Decode step vs context\n", markdown_table(r.decode_context),
             "\n" + _fit_text("context fit (B = 1 rows)", r.context_fit, "context") + "\n",
             "\n## Decode step vs batch size\n", markdown_table(r.decode_batch),
             "\n" + _fit_text("batch fit", r.batch_fit, "B") + "\n",
             "\n## Mixed steps (B decodes + one whole prompt)\n",
             markdown_table(r.mixed) if r.mixed is not None and len(r.mixed) else "(none)",
             "\n## Prompt vs output token\n", _ratio_text(r.ratio) + "\n",
             "\n## P x G (one request alone)\n",
             "TTFT = measured prefill; total = TTFT + (G-1) decode steps estimated from the "
             "context fit, floored at the fastest measured step (the first of G output "
             "tokens comes from the prefill step).\n",
             markdown_table(r.pg)]
    if r.notes:
        parts.append("\n## Notes\n\n" + "\n".join(f"- {n}" for n in r.notes))
    return "\n".join(parts) + "\n"


def system_name(text: str) -> str:
    """``--from-silicon-db``: a system name of the database's form (``h100_sxm``); whether
    the installed database has it is ``check_silicon``'s question."""
    if re.fullmatch(r"[a-z0-9][a-z0-9_]*", text) is None:
        raise argparse.ArgumentTypeError(f"must be a system name such as h100_sxm, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab profile``."""
    add_measure_args(parser, "profile")
    parser.add_argument("--prompt-lens", type=int_list, default=DEFAULT_PROMPT_LENS,
                        help="prefill sweep P (default: 1,4,16,64,128,256,512)")
    parser.add_argument("--contexts", type=int_list, default=DEFAULT_CONTEXTS,
                        help="decode contexts of the context sweep (default: 16,64,256,1024)")
    parser.add_argument("--context-batch-sizes", type=int_list,
                        default=DEFAULT_CONTEXT_BATCH_SIZES,
                        help="batch sizes the context sweep runs at (default: 1,8; batched "
                             "rows pin the decode model's context term)")
    parser.add_argument("--batch-sizes", type=int_list, default=DEFAULT_BATCH_SIZES,
                        help="decode batch sizes (default: 1,2,4,8,16,32)")
    parser.add_argument("--batch-context", type=positive_int, default=DEFAULT_BATCH_CONTEXT,
                        help="context of the batch sweep (default: 64)")
    parser.add_argument("--pg-prompts", type=int_list, default=DEFAULT_PG_PROMPTS,
                        help="P of the P x G table (default: 64,256,512)")
    parser.add_argument("--pg-outputs", type=int_list, default=DEFAULT_PG_OUTPUTS,
                        help="G of the P x G table (default: 16,64,256)")
    parser.add_argument("--mixed-prompts", type=int_list, default=DEFAULT_MIXED_PROMPTS,
                        help="P of the mixed steps (one whole prompt + B decodes) "
                             "(default: 64,256)")
    parser.add_argument("--mixed-batch-sizes", type=int_list, default=DEFAULT_MIXED_BATCH_SIZES,
                        help="B of the mixed steps, decoding at --batch-context (default: 1,4,16)")
    parser.add_argument("--devices", type=existing_device_set, default=None,
                        help="measure on every device of this list at once (e.g. cpu:0,cpu:1), "
                             "each in its own process, and pool them: the speed each device "
                             "has while the others work too, as in a placement using them all "
                             "(default: --device alone)")
    parser.add_argument("--transports", type=transport_list, default=DEFAULT_PROFILE_TRANSPORTS,
                        help="transports whose KV transfer is timed (pdlab kv-cost's "
                             "measurement) and fitted into device_profile.json, from "
                             "inprocess,ray,torchdist,shm (default: inprocess)")
    gpu = parser.add_argument_group(
        "a GPU's profile without a GPU (NVIDIA's silicon database, AIConfigurator: "
        "pip install 'pdlab[silicon]')")
    gpu.add_argument("--from-silicon-db", default=None, metavar="SYSTEM", type=system_name,
                     help="fit the device profile on the database's step estimates for one "
                          "GPU of SYSTEM (e.g. h100_sxm, h200_sxm, b200_sxm, gb200) instead of "
                          "measuring here; --model is a directory with a config.json (e.g. "
                          "engine/configs/llama-3.1-8b); the profile's dtype is the "
                          "database's (bfloat16 for these); --prompt-lens, --batch-sizes, "
                          "--contexts, --mixed-prompts, --mixed-batch-sizes replace its "
                          "GPU-scale sweeps when given")
    gpu.add_argument("--backend", default="vllm", choices=silicon.BACKENDS,
                     help="the serving engine whose kernels the database measured "
                          "(default: vllm)")
    gpu.add_argument("--tp", type=positive_int, default=1,
                     help="--from-silicon-db: the instance's tensor-parallel size, its step "
                          "times the database's at that TP (default: 1)")
    gpu.add_argument("--pp", type=positive_int, default=1,
                     help="--from-silicon-db: the instance's pipeline-parallel size, modelled "
                          "on the TP profile as DistServe does (planner.latency; default: 1)")
    gpu.add_argument("--link", default=None, choices=tuple(latency.LINKS),
                     help="the link KV crosses between GPUs, written as the transfer model "
                          "of every transport (default: nvlink where the system has it, "
                          "else pcie; every link is also written under its own name)")


def check(args: argparse.Namespace) -> None:
    """``pdlab profile`` options that join each other, the device and the model's context (read from
    its config file: no weights), checked before the model loads.

    Raises:
        ValueError: ``argument --x: ...`` for the first bad option."""
    if args.from_silicon_db is not None:
        return check_silicon(args)
    for option in ("tp", "pp"):
        if getattr(args, option) != 1:
            raise option_error(f"--{option}", "sizes a --from-silicon-db profile: a profile "
                                              "measured here is one device's")
    model = measure.check_measure_args(args)
    if args.devices and args.device != "cpu":
        raise ValueError(f"argument --devices: it replaces --device (got --device {args.device}"
                         "): name the devices in --devices only")
    for option, values in (("--contexts", args.contexts), ("--batch-sizes", args.batch_sizes)):
        if len(set(values)) < 2:
            raise ValueError(f"argument {option}: needs at least 2 distinct values for its fit, "
                             f"got {','.join(map(str, values))}")
    if len(set(args.prompt_lens)) < 2:
        raise ValueError("argument --prompt-lens: needs at least 2 distinct values for the "
                         f"prefill and transfer fits, got {','.join(map(str, args.prompt_lens))}")
    limit = model_context_len(model)
    if limit is None:
        return  # known after loading: cap_lengths drops what does not fit
    if not any(p + 1 <= limit for p in args.mixed_prompts):
        raise ValueError(f"argument --mixed-prompts: no length fits the context of model "
                         f"{model.model} ({limit} tokens)")
    room = WARMUP + args.repeats + 2
    if not any(p + 1 <= limit for p in args.prompt_lens):
        raise ValueError(f"argument --prompt-lens: no length fits the context of model "
                         f"{model.model} ({limit} tokens)")
    if sum(c + room <= limit for c in set(args.contexts)) < 2:
        raise ValueError(f"argument --contexts: fewer than 2 contexts leave room for {room} "
                         f"decode steps in the context of model {model.model} ({limit} tokens)")
    if args.batch_context + room > limit:
        raise ValueError(f"argument --batch-context: must be <= {limit - room} (the context of "
                         f"model {model.model}, {limit} tokens, less {room} decode steps), got "
                         f"{args.batch_context}")


def run(args: argparse.Namespace, _checked: str | None = None) -> int:
    """Run the profile (module docstring), write its files, print its tables."""
    if args.from_silicon_db is not None:
        return run_silicon(args, _checked or silicon_model_dir(args.model))
    loaded = load_for(args)
    if loaded is None:
        return 2
    sweeps = dict(prompt_lens=args.prompt_lens, contexts=args.contexts,
                  batch_sizes=args.batch_sizes, batch_context=args.batch_context,
                  pg_prompts=args.pg_prompts, pg_outputs=args.pg_outputs, repeats=args.repeats,
                  seed=args.seed, mixed_prompts=args.mixed_prompts,
                  mixed_batch_sizes=args.mixed_batch_sizes,
                  context_batch_sizes=args.context_batch_sizes)
    try:
        if args.devices:
            print(f"pdlab profile: measuring on {','.join(args.devices)} at once", file=sys.stderr)
            result = profile_on_devices(ModelConfig(args.model, args.dtype), args.devices, **sweeps)
        else:
            result = run_profile(loaded, device=args.device, **sweeps)
        kv_table = _kv_table(loaded, args)
        device_profile = fit_device_profile(result, loaded, args.dtype, args.device, kv_table)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = out_dir(args, "profile")
    header = run_header(loaded, args)
    result.prefill.to_csv(out / "prefill.csv", index=False)
    result.decode_context.to_csv(out / "decode_context.csv", index=False)
    result.decode_batch.to_csv(out / "decode_batch.csv", index=False)
    result.pg.to_csv(out / "pg_table.csv", index=False)
    result.mixed.to_csv(out / "mixed.csv", index=False)
    kv_table.to_csv(out / "kv_cost.csv", index=False)
    device_profile.save(out / "device_profile.json")
    (out / "summary.md").write_text(summary_markdown(result, header))
    plots.plot_profile(result, out / "profile.png", header)
    print(f"{header}\nestimator: {result.estimator}\n")
    print("prefill:\n" + result.prefill.to_string(index=False) + "\n")
    print("decode vs context:\n" + result.decode_context.to_string(index=False))
    print(_fit_text("context fit", result.context_fit, "context") + "\n")
    print("decode vs batch size:\n" + result.decode_batch.to_string(index=False))
    print(_fit_text("batch fit", result.batch_fit, "B") + "\n")
    print(_ratio_text(result.ratio) + "\n")
    print("P x G (TTFT = prefill; total = TTFT + (G-1) estimated decode steps):\n"
          + result.pg.to_string(index=False))
    print("\ndevice profile (fitted on relative error):")
    for line in latency.summary_lines(device_profile):
        print("  " + line)
    for note in result.notes:
        print(f"note: {note}")
    print(f"\nwrote {out}/: prefill.csv decode_context.csv decode_batch.csv mixed.csv "
          "pg_table.csv kv_cost.csv device_profile.json summary.md profile.png")
    return 0


def _kv_table(loaded: LoadedModel, args: argparse.Namespace) -> pd.DataFrame:
    """``pdlab kv-cost``'s measurement for ``--transports`` at the profile's prompt lengths
    that fit the context, those >= 16 when there are two (shorter KV is all fixed cost)."""
    limit = loaded.max_context_len
    lens = [p for p in sorted(set(args.prompt_lens)) if p + 2 <= limit]
    if len([p for p in lens if p >= 16]) >= 2:
        lens = [p for p in lens if p >= 16]
    if len(lens) < 2:
        raise ValueError("argument --prompt-lens: the transfer fit needs >= 2 prompt lengths "
                         f"that fit the model context ({limit} tokens)")
    return transfer_cost.kv_cost_table(loaded, lens, args.transports, args.repeats,
                                       device=args.device, seed=args.seed)


# The CPU sweeps' options that, given on the command line, replace the silicon grid's
# defaults (an option left alone still holds its default object: argparse keeps it as is).
SILICON_SWEEPS = {"prompt_lens": DEFAULT_PROMPT_LENS, "batch_sizes": DEFAULT_BATCH_SIZES,
                  "contexts": DEFAULT_CONTEXTS, "mixed_prompts": DEFAULT_MIXED_PROMPTS,
                  "mixed_batch_sizes": DEFAULT_MIXED_BATCH_SIZES}


def silicon_model_dir(model: str) -> str:
    """The config directory the silicon database reads for ``--model``: the directory itself, or for
    ``smollm2-135m`` its converted copy in the pdlab cache.

    Raises:
        ValueError: ``argument --model: ...`` for a model with no config file here."""
    if model in TINY_NAMES:
        raise option_error("--model", f"{model} is built in memory and has no config.json: the "
                                      "silicon database reads a model directory (e.g. "
                                      "engine/configs/llama-3.1-8b)")
    if model == SMOLLM2_NAME:
        path = cache_dir() / "models" / SMOLLM2_NAME
        if not (path / "config.json").exists():
            raise option_error("--model", f"{model} has no config.json under {path} yet (run "
                                          "`pdlab profile` on it once to convert it)")
        return str(path)
    try:
        silicon.read_model_config(model)
    except silicon.SiliconError as err:
        raise option_error("--model", str(err)) from None
    return model


def silicon_grid(args: argparse.Namespace) -> silicon.SampleGrid:
    """``planner.silicon.SampleGrid`` with the sweep options given on the command line."""
    given = {name: tuple(getattr(args, name)) for name, default in SILICON_SWEEPS.items()
             if getattr(args, name) is not default}
    return silicon.SampleGrid(**given)


def check_silicon(args: argparse.Namespace) -> str:
    """``--from-silicon-db``'s options: the model's config directory (which pdlab must be able to
    serve), the system and backend in the installed database, options of the CPU measurement
    refused. Returns the config directory.

    Raises:
        ValueError: ``argument --x: ...`` for the first bad option."""
    for option, value, default in (("--devices", args.devices, None),
                                   ("--device", args.device, "cpu"),
                                   ("--transports", args.transports, DEFAULT_PROFILE_TRANSPORTS)):
        if value != default:
            raise option_error(option, "measures this machine, and --from-silicon-db runs no "
                                       f"step here: drop it{' (use --link)' if option == '--transports' else ''}")
    if args.dtype not in ("float32", "bfloat16"):  # float32 is the option's default
        raise option_error("--dtype", "a silicon-database profile has the database's dtype "
                                      f"(bfloat16 for bfloat16 checkpoints), got {args.dtype}")
    model_dir = silicon_model_dir(args.model)
    check_model(ModelConfig(model_dir))
    check_out(args.out)
    try:
        silicon.check_system(args.from_silicon_db, args.backend)
    except silicon.SiliconError as err:
        raise option_error("--from-silicon-db", str(err)) from None
    return model_dir


def silicon_kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """pdlab's KV bytes per token of the model in ``model_dir`` (its config.json) at
    ``dtype``: ``engine.kv_cache.KVSpec.bytes_per_token``."""
    hf = silicon.read_model_config(model_dir)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    spec = KVSpec(model_dir, int(hf["num_hidden_layers"]),
                  int(hf.get("num_key_value_heads", hf["num_attention_heads"])), int(head_dim), dtype)
    return spec.bytes_per_token


def silicon_steps_table(db: silicon.SiliconDatabase, profile: latency.DeviceProfile,
                        grid: silicon.SampleGrid) -> pd.DataFrame:
    """Every sampled step: its kind, features, the database's and the model's seconds."""
    prefill, decode, mixed = silicon.sample_steps(db, grid)
    rows = []
    for kind, points in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
        for f, t in points:
            model_s = profile.step_s(f)
            rows.append({"kind": kind, "prefill_tokens": f.prefill_tokens,
                         "prefill_attention": f.prefill_attention, "batch_size": f.batch_size,
                         "sum_context": f.sum_context, "database_s": t, "model_s": model_s,
                         "rel_error": model_s / t - 1.0})
    return pd.DataFrame(rows)


def run_silicon(args: argparse.Namespace, model_dir: str) -> int:
    """``--from-silicon-db``: open the database, fit, write device_profile.json,
    silicon_steps.csv, decode_check.csv and summary.md, print the fits and the check."""
    grid = silicon_grid(args)
    try:
        db = silicon.open_database(model_dir, args.from_silicon_db, args.backend, args.tp)
        if args.dtype not in ("float32", db.kv_dtype):
            raise ValueError(f"argument --dtype: {db.where} estimates {model_dir} with its KV "
                             f"in {db.kv_dtype}, not {args.dtype}")
        kv_bytes = silicon_kv_bytes_per_token(model_dir, db.kv_dtype)
        geometry = Geometry.from_config(silicon.read_model_config(model_dir))
        itemsize = sizes.ITEMSIZE[db.kv_dtype]
        # the profile's longest prompt must fit beside the fullest device's weights
        check_fits(geometry, itemsize, args.tp, args.pp, db.device_memory_bytes(),
                   max(grid.prompt_lens) + 1, vocab_parallel=True, what=args.model,
                   device=f"an {db.system} GPU")
        profile = silicon.build_profile(db, args.model, kv_bytes, args.link, grid,
                                        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                                        device_kv_bytes_per_token=geometry.kv_bytes_per_token(
                                            itemsize, args.tp))
        steps = silicon_steps_table(db, profile, grid)
        check = pd.DataFrame(silicon.decode_table(profile, db))
        profile = sizes.pipelined(profile, geometry, args.pp)
    except ValueError as err:  # SiliconError included
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = out_dir(args, "profile")
    profile.save(out / "device_profile.json")
    steps.to_csv(out / "silicon_steps.csv", index=False)
    check.to_csv(out / "decode_check.csv", index=False)
    on = f"one {db.system} GPU" if args.tp * args.pp == 1 else \
        f"a TP {args.tp}, PP {args.pp} instance of {args.tp * args.pp} {db.system} GPUs"
    header = (f"{args.model} on {on} under {db.backend} ({db.where} database of "
              f"{silicon.PACKAGE} {silicon.PACKAGE_VERSION}, {db.kv_dtype} KV, "
              f"{kv_bytes} KV bytes/token; no step ran on this machine)")
    lines = latency.summary_lines(profile)
    shown = check.assign(pdlab_ms=1e3 * check["pdlab_s"], database_ms=1e3 * check["database_s"],
                         error_pct=100 * check["error"])[
        ["batch_size", "isl", "osl", "pdlab_ms", "database_ms", "error_pct"]]
    (out / "summary.md").write_text(
        f"# pdlab profile --from-silicon-db\n\n{header}\n\n## Fitted models\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n\n## Decode steps vs the database's TPOT (static_gen)\n\n"
        + markdown_table(shown) + "\n")
    per_gpu = geometry.kv_bytes_per_token(itemsize, args.tp)
    if per_gpu != db.kv_bytes_per_token:
        print(f"note: pdlab's KV bytes per token on one GPU {per_gpu} differ from the "
              f"database's {db.kv_bytes_per_token}", file=sys.stderr)
    print(header + "\n\ndevice profile (fitted on relative error):")
    for line in lines:
        print("  " + line)
    print("\ndecode steps (mean over the osl - 1 steps) vs the database's TPOT estimate:\n"
          + shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"\nwrote {out}/: device_profile.json silicon_steps.csv decode_check.csv summary.md")
    return 0
