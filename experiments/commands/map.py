"""The ``pdlab map`` command: where disaggregation wins, over a grid of (TTFT SLO, TPOT SLO)
cells and prompt:output ratios, from the planner's simulator (``planner.slo_map``); with
``--validate K`` also checked against real runs (``experiments.map_validate``) on this
machine's devices, or with ``--validate-on emu`` on emulated ones (``engine.emulated``).

1. ``check`` refuses bad options before anything starts: SLO ranges (``MIN:MAX:STEPS``, MIN >
   0, MIN <= MAX, STEPS >= 1), ratios, the device profile, the transfer model, request lengths,
   and devices or emulation ``--validate`` cannot have.
2. Per ratio (``slo_map.map_ratio``): the synthetic workload, the rate ladder, one simulated
   sweep re-scored at every cell, the band runs of the contenders. Outputs: map.csv,
   map_runs.csv, map_io<ratio>.png, regions.txt, map.md.
3. ``--validate K``: the cells of ``slo_map.pick_cells`` run for real: map_validation.csv,
   map_validation_runs.csv (map_validation_every_cell.csv when every placement ran), the
   checked cells outlined on the heatmaps, and top-1 agreement, regret, Kendall tau and each
   disagreement with its noise verdict. Emulated runs say so, with their lateness."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from engine.config import (EngineConfig, ModelConfig, TransferConfig, add_dataclass_args,
                           check_fields, dataclass_from_args, emulated_devices, is_emulated,
                           parse_devices)
from experiments import dilation, map_validate, plots
from experiments.options import (CPU_ENGINE_DEFAULTS, add_model_args, add_transfer_args,
                                 check_model, check_out, engine_config, find_profile,
                                 load_profiles_for, option_error, rate_list, what_if_transfer)
from deployment.placement import emulation_for, worker_layout
from experiments.workload_spec import WorkloadSpec, build_workload, context_len, requests_of
from planner import search, slo_map
from planner.latency import LINKS, DeviceProfile, TransferModel
from planner.sizes import ProfileSet
from router.policy import POLICIES

HELP = "where disaggregation wins over SLO targets and prompt:output ratios (--validate K: checked for real)"

# The WorkloadSpec fields the map sets itself (one synthetic workload per ratio).
_SPEC_SKIP = ("dataset", "min_prompt_len", "max_prompt_len", "max_output_len", "calibrate",
              "prompt_len", "output_len")
VALIDATE_PLACEMENTS = ("all", "contenders")  # --validate-placements
VALIDATE_ON = ("here", "emu")  # --validate-on: this machine's devices, or emulated ones
EMU_KV_SCALE = 1 / 256  # --validate-on emu's default --emu-kv-scale (the repo's examples')


@dataclass(frozen=True)
class MapConfig:
    """What ``pdlab map`` draws; each field's ``help`` and bounds are its CLI option's. SLO
    ranges are ``MIN:MAX:STEPS`` seconds, geometric (``slo_map.parse_range``); ``io_ratio``
    0.25 is 1 prompt token per 4 output tokens; ``speed_spread`` is ``planner.band``'s."""

    devices: int = field(default=2, metadata={"min": 1, "help": "devices N to place on"})
    device_profile: str | None = field(default=None, metadata={
        "pattern": r".*\S.*\.json", "hint": "a path ending in .json",
        "help": "device profile from `pdlab profile` (unset: the newest of this model); "
                "comma-separated, one per TP size (`pdlab profile --from-silicon-db --tp T`): "
                "each phase's instances then take any (TP, PP) that fits"})
    max_pp: int = field(default=1, metadata={
        "min": 1, "help": "largest PP size searched (divisors of the layer count)"})
    ttft_slo: str = field(default="0.1:4:8", metadata={"help": "TTFT SLOs MIN:MAX:STEPS (s)"})
    tpot_slo: str = field(default="0.01:0.2:8", metadata={"help": "TPOT SLOs MIN:MAX:STEPS (s)"})
    io_ratio: str = field(default="0.25,1,4", metadata={
        "help": "prompt:output token ratios, comma-separated"})
    request_tokens: int = field(default=256, metadata={
        "min": 2, "help": "mean prompt + output tokens per request"})
    num_rates: int = field(default=10, metadata={"min": 2, "help": "rates per ratio's ladder"})
    chunk_budgets: str = field(default="", metadata={
        "pattern": r"(\d+(,\d+)*)?", "hint": "N,N,...", "help": "extra chunk budgets for colocated:N"})
    conditional: bool = field(default=True, metadata={"help": "include conditional:xPyD"})
    link: str | None = field(default=None, metadata={
        "choices": tuple(LINKS), "help": "KV link model instead of the profile's --transport"})
    transfer_latency_s: float | None = field(default=None, metadata={
        "min": 0, "help": "what if: fixed seconds per KV transfer"})
    transfer_bandwidth_gbps: float | None = field(default=None, metadata={
        "gt": 0, "help": "what if: KV transfer GB/s"})
    speed_spread: float = field(default=0.15, metadata={
        "min": 0, "help": "no clear winner where the winner with steps 1+S slower does not "
                          "beat the runner-up with steps 1-S faster; < 1"})
    validate: int = field(default=0, metadata={"min": 0, "help": "cells checked for real"})
    validate_requests: int = field(default=20, metadata={"min": 1, "help": "fewest requests "
                                                                           "per seed per real run"})
    validate_reruns: int = field(default=0, metadata={"min": 0, "help": "real reruns of every "
                                                                        "validation run"})
    validate_rates: str = field(default="", metadata={
        "help": "real runs' rates req/s, comma-separated (default: the map's ladder); rungs "
                "doubling the top are added until it passes 1.5 x every run placement's "
                "predicted goodput, up to twice the map's top rate"})
    validate_window_s: float | None = field(default=None, metadata={
        "gt": 0, "help": "real runs' arrival window (s): a run at rate r has ceil(r x window) "
                         "requests, at least --validate-requests, at most --num-requests "
                         "(unset: 4 x the loosest TTFT SLO)"})
    validate_placements: str = field(default="all", metadata={
        "choices": VALIDATE_PLACEMENTS, "help": "placements run per checked cell: all, or "
                                                "contenders (each family's best there)"})
    validate_on: str = field(default="here", metadata={
        "choices": VALIDATE_ON, "help": "where --validate runs: here (this machine's devices) "
                                        "or emu (emulated devices emu:0..N-1 running the "
                                        "--device-profile's step times)"})
    local: bool = field(default=False, metadata={
        "help": "real runs' workers in this process (needs --transport inprocess)"})
    jobs: int = field(default=0, metadata={"min": 0, "help": "simulation processes (0: one per CPU)"})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.speed_spread >= 1:
            raise ValueError(f"speed_spread must be >= 0 and < 1, got {self.speed_spread}")


@dataclass(frozen=True)
class MapJob:
    """Everything ``run`` needs, checked."""

    cfg: MapConfig
    ttft_grid: tuple[float, ...]
    tpot_grid: tuple[float, ...]
    ratios: tuple[float, ...]
    specs: dict  # ratio -> WorkloadSpec
    profile: DeviceProfile
    profile_path: Path
    transfer_model: TransferModel | None
    candidates: list
    rates: list[float] | None
    validate_rates: list[float] | None
    model: ModelConfig
    engine: EngineConfig
    transfer: TransferConfig
    policy: str
    out: Path
    validate_devices: tuple[str, ...] = ()  # --validate's devices (emu:0.. with --validate-on emu)
    validate_engine: EngineConfig | None = None  # the real runs' engine (emulation set)
    profiles: DeviceProfile | ProfileSet | None = None  # what the simulator reads (None: profile)

    @property
    def simulated(self) -> DeviceProfile | ProfileSet:
        return self.profile if self.profiles is None else self.profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab map``."""
    add_dataclass_args(parser.add_argument_group("map"), MapConfig)
    add_model_args(parser)
    parser.add_argument("--rates", type=rate_list, default=None,
                        help="total arrival rates req/s for every ratio (default: --num-rates "
                             "around each ratio's capacity estimate)")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES, help="router policy")
    parser.add_argument("--out", default=None, help="results directory (default: results/map-<time>)")
    workload = parser.add_argument_group("workload (synthetic, one per --io-ratio)")
    add_dataclass_args(workload, WorkloadSpec, skip=_SPEC_SKIP)
    workload.set_defaults(num_requests=300, seeds=1)
    engine = parser.add_argument_group("engine (per instance)")
    # device_profile: map's own --device-profile (the simulator's), also the emulation's
    add_dataclass_args(engine, EngineConfig, skip=("device", "device_profile"))
    engine.set_defaults(**{**CPU_ENGINE_DEFAULTS, "max_model_len": None}, emu_kv_scale=None)
    for action in engine._group_actions:
        if action.dest == "emu_kv_scale":  # None: not given (refused without --validate-on emu)
            action.help = ("--validate-on emu only: fraction of the emulated model's KV bytes "
                           f"per token held and moved, in (0, 1] (default: {EMU_KV_SCALE:g} "
                           "= 1/256)")
    add_transfer_args(parser, conditional=False)


def _parsed(option: str, fn, text: str):
    try:
        return fn(text)
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise option_error(option, str(err)) from None


def check(args: argparse.Namespace) -> MapJob:
    """Step 1 of the module docstring; nothing runs and no weights are read.

    Raises:
        ValueError: the first bad option (``argument --x: ...``)."""
    cfg = dataclass_from_args(MapConfig, args)
    ttft = _parsed("--ttft-slo", lambda t: slo_map.parse_range(t, "TTFT SLO"), cfg.ttft_slo)
    tpot = _parsed("--tpot-slo", lambda t: slo_map.parse_range(t, "TPOT SLO"), cfg.tpot_slo)
    ratios = _parsed("--io-ratio", slo_map.parse_ratios, cfg.io_ratio)
    val_rates = _parsed("--validate-rates", rate_list, cfg.validate_rates) if cfg.validate_rates else None
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    kv_scale = EMU_KV_SCALE if args.emu_kv_scale is None else args.emu_kv_scale
    # --device-profile is the simulator's; _check_validation gives it to the emulation
    engine = dataclasses.replace(
        engine_config(argparse.Namespace(**{**vars(args), "emu_kv_scale": kv_scale}), model),
        device_profile=None)
    if cfg.validate_on == "emu" and not cfg.validate:
        raise option_error("--validate-on", "emu says where --validate K runs the checked "
                                            "cells: give --validate K too")
    if cfg.validate_window_s is not None and not cfg.validate:
        raise option_error("--validate-window-s", "sizes the runs of --validate K: give "
                                                  "--validate K too")
    if cfg.validate_placements != "all" and not cfg.validate:
        raise option_error("--validate-placements", "says which placements --validate K runs: "
                                                    "give --validate K too")
    if args.emu_kv_scale is not None and cfg.validate_on != "emu":
        raise option_error("--emu-kv-scale", "scales the emulated devices' KV: only with "
                                             "--validate K --validate-on emu")
    if engine.emu_time_scale != 1 and cfg.validate_on != "emu":
        raise option_error("--emu-time-scale", "dilates the emulated devices' time: only "
                                               "with --validate K --validate-on emu")
    base = dataclass_from_args(WorkloadSpec, args)
    specs = {}
    for r in ratios:
        prompt, output = slo_map.ratio_lengths(r, cfg.request_tokens)
        specs[r] = dataclasses.replace(base, dataset="synthetic", prompt_len=prompt, output_len=output)
        if specs[r].max_request_len() > engine.max_model_len:
            raise option_error("--request-tokens", f"io ratio {r:g} draws requests of up to "
                                                   f"{specs[r].max_request_len()} tokens, more "
                                                   f"than --max-model-len {engine.max_model_len}")
    budgets = [int(b) for b in cfg.chunk_budgets.split(",") if b]
    for b in budgets:
        if b < engine.max_num_seqs:
            raise option_error("--chunk-budgets", f"each budget must be >= --max-num-seqs "
                                                  f"({engine.max_num_seqs}), got {b}")
    transfer = dataclass_from_args(TransferConfig, args)
    if transfer.granularity != "request":
        raise option_error("--granularity", "the simulator models whole-request KV transfers only")
    path = Path(cfg.device_profile) if cfg.device_profile else find_profile(model)
    if path is None:
        raise option_error("--device-profile", f"no device profile of model {model.model} "
                                               f"({model.dtype}) under results/: run `pdlab "
                                               "profile` or pass --device-profile FILE")
    profile, profiles = load_profiles_for(str(path), model, "--device-profile", cfg.devices,
                                          engine, cfg.max_pp)
    sizes = profiles.sizes if isinstance(profiles, ProfileSet) else ((1, 1),)
    cands = slo_map.map_candidates(cfg.devices, budgets, cfg.conditional, sizes)
    transfer_model = what_if_transfer(profile, transfer.transport, cfg.transfer_latency_s,
                                      cfg.transfer_bandwidth_gbps, cfg.devices >= 2, cfg.link)
    devices, run_engine = (_check_validation(cfg, cands, profile, path, model, engine, transfer)
                           if cfg.validate else ((), None))
    check_out(args.out)
    out = Path(args.out or f"results/map-{time.strftime('%Y%m%d-%H%M%S')}")
    return MapJob(cfg, ttft, tpot, ratios, specs, profile, path, transfer_model, cands,
                  args.rates, val_rates, model, engine, transfer, args.policy, out, devices,
                  run_engine, profiles)


def _check_validation(cfg: MapConfig, cands, profile: DeviceProfile, path: Path,
                      model: ModelConfig, engine: EngineConfig,
                      transfer: TransferConfig) -> tuple[tuple[str, ...], EngineConfig]:
    """``--validate``: the real runs' devices (``here``: this machine's, of the profile's kind;
    ``emu``: ``emu:0`` .. ``emu:N-1`` on the map's profile) and engine; every candidate must fit.

    Raises:
        ValueError: ``argument --x: ...`` naming what cannot run."""
    if cfg.validate_on == "emu":
        devices = emulated_devices(cfg.devices)
        engine = dataclasses.replace(engine, device_profile=str(path))
        emulation_for(devices, model, engine)  # ValueError: argument --device-profile/--model
    else:
        devices = parse_devices(None)
        kind = "cuda" if devices[0].startswith("cuda") else "cpu"
        if profile.device_kind != kind:
            raise option_error("--validate", f"the profile describes {profile.device_kind} "
                                             f"devices ({profile.device_name}) but this "
                                             f"machine's are {kind}: real runs could not check "
                                             "it (--validate-on emu: on emulated devices)")
    for cand in cands:
        try:
            worker_layout(cand.placement, devices)
        except ValueError as err:
            raise option_error("--validate", f"runs every placement of --devices {cfg.devices} "
                                             f"for real: {err}") from None
    if cfg.local and transfer.transport != "inprocess":
        raise option_error("--local", f"needs --transport inprocess, got {transfer.transport}")
    if not cfg.local and transfer.transport == "inprocess":
        raise option_error("--transport", "inprocess needs --local (workers in one process)")
    return devices, engine


def run(args: argparse.Namespace, job: MapJob) -> int:
    """Steps 2-3 of the module docstring; returns 0."""
    x = job
    cfg = x.cfg
    jobs = cfg.jobs or len(os.sched_getaffinity(0))
    max_len = context_len(x.model, x.engine)
    print(f"pdlab map: {len(x.candidates)} placements of {cfg.devices} devices x "
          f"{len(x.ttft_grid)} TTFT x {len(x.tpot_grid)} TPOT SLOs x {len(x.ratios)} io ratios; "
          f"profile {x.profile_path} ({x.profile.model}, {x.profile.device_kind} "
          f"{x.profile.device_name})")
    if isinstance(x.simulated, ProfileSet):
        print(f"  instance sizes (TP, PP) searched: {', '.join(map(str, x.simulated.sizes))}")
        for line in x.simulated.refusal_lines():
            print("  " + line)
    if x.transfer_model is not None:
        print(f"  KV transfer: {x.transfer_model.latency_s:.3g} s + bytes / "
              f"{x.transfer_model.bandwidth_bytes_s / 1e9:.4g} GB/s"
              + (f" (link {cfg.link})" if cfg.link else f" ({x.transfer.transport})"))
    x.out.mkdir(parents=True, exist_ok=True)
    families = {c.label: slo_map.family_of(c.placement) for c in x.candidates}
    tables, all_runs, predicted, workloads, ladders, region_text = [], [], {}, {}, {}, []
    start = time.perf_counter()
    for ratio in x.ratios:
        spec = x.specs[ratio]
        items = {s: build_workload(spec, x.model, s, max_len) for s in spec.seed_list}
        workloads[ratio] = items
        requests = {s: requests_of(its, f"s{s}") for s, its in items.items()}
        flat = [it for its in items.values() for it in its]
        rates = x.rates or search.auto_rates(
            x.profile, sum(it.num_prompt_tokens for it in flat) / len(flat),
            sum(it.output_len for it in flat) / len(flat), cfg.devices, cfg.num_rates,
            x.engine.max_num_seqs)
        ladders[ratio] = rates
        with tqdm(total=len(x.candidates) * len(rates) * len(requests), unit="run",
                  desc=f"io {ratio:g} (prompt {spec.prompt_len}, output {spec.output_len})",
                  file=sys.stderr) as bar:
            def tick() -> None:
                if bar.n >= bar.total:  # the band runs come after the sweep
                    bar.total += 1
                bar.update()
            table, runs, goodput = slo_map.map_ratio(
                x.candidates, rates, requests, x.engine, x.simulated, x.transfer_model,
                x.ttft_grid, x.tpot_grid, ratio, cfg.speed_spread, spec.arrival,
                spec.burstiness, x.policy, tick, jobs)
        tables.append(table)
        all_runs.append(runs.assign(io_ratio=ratio))
        predicted[ratio] = goodput
        region_text += [f"io ratio {ratio:g} (prompt {spec.prompt_len}, output {spec.output_len} "
                        f"tokens; rates {rates} req/s):"]
        region_text += ["  " + line for line in slo_map.regions(table, x.ttft_grid, x.tpot_grid)]
    wall_s = time.perf_counter() - start
    cells = pd.concat(tables, ignore_index=True)
    cells.to_csv(x.out / "map.csv", index=False)
    pd.concat(all_runs, ignore_index=True).to_csv(x.out / "map_runs.csv", index=False)
    header = (f"pdlab map: {x.model.model} on {cfg.devices} x {x.profile.device_kind} "
              f"{x.profile.device_name}; speed band +/-{cfg.speed_spread:g}; "
              f"{len(cells)} cells in {wall_s:.1f} s over {jobs} process(es)")
    print("\n" + header + "\n" + "\n".join(region_text))

    def write_map(checked: pd.DataFrame, summary: list[str]) -> None:
        """The heatmaps, regions.txt and map.md (with the validation once it ran)."""
        for ratio, table in zip(x.ratios, tables):
            plots.plot_slo_map(table, x.ttft_grid, x.tpot_grid, x.out / f"map_io{ratio:g}.png",
                               f"{x.model.model}, {cfg.devices} x {x.profile.device_name}, io "
                               f"ratio {ratio:g}", checked[checked["io_ratio"] == ratio])
        (x.out / "regions.txt").write_text("\n".join([header, *region_text, *summary]) + "\n")
        md = [f"# {header}", "", "```", *region_text, "```", "",
              *[f"![io {r:g}](map_io{r:g}.png)" for r in x.ratios], ""]
        if summary:
            md += ["## Checked against real runs" + (" on emulated devices" if is_emulated(
                x.validate_devices) else ""), "", "```", *summary, "```", ""]
        (x.out / "map.md").write_text("\n".join(md))

    # the map's files first: a validation (minutes to hours) stopped part-way keeps them
    write_map(pd.DataFrame(columns=map_validate.CHECK_COLUMNS), [])
    if cfg.validate:
        write_map(*_validate(x, cells, predicted, workloads, ladders, families))
    print(f"\nResults: {x.out}/ (map.csv, map_runs.csv, regions.txt, map.md, "
          + ", ".join(f"map_io{r:g}.png" for r in x.ratios)
          + (", map_validation.csv, map_validation_runs.csv" if cfg.validate else "")
          + (", map_validation_every_cell.csv" if cfg.validate and
             cfg.validate_placements == "all" else "") + ")")
    return 0


def _dilated(scale: float) -> str:
    return "" if scale == 1 else ", " + dilation.label(scale)


def _validate(x: MapJob, cells: pd.DataFrame, predicted: dict, workloads: dict, ladders: dict,
              families: dict) -> tuple[pd.DataFrame, list[str]]:
    """Step 3: the picked cells run for real and scored; writes map_validation*.csv."""
    cfg = x.cfg
    picked = slo_map.pick_cells(cells, cfg.validate)
    devices = ",".join(x.validate_devices)
    emulated = is_emulated(x.validate_devices)
    where = (f"on emulated devices ({devices}: {x.profile.device_name} step times of "
             f"{x.profile_path}, KV x {x.validate_engine.emu_kv_scale:g}"
             f"{_dilated(x.validate_engine.emu_time_scale)})" if emulated
             else f"on this machine's {devices}")
    checked, every, kept, per_run = [], [], [], []
    ratios = list(dict.fromkeys(picked["io_ratio"]))
    runs_of = {}  # ratio -> the candidates its checked cells run
    for ratio in ratios:
        keep = (map_validate.contenders(picked[picked["io_ratio"] == ratio], predicted[ratio],
                                        families)
                if cfg.validate_placements == "contenders" else list(families))
        runs_of[ratio] = [c for c in x.candidates if c.label in keep]
    total = (1 + cfg.validate_reruns) * sum(map(len, runs_of.values()))
    print(f"\nvalidating {len(picked)} cell(s) for real {where}: "
          + ", ".join(f"io {r:g}: {len(runs_of[r])} of {len(x.candidates)} placements"
                      for r in ratios)
          + f" ({cfg.validate_placements}) x {1 + cfg.validate_reruns} pass(es)")
    window = cfg.validate_window_s or map_validate.WINDOW_TTFTS * max(x.ttft_grid)
    rates_of, size_of, ladder_lines = {}, {}, []
    for ratio in ratios:
        here = picked[picked["io_ratio"] == ratio]
        best = max(float(predicted[ratio][c.label][i, j]) * c.num_devices for c in runs_of[ratio]
                   for i, j in zip(here["ttft_index"], here["tpot_index"]))
        cap = 2 * max(ladders[ratio])  # the map's goodputs are at most its top rate
        rates_of[ratio] = map_validate.bracketing_rates(x.validate_rates or ladders[ratio], best,
                                                        cap)
        size_of[ratio] = functools.partial(map_validate.run_size, window_s=window,
                                           floor=cfg.validate_requests,
                                           num_requests=x.specs[ratio].num_requests)
        ladder_lines.append(
            f"io {ratio:g}: rates {', '.join(f'{r:g}' for r in rates_of[ratio])} req/s (the "
            f"top above {map_validate.BRACKET:g} x the highest predicted goodput of the "
            f"placements run, {best:.3g} req/s, or at the cap {cap:g}); requests per run "
            f"{', '.join(str(size_of[ratio](r)) for r in rates_of[ratio])} (window {window:g} "
            f"s, at least {cfg.validate_requests}, at most {x.specs[ratio].num_requests})")
        print("  " + ladder_lines[-1])
    with tqdm(total=total, desc="real runs", unit="placement", file=sys.stderr) as bar:
        for ratio in ratios:
            runs = map_validate.real_runs(runs_of[ratio], rates_of[ratio], workloads[ratio],
                                          x.specs[ratio], x.model, x.validate_engine, x.transfer,
                                          devices, x.policy, cfg.local, cfg.validate_reruns,
                                          bar.update, size_of[ratio])
            here = picked[picked["io_ratio"] == ratio]
            # with every placement run, every cell is scored (a run does not depend on the
            # SLO) and the picked cells are rows of that; else the picked cells alone
            scored = map_validate.check_cells(
                cells[cells["io_ratio"] == ratio] if cfg.validate_placements == "all" else here,
                predicted[ratio], runs, x.ttft_grid, x.tpot_grid, families)
            if cfg.validate_placements == "all":
                every.append(scored)
            by_cell = scored.set_index(["ttft_index", "tpot_index"], drop=False)
            checked.append(by_cell.loc[list(zip(here["ttft_index"], here["tpot_index"]))]
                           .reset_index(drop=True))
            long = runs.explode(search.LATENCY_COLUMNS).rename(
                columns={"ttft_s_all": "ttft_s", "tpot_s_all": "tpot_s"})
            kept.append(long.assign(io_ratio=ratio))
            per_run.append(runs.assign(io_ratio=ratio))
    table = pd.concat(checked, ignore_index=True)
    table.assign(emulated=emulated, devices=devices).to_csv(x.out / "map_validation.csv",
                                                            index=False)
    pd.concat(kept, ignore_index=True).to_csv(x.out / "map_validation_runs.csv", index=False)
    summary = map_validate.summary_lines(
        table, cfg.validate_reruns, ("on emulated devices" if emulated else "for real")
        + (", each family's best placement per cell (--validate-placements contenders)"
           if cfg.validate_placements == "contenders" else ""))
    if every:
        table_all = pd.concat(every, ignore_index=True)
        table_all.to_csv(x.out / "map_validation_every_cell.csv", index=False)
        summary.append(map_validate.every_cell_line(table_all, int(cells["at_sweep_top"].sum())))
    late = map_validate.lateness_line(pd.concat(per_run, ignore_index=True))
    summary = [f"real runs {where}", *ladder_lines, *summary, *([late] if late else [])]
    print("\n" + table[["io_ratio", "ttft_slo_s", "tpot_slo_s", "map_verdict", "mapped",
                        "measured_first", "regret", "undecided"]].to_string(index=False) + "\n")
    print("\n".join(summary))
    return table, summary
