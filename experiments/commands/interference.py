"""``pdlab interference``: how much a prefill stalls the decodes running beside it, measured
directly on one device through pdlab's own Engine (no Ray, no router).

For each mode and decode batch size B, an engine gets B decode requests at context ~C (prefilled
untimed) and one discarded warm-up step; then per repeat and prompt length P a **baseline** step
(decodes alone) and the **injection** beside it are timed:

- ``colocated-nochunk``: a P-token request runs whole in the next step;
- ``chunked`` (Sarathi-Serve): the token budget K covers the B decodes plus a chunk of K - B,
  so it spreads over ceil(P / (K - B)) steps;
- ``disagg``: the P-token KV arrives from elsewhere and the request decodes once beside the B;
  the KV import alone is timed separately.

A step's time is the ITL its running requests see (``time.perf_counter``, CUDA synchronized); per
point the figures of one repeat, the one with the median stall (``summarize``). Outputs:
steps.csv (everything else is a pure function of it), interference.csv, fits.csv, summary.md,
interference.png."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from engine.config import EngineConfig, add_dataclass_args, check_fields, dataclass_from_args
from engine.engine import Engine
from engine.model import model_context_len
from engine.request import Request, SamplingParams
from experiments import measure, plots
from experiments.measure import random_prompt
from experiments.report import markdown_table
from experiments.timing import device_sync

HELP = "decode stall caused by a prefill, per mode"

NOCHUNK, CHUNKED, DISAGG = "colocated-nochunk", "chunked", "disagg"
WARMUP_STEPS = 1
_INTS_POS = r"[1-9]\d*(,[1-9]\d*)*"
_INTS = r"\d+(,\d+)*"
QUICK = {"batch_sizes": "1,2", "prompt_lens": "0,16,48", "context_len": 16, "chunk_budgets": "12"}


def ints(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16), sorted, duplicates dropped."""
    return tuple(sorted({int(v) for v in text.split(",")}))


@dataclass(frozen=True)
class InterferenceConfig:
    """The grid of ``pdlab interference`` (module docstring; each field's help says what it is).
    Each K must exceed the largest B; at least one P must be > 0."""

    batch_sizes: str = field(default="1,4,16", metadata={
        "pattern": _INTS_POS, "hint": "comma-separated integers >= 1, e.g. 1,4,16",
        "help": "decode batch sizes B"})
    prompt_lens: str = field(default="0,128,512,1024", metadata={
        "pattern": _INTS, "hint": "comma-separated integers >= 0, e.g. 0,128,512",
        "help": "injected prompt lengths P (0 = no prefill)"})
    context_len: int = field(default=128, metadata={
        "min": 2, "help": "context C of the running decodes (tokens)"})
    chunk_budgets: str = field(default="128,512", metadata={
        "pattern": _INTS_POS, "hint": "comma-separated integers >= 1, e.g. 128,512",
        "help": "token budgets K of chunked prefill (decodes + chunk per step)"})
    quick: bool = field(default=False, metadata={
        "help": "small grid for tests (B 1,2; P 0,16,48; C 16; K 12)"})

    def __post_init__(self) -> None:
        check_fields(self)
        grid = self.grid()
        if not any(p > 0 for p in grid.prompt_lens_t):
            raise ValueError(f"prompt_lens must hold a length > 0, got {grid.prompt_lens!r}")
        if min(grid.chunk_budgets_t) <= max(grid.batch_sizes_t):
            raise ValueError(f"chunk_budgets must each be > the largest batch size "
                             f"({max(grid.batch_sizes_t)}): the decodes take one token each, "
                             f"got {grid.chunk_budgets!r}")

    def grid(self) -> InterferenceConfig:
        """The grid actually run: this one, or the quick one."""
        if not self.quick:
            return self
        return replace(self, quick=False, **QUICK)

    @property
    def batch_sizes_t(self) -> tuple[int, ...]:
        return ints(self.batch_sizes)

    @property
    def prompt_lens_t(self) -> tuple[int, ...]:
        return ints(self.prompt_lens)

    @property
    def chunk_budgets_t(self) -> tuple[int, ...]:
        return ints(self.chunk_budgets)

    def modes(self) -> list[tuple[str, int | None]]:
        """(mode, budget K or None) in table order."""
        return [(NOCHUNK, None)] + [(CHUNKED, k) for k in self.chunk_budgets_t] + [(DISAGG, None)]

    def injection_steps(self, mode: str, budget: int | None, batch_size: int,
                        prompt_len: int) -> int:
        """Steps one injection of ``prompt_len`` tokens takes (0 for P = 0)."""
        if prompt_len == 0:
            return 0
        if mode == CHUNKED:
            return math.ceil(prompt_len / (budget - batch_size))
        return 1

    def step_budget(self, mode: str, budget: int | None, batch_size: int) -> int:
        """Token budget of the engine of one (mode, B): nochunk runs the longest prompt whole
        beside the decodes; chunked is K; disagg runs no prompt but the decodes' own."""
        if mode == CHUNKED:
            return budget
        if mode == NOCHUNK:
            return max(batch_size + max(self.prompt_lens_t), self.context_len)
        return max(batch_size + 1, self.context_len)

    def decode_tokens_needed(self, mode: str, budget: int | None, batch_size: int,
                             repeats: int) -> int:
        """Output tokens a running decode may produce over the whole measurement: while the
        others prefill (>= budget - B prompt tokens a step), the warm-up, and per repeat one
        baseline and every injection step (disagg: one more, the KV slot reserved a step ahead)."""
        per_prompt = self.step_budget(mode, budget, batch_size) - batch_size
        setup = batch_size * (math.ceil((self.context_len - 1) / per_prompt) + 1)
        per_repeat = sum(1 + self.injection_steps(mode, budget, batch_size, p)
                         + (mode == DISAGG and p > 0) for p in self.prompt_lens_t)
        return setup + WARMUP_STEPS + repeats * per_repeat

    def max_len_needed(self, repeats: int) -> int:
        """Longest slot the grid needs (tokens): the decodes' context at the end, or the
        longest injected prompt plus its two tokens."""
        decode = max(self.context_len - 1 + self.decode_tokens_needed(m, k, b, repeats) + 1
                     for m, k in self.modes() for b in self.batch_sizes_t)
        return max(decode, max(self.prompt_lens_t) + 2)


def engine_config(grid: InterferenceConfig, mode: str, budget: int | None, batch_size: int,
                  repeats: int, device: str) -> EngineConfig:
    """The engine of one (mode, B): B + 1 KV slots, ``grid.step_budget``; chunked prefill
    on except in ``colocated-nochunk``."""
    return EngineConfig(max_num_seqs=batch_size + 1, max_model_len=grid.max_len_needed(repeats),
                        max_num_batched_tokens=grid.step_budget(mode, budget, batch_size),
                        enable_chunked_prefill=mode != NOCHUNK, device=device)


class _Timer:
    def __init__(self, clock: Callable[[], float], sync: Callable[[], None] | None) -> None:
        self.clock, self.sync = clock, sync

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.sync is not None:
            self.sync()
        start_s = self.clock()
        result = fn()
        if self.sync is not None:
            self.sync()
        return self.clock() - start_s, result


def measure_mode(engine, grid: InterferenceConfig, mode: str, budget: int | None,
                 batch_size: int, repeats: int, vocab_size: int, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Run the module docstring's measurement on ``engine`` (``engine_config``'s, or a stub).

    Returns:
        (steps, imports): one dict per timed step (``mode, budget, batch_size, prompt_len,
        repeat, kind`` = baseline | injection, ``step_s, num_decode_tokens,
        num_prefill_tokens, num_import_tokens``) and, for disagg, one per (repeat, P) with
        the KV import alone (``import_s, num_import_tokens``).

    Raises:
        RuntimeError: a step did not run what the measurement needs (e.g. a decode finished)."""
    timer = _Timer(clock, sync)
    gen = torch.Generator().manual_seed(seed)
    max_tokens = grid.decode_tokens_needed(mode, budget, batch_size, repeats) + 1
    decode_ids = [f"decode-{i}" for i in range(batch_size)]
    for rid in decode_ids:  # 1. the running batch, prefilled untimed
        engine.add_request(Request(rid, random_prompt(gen, vocab_size, grid.context_len - 1),
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while any(engine.states[r].is_prefilling or engine.states[r].num_output_tokens == 0
              for r in decode_ids):
        engine.step()
    base = {"mode": mode, "budget": budget, "batch_size": batch_size}
    steps: list[dict] = []
    imports: list[dict] = []

    def step(prompt_len: int, repeat: int, kind: str, num_import_tokens: int = 0) -> dict:
        step_s, outputs = timer(engine.step)
        record = engine.step_records[-1]
        produced = {o.request_id for o in outputs}
        if not set(decode_ids) <= produced:
            raise RuntimeError(f"{mode} B={batch_size}: a step left out running decodes")
        row = {**base, "prompt_len": prompt_len, "repeat": repeat, "kind": kind,
               "step_s": step_s, "num_decode_tokens": record.num_decode_tokens,
               "num_prefill_tokens": record.num_prefill_tokens,
               "num_import_tokens": num_import_tokens}
        return row

    step(0, -1, "warmup")  # 2. discarded
    for repeat in range(repeats):  # 3.
        for p in grid.prompt_lens_t:
            steps.append(step(p, repeat, "baseline"))
            if p == 0:
                continue
            rid = f"inject-{repeat}-{p}"
            if mode == DISAGG:
                steps.append(_inject_kv(engine, timer, step, imports, rid, p, repeat, base,
                                        vocab_size, gen))
                continue
            engine.add_request(Request(rid, random_prompt(gen, vocab_size, p),
                                       SamplingParams(max_tokens=1, ignore_eos=True)))
            for _ in range(grid.injection_steps(mode, budget, batch_size, p)):
                steps.append(step(p, repeat, "injection"))
            if rid in engine.states:
                raise RuntimeError(f"{mode} B={batch_size}: the {p}-token prefill did not "
                                   "finish in the expected steps")
    for rid in decode_ids:
        engine.abort(rid)
    return steps, imports


def _inject_kv(engine, timer: _Timer, step, imports: list[dict], rid: str, prompt_len: int,
               repeat: int, base: dict, vocab_size: int, gen: torch.Generator) -> dict:
    """Disagg: the arriving request brings its KV; returns the step it decodes in. The KV
    lies in host memory, as the shm and ray transports deliver it."""
    spec = engine.kv_spec
    kv = torch.randn(spec.kv_shape(prompt_len), generator=gen).to(spec.torch_dtype)
    request = Request(rid, random_prompt(gen, vocab_size, prompt_len),
                      SamplingParams(max_tokens=2, ignore_eos=True))
    first_token = int(request.prompt_token_ids[-1])
    engine.add_remote(request, first_token)  # the slot is reserved first, then the KV comes in
    while engine.states[rid].block_ids is None:  # a step reserves it (StepOutput.kv_reserved)
        step(prompt_len, repeat, "reserve")
    import_s, _ = timer(lambda: engine.finish_remote(rid, kv))
    imports.append({**base, "prompt_len": prompt_len, "repeat": repeat, "import_s": import_s,
                    "num_import_tokens": prompt_len})
    row = step(prompt_len, repeat, "injection", num_import_tokens=prompt_len)
    if rid in engine.states:
        raise RuntimeError(f"disagg: the imported {prompt_len}-token request did not leave")
    return row


def summarize(steps: pd.DataFrame, imports: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (mode, budget, B, P): what the running requests see, from one repeat.

    Per repeat: ``base`` = its baseline step; ``worst`` = its longest injection step (the worst ITL
    of a running request); ``stall = worst - base``; ``total_stall`` = sum over injection steps of
    (step - base). Each repeat pairs an injection with the no-prefill step taken just before it,
    so the stall is a paired difference; the row reports the repeat whose stall is the median of
    the repeats (the lower median for an even count, ties to the smaller base step), and every
    figure of the row comes from that repeat. The minimum of a difference would pick the repeat
    whose baseline was most disturbed (a stall below zero); the median is robust to one
    disturbed step on either side. Then ``inflation = worst_step_s / base_step_s`` (1 and 0 for
    P = 0); ``import_s`` = min KV import alone over the repeats (one timing, not a difference;
    disagg, else NaN).

    Returns:
        columns ``mode, budget, batch_size, prompt_len, base_step_s, worst_step_s, stall_s,
        inflation, total_stall_s, num_injection_steps, import_s``."""
    keys = ["mode", "budget", "batch_size", "prompt_len"]
    steps = steps.fillna({"budget": -1})
    rows = []
    for key, group in steps.groupby(keys, sort=False):
        per_repeat = []
        for _, rep in group.groupby("repeat"):
            base_s = float(rep.loc[rep["kind"] == "baseline", "step_s"].iloc[0])
            inj = rep.loc[rep["kind"] == "injection", "step_s"].to_numpy(dtype=float)
            worst_s = float(inj.max()) if inj.size else base_s
            per_repeat.append((worst_s - base_s, base_s, worst_s, float(np.sum(inj - base_s)),
                               inj.size))
        stall_s, base_s, worst_s, total_s, num_inj = sorted(per_repeat)[(len(per_repeat) - 1) // 2]
        rows.append(dict(zip(keys, key), base_step_s=base_s, worst_step_s=worst_s,
                         stall_s=stall_s, inflation=worst_s / base_s,
                         total_stall_s=total_s, num_injection_steps=num_inj))
    out = pd.DataFrame(rows)
    out["import_s"] = np.nan
    if imports is not None and len(imports):
        best = imports.fillna({"budget": -1}).groupby(keys)["import_s"].min()
        for i, row in out.iterrows():
            key = tuple(row[k] for k in keys)
            if key in best.index:
                out.at[i, "import_s"] = float(best[key])
    out["budget"] = out["budget"].astype(int).replace(-1, pd.NA)
    return out


def mode_label(mode: str, budget) -> str:
    return f"{mode}-K{int(budget)}" if mode == CHUNKED else mode


@dataclass(frozen=True)
class StepFit:
    """Least-squares step model ``t = a + b * B + c * P`` of one mode (seconds): B = decode
    tokens in the step, P = prompt tokens computed in it (disagg: KV tokens imported)."""

    a: float
    b: float
    c: float
    r2: float
    num_steps: int


def fit_step_model(steps: pd.DataFrame) -> dict[str, StepFit]:
    """One ``StepFit`` per mode label over its baseline and injection steps
    (``numpy.linalg.lstsq``); R² = 1 - SS_res / SS_tot (1.0 when every step took the same
    time and the fit is exact). DistServe's decode model ``a + b * batch``, extended with the
    prefill term."""
    fits = {}
    steps = steps[steps["kind"].isin(["baseline", "injection"])]
    for (mode, budget), group in steps.fillna({"budget": -1}).groupby(["mode", "budget"],
                                                                      sort=False):
        x_b = group["num_decode_tokens"].to_numpy(float)
        x_p = (group["num_prefill_tokens"] + group["num_import_tokens"]).to_numpy(float)
        t = group["step_s"].to_numpy(float)
        design = np.column_stack([np.ones_like(t), x_b, x_p])
        (a, b, c), *_ = np.linalg.lstsq(design, t, rcond=None)
        ss_res = float(np.sum((t - design @ np.array([a, b, c])) ** 2))
        ss_tot = float(np.sum((t - t.mean()) ** 2))
        r2 = 1.0 if ss_tot == 0.0 else max(0.0, 1.0 - ss_res / ss_tot)
        fits[mode_label(mode, budget)] = StepFit(float(a), float(b), float(c), r2, len(t))
    return fits


def _time_text(seconds: float) -> str:
    """``646 ms`` below a second, ``18.6 s`` above."""
    return f"{seconds:.3g} s" if abs(seconds) >= 1.0 else f"{seconds * 1e3:.3g} ms"


def sentence(summary: pd.DataFrame, device_text: str) -> str:
    """The quotable sentence at the largest B and P of the grid (stall = worst step minus
    the baseline step, module docstring; chunked: the worst of its steps, and how many)."""
    big_b, big_p = int(summary["batch_size"].max()), int(summary["prompt_len"].max())
    at = summary[(summary["batch_size"] == big_b) & (summary["prompt_len"] == big_p)]

    def row(mode):
        return at[at["mode"] == mode].sort_values("budget")

    whole = row(NOCHUNK).iloc[0]
    chunks = "; ".join(  # the worst step shrinks, the stall is spread: both said
        f"chunking at budget {int(r.budget)} reduces that to {_time_text(r.stall_s)} per step "
        f"({r.inflation:.2f}x) over {int(r.num_injection_steps)} steps "
        f"({_time_text(r.total_stall_s)} in all)"
        for r in row(CHUNKED).itertuples())
    kv = row(DISAGG).iloc[0]
    return (f"On this device ({device_text}), a {big_p}-token prefill stalls a {big_b}-request "
            f"decode batch by {_time_text(whole.stall_s)} ({whole.inflation:.2f}x its "
            f"{_time_text(whole.base_step_s)} step); {chunks}; disaggregation to "
            f"{_time_text(kv.stall_s)} ({kv.inflation:.2f}x), with the KV import of the "
            f"arriving request reported separately: {_time_text(kv.import_s)}.")


def fits_frame(fits: dict[str, StepFit]) -> pd.DataFrame:
    return pd.DataFrame([{"mode": k, "a_s": f.a, "b_s_per_decode": f.b, "c_s_per_token": f.c,
                          "r2": f.r2, "num_steps": f.num_steps} for k, f in fits.items()])


def run_interference(loaded, grid: InterferenceConfig, repeats: int, device: str = "cpu",
                     seed: int = 0, show_progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every (mode, B) of ``grid`` on a fresh Engine; returns (steps, imports) frames."""
    grid = grid.grid()
    steps, imports = [], []
    points = [(m, k, b) for m, k in grid.modes() for b in grid.batch_sizes_t]
    for mode, budget, b in tqdm(points, desc="interference", unit="engine",
                                disable=not show_progress, file=sys.stderr):
        engine = Engine(loaded, engine_config(grid, mode, budget, b, repeats, device))
        s, i = measure_mode(engine, grid, mode, budget, b, repeats,
                            loaded.model.config.vocab_size, seed, sync=device_sync(device))
        if not engine.is_empty():
            raise RuntimeError(f"{mode} B={b}: the measurement left requests or KV behind")
        steps += s
        imports += i
    return pd.DataFrame(steps), pd.DataFrame(imports)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab interference``: the shared model/device ones, then the grid's,
    derived from ``InterferenceConfig``."""
    measure.add_measure_args(parser, "interference")
    parser.set_defaults(repeats=3)
    for action in parser._actions:
        if action.dest == "repeats":
            action.help = "timed repeats of every grid point after 1 warm-up step; each " \
                          "point reports the repeat with the median stall (default: 3)"
    add_dataclass_args(parser.add_argument_group("grid"), InterferenceConfig)


def config_from_args(args: argparse.Namespace) -> InterferenceConfig:
    """The grid of the options (``InterferenceConfig``'s own checks apply)."""
    return dataclass_from_args(InterferenceConfig, args)


def check(args: argparse.Namespace) -> None:
    """Grid rules (``InterferenceConfig``), the device, and the model's context (read from its
    config file, no weights): the longest slot the grid needs must fit.

    Raises:
        ValueError: ``<field> must ...`` or ``argument --x: ...``."""
    model = measure.check_measure_args(args)
    grid = config_from_args(args).grid()
    limit = model_context_len(model)
    needed = grid.max_len_needed(args.repeats)
    if limit is not None and needed > limit:
        raise ValueError(f"argument --prompt-lens: the grid needs slots of {needed} tokens "
                         f"(longest prompt, or context + {args.repeats} repeats of decode steps),"
                         f" more than the context of model {model.model} ({limit} tokens): "
                         "lower --prompt-lens, --context-len or --repeats")


def run(args: argparse.Namespace, _checked: None = None) -> int:
    """Measure every grid point, write the outputs (module docstring), print the summary."""
    grid = config_from_args(args).grid()
    loaded = measure.load_for(args)
    if loaded is None:
        return 2
    steps, imports = run_interference(loaded, grid, args.repeats, args.device, args.seed)
    summary = summarize(steps, imports)
    fits = fit_step_model(steps)
    header = measure.run_header(loaded, args)
    text = sentence(summary, f"{args.device}, {loaded.name} {args.dtype}")
    out = measure.out_dir(args, "interference")
    steps.to_csv(out / "steps.csv", index=False)
    summary.to_csv(out / "interference.csv", index=False)
    fits_frame(fits).to_csv(out / "fits.csv", index=False)
    plots.plot_heatmap(summary, out / "interference.png", f"{header}; context {grid.context_len}",
                       mode_label)
    fit_lines = [f"{k}: t = {f.a * 1e3:.4g} ms + {f.b * 1e3:.4g} ms * B + {f.c * 1e3:.4g} ms * P"
                 f"   (R^2 = {f.r2:.3f}, {f.num_steps} steps)" for k, f in fits.items()]
    (out / "summary.md").write_text(
        f"# pdlab interference\n\n{header}; context C = {grid.context_len}; the "
        f"median-stall repeat of {args.repeats} after 1 warm-up step.\n\n{text}\n\n"
        + markdown_table(summary) + "\n\n## Step model\n\n" + "\n".join(f"- {x}" for x in fit_lines)
        + "\n")
    print(f"{header}; context {grid.context_len}; the median-stall repeat of {args.repeats}\n")
    print(summary.to_string(index=False) + "\n")
    print("\n".join(fit_lines) + "\n")
    print(text)
    print(f"\nwrote {out}/: steps.csv interference.csv fits.csv summary.md interference.png")
    return 0
