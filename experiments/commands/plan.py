"""The ``pdlab plan`` command: search placements of N devices on the simulator, print the ranked
table, write it with the curves and a plot; ``--validate`` also runs the best placements for real
and reports the simulator's error.

1. ``check``: the device profile was measured on this model and dtype, the transport has a
   transfer model, chunk budgets suit the engine, lengths fit the model's context.
2. Build the workload per seed (the requests a real ``pdlab compare`` would send), sweep and
   rank (``search``): plan.csv (ranked), plan_curves.csv (per candidate and rate),
   plan_runs.csv (per seed), plan_attainment.png, plan.md. ``--speed-spread``: the best
   ``--top`` again at steps 1 ± spread x the profile's (``band``), plan_band_runs.csv.
3. ``--validate``: ``validate.validate`` for the best ``--top`` placements that fit this
   machine, at the swept rates, on the first ``--validate-requests`` requests of each seed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from engine.config import (GIB, EngineConfig, ModelConfig, TransferConfig, add_dataclass_args,
                           check_fields, dataclass_from_args, emulated_devices, parse_devices)
from engine.metrics import SLO
from experiments import dilation, plots, validate
from deployment.placement import emulation_for
from experiments.options import (CPU_ENGINE_DEFAULTS, add_model_args, add_slo_args, add_transfer_args,
                                 check_model,
                                 check_out, engine_config, find_profile, load_profiles_for,
                                 option_error, rate_list, what_if_transfer)
from deployment.placement import worker_layout
from experiments.report import markdown_table
from experiments.workload_spec import (Timed, WorkloadSpec, build_workload, context_len,
                                       requests_of, trace_rate)
from planner import band, search, simulate
from planner.latency import DeviceProfile, TransferModel, summary_lines
from planner.sizes import ProfileSet
from router.policy import POLICIES

HELP = "rank placements of N devices on the simulator (--validate: and check it against real runs)"

BUDGETS = r"(\d+(,\d+)*)?"


@dataclass(frozen=True)
class PlanConfig:
    """What ``pdlab plan`` searches and the "what if" knobs beyond the engine's own; each field's
    ``help`` and bounds are its CLI option's. ``step_scale`` multiplies every modelled step time
    (``DeviceProfile.scaled``), as Dynamo's SLA planner applies its observed / expected correction.

    Raises:
        ValueError: a field outside its bounds (``check_fields``), ``speed_spread >= 1``."""

    devices: int = field(default=2, metadata={"min": 1, "help": "devices N to place on"})
    profile: str | None = field(default=None, metadata={
        "pattern": r".*\S.*\.json", "hint": "a path ending in .json",
        "help": "device profile from `pdlab profile` (unset: the newest of this model); "
                "comma-separated, one per TP size (`pdlab profile --from-silicon-db --tp T`): "
                "each phase's instances then take any (TP, PP) that fits"})
    max_pp: int = field(default=1, metadata={
        "min": 1, "help": "largest PP size searched (divisors of the layer count)"})
    num_rates: int = field(default=8, metadata={"min": 2, "help": "rates in the automatic sweep"})
    chunk_budgets: str = field(default="", metadata={
        "pattern": BUDGETS, "hint": "N,N,...", "help": "extra chunk budgets for colocated:N"})
    transfer_latency_s: float | None = field(default=None, metadata={
        "min": 0, "help": "what if: fixed seconds per KV transfer"})
    transfer_bandwidth_gbps: float | None = field(default=None, metadata={
        "gt": 0, "help": "what if: KV transfer GB/s"})
    top: int = field(default=3, metadata={"min": 1, "help": "placements plotted, banded "
                                                          "(--speed-spread) and validated"})
    validate: bool = field(default=False, metadata={
        "help": "run the best --top placements for real too and report the simulator's error"})
    validate_requests: int = field(default=50, metadata={
        "min": 1, "help": "requests per seed in each validation run (one request = 100/N "
                          "attainment points)"})
    validate_reruns: int = field(default=0, metadata={
        "min": 0, "help": "with --validate: run every validated point again for real this "
                          "many times, for the machine's own run-to-run difference (the floor "
                          "under the simulator's error)"})
    step_scale: float = field(default=1.0, metadata={
        "gt": 0, "help": "multiply every modelled step time (a factor --validate measured)"})
    jobs: int = field(default=0, metadata={
        "min": 0, "help": "simulation processes (0: one per CPU this process may use)"})
    speed_spread: float = field(default=0.0, metadata={
        "min": 0, "help": "also simulate the best --top with steps 1 +/- this x the profile's "
                          "(a goodput band; 0.15 covers this VM's drift), < 1; 0 = off"})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.speed_spread >= 1:
            raise ValueError(f"speed_spread must be >= 0 and < 1, got {self.speed_spread}")

    @property
    def num_jobs(self) -> int:
        return self.jobs or len(os.sched_getaffinity(0))

    @property
    def budgets(self) -> list[int]:
        return [int(b) for b in self.chunk_budgets.split(",") if b]


@dataclass(frozen=True)
class PlanJob:
    """Everything ``main`` needs, checked."""

    plan: PlanConfig
    profile: DeviceProfile
    profile_path: Path
    transfer_model: TransferModel | None
    candidates: list[search.Candidate]
    rates: list[float] | None
    spec: object
    model: ModelConfig
    engine: EngineConfig
    transfer: TransferConfig
    slo: SLO
    policy: str
    out: Path
    profiles: DeviceProfile | ProfileSet | None = None  # what the simulator reads (None: profile)

    @property
    def simulated(self) -> DeviceProfile | ProfileSet:
        return self.profile if self.profiles is None else self.profiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab plan`` (the workload, engine and transfer groups as ``pdlab compare``)."""
    add_dataclass_args(parser.add_argument_group("plan"), PlanConfig)
    add_model_args(parser)
    parser.add_argument("--rates", type=rate_list, default=None,
                        help="total arrival rates in req/s, comma-separated (default: "
                             "--num-rates rates around the profile's capacity estimate)")
    add_slo_args(parser)
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES, help="router policy")
    parser.add_argument("--out", default=None, help="results directory (default: results/plan-<time>)")
    workload = parser.add_argument_group("workload")
    add_dataclass_args(workload, WorkloadSpec)
    workload.set_defaults(num_requests=1000)
    engine = parser.add_argument_group("engine (per instance; kv-capacity-tokens and "
                                       "max-num-batched-tokens are what-if knobs here)")
    add_dataclass_args(engine, EngineConfig, skip=("device",))
    engine.set_defaults(**{**CPU_ENGINE_DEFAULTS, "max_model_len": None})
    add_transfer_args(parser, conditional=False)


def _transfer_model(plan: PlanConfig, profile: DeviceProfile, transport: str,
                    needed: bool) -> TransferModel | None:
    return what_if_transfer(profile, transport, plan.transfer_latency_s,
                            plan.transfer_bandwidth_gbps, needed)


def check(args: argparse.Namespace) -> PlanJob:
    """Step 1 of the module docstring; nothing is started and no weights are read.

    Raises:
        ValueError: the first bad option (``argument --x: ...`` or ``<field> must ...``)."""
    plan = dataclass_from_args(PlanConfig, args)
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    spec = dataclass_from_args(WorkloadSpec, args)
    engine = engine_config(args, model)
    longest = spec.max_request_len()
    if longest is not None and longest > engine.max_model_len:
        raise option_error("--max-output-len" if spec.dataset != "synthetic" else "--prompt-len",
                               f"the workload allows requests of {longest} tokens, more than "
                               f"--max-model-len {engine.max_model_len}")
    for budget in plan.budgets:
        if budget < engine.max_num_seqs:
            raise option_error("--chunk-budgets", f"each budget must be >= --max-num-seqs "
                                                      f"({engine.max_num_seqs}), got {budget}")
    if spec.calibrate:
        raise option_error("--calibrate", "pdlab plan sweeps its own rates (--rates or "
                                              "--num-rates); calibration is for real runs")
    if spec.dataset == "mooncake" and args.rates is not None:
        raise option_error("--rates", "a mooncake trace is replayed at its own timestamps "
                                      "(scaled by --trace-time-scale-s): --rates do not apply")
    transfer = dataclass_from_args(TransferConfig, args)
    if plan.validate and transfer.transport == "inprocess":  # Deployment would refuse it, later
        raise option_error("--transport", "--validate runs the placements for real, one "
                                              "process per worker: use 'ray', 'shm' or "
                                              "'torchdist' ('inprocess' needs one process)")
    if transfer.granularity != "request":
        raise option_error("--granularity", "the simulator models whole-request KV "
                                                "transfers only (granularity 'request')")
    if engine.device_profile is not None:  # --validate on emulated devices (emu:0..N-1)
        emulation_for(emulated_devices(plan.devices), model, engine,  # ValueError names it
                      whole_kv_caches=plan.validate)
    if engine.emu_time_scale != 1 and (engine.device_profile is None or not plan.validate):
        raise option_error("--emu-time-scale", "dilates emulated devices only: --validate "
                                               "with --device-profile")
    dilation.check_dataset(spec.dataset, engine.emu_time_scale)
    path = (Path(plan.profile) if plan.profile else
            Path(engine.device_profile) if engine.device_profile else find_profile(model))
    if path is None:
        raise option_error("--profile", f"no device profile of model {model.model} "
                                            f"({model.dtype}) under results/: run `pdlab profile "
                                            f"--model {model.model}` or pass --profile FILE")
    profile, profiles = load_profiles_for(str(path), model, "--profile", plan.devices, engine,
                                          plan.max_pp)
    profile, profiles = profile.scaled(plan.step_scale), profiles.scaled(plan.step_scale)
    kv_cache_line(profile, engine)  # a budget that cannot be computed or holds no block
    sizes = profiles.sizes if isinstance(profiles, ProfileSet) else ((1, 1),)
    cands = search.candidates(plan.devices, plan.budgets, sizes)
    transfer_model = _transfer_model(plan, profile, transfer.transport,
                                     any(c.placement.startswith("disagg") for c in cands))
    check_out(args.out)
    out = Path(args.out or f"results/plan-{time.strftime('%Y%m%d-%H%M%S')}")
    return PlanJob(plan, profile, path, transfer_model, cands, args.rates, spec, model, engine,
                   transfer, SLO(args.slo_ttft_s, args.slo_tpot_s), args.policy, out, profiles)


def kv_cache_line(profile: DeviceProfile, engine: EngineConfig) -> str:
    """One line: each simulated instance's KV cache, by the engine's rule on the profile's device
    (``DeviceProfile.kv_budget_bytes``; on CUDA ``--gpu-memory-utilization`` x the device's memory
    less the weights).

    Raises:
        ValueError: ``argument --profile: ...`` when the profile lacks what the rule needs;
            ``argument --gpu-memory-utilization`` / ``--kv-cache-memory-gb: ...`` when the
            budget holds no block."""
    try:
        budget_bytes = profile.kv_budget_bytes(engine)
    except ValueError as err:
        raise option_error("--profile", str(err)) from None
    blocks = simulate.num_kv_blocks(engine, profile.kv_bytes_per_device_token, budget_bytes)
    if blocks is not None and blocks < 1:
        option = ("--gpu-memory-utilization" if profile.device_kind == "cuda"
                  and engine.kv_cache_memory_gb is None else "--kv-cache-memory-gb")
        raise option_error(option, f"each instance's KV budget of {budget_bytes / GIB:.3g} GiB "
                                   f"holds no block of {engine.block_size} tokens "
                                   f"({engine.block_size * profile.kv_bytes_per_device_token} bytes)")
    rule = (f"{engine.kv_cache_memory_gb:g} GiB (--kv-cache-memory-gb)"
            if engine.kv_cache_memory_gb is not None else
            f"{engine.gpu_memory_utilization:g} x {profile.device_memory_bytes / GIB:.4g} GiB "
            f"- {profile.weight_bytes / GIB:.3g} GiB of weights"
            if profile.device_kind == "cuda" else "the CPU default")
    if blocks is None:  # no KV geometry: the Scheduler's cap alone
        blocks = engine.max_kv_blocks
    capped = (" (capped: max_num_seqs x max_model_len need no more)"
              if blocks == engine.max_kv_blocks else "")
    return (f"  KV cache per instance: {blocks} blocks of {engine.block_size} tokens{capped}; "
            f"budget {budget_bytes / GIB:.4g} GiB = {rule}")


def prefill_range_warning(profile: DeviceProfile, longest_prompt: int) -> str:
    """A warning when the workload's longest prompt (tokens) is longer than any the profile
    measured (its prefill is then extrapolated by the fit's quadratic term); "" when not, or
    when the profile does not say."""
    top = profile.max_prefill_tokens
    if top is None or longest_prompt <= top:
        return ""
    return (f"Warning: the workload has prompts of up to {longest_prompt} tokens, but the "
            f"profile measured prefill only up to {top}: longer prefill steps are "
            f"extrapolated. Profile them: `pdlab profile --prompt-lens ...,{longest_prompt}`.")


def _console(ranked: pd.DataFrame) -> str:
    cols = {"rank": "#", "candidate": "placement", "num_devices": "devices",
            "goodput_per_device_req_s": "goodput/device (req/s)",
            "goodput_seed_min": "seed min", "goodput_seed_max": "seed max",
            **({"goodput_slow": "slow", "goodput_fast": "fast"} if "goodput_slow" in ranked else {}),
            "ttft_p50_s": "TTFT p50 (s)", "tpot_p99_s": "TPOT p99 (s)",
            "prefix_hit_rate": "prefix hits"}
    return ranked[list(cols)].rename(columns=cols).to_string(index=False, float_format="{:.4g}".format)


def run(args: argparse.Namespace, job: PlanJob) -> int:
    """Steps 2-3 of the module docstring; returns 0."""
    x = job
    max_len = context_len(x.model, x.engine)
    items = {seed: build_workload(x.spec, x.model, seed, max_len) for seed in x.spec.seed_list}
    requests = {seed: requests_of(its, f"s{seed}") for seed, its in items.items()}
    all_items = [it for its in items.values() for it in its]
    timed = isinstance(items[x.spec.seed], Timed)
    if timed:  # one run per placement and seed, at the trace's own times (labelled by its rate)
        rates = [float(f"{min(trace_rate(its) for its in items.values()):.4g}")]
        print(f"pdlab plan: the mooncake trace is replayed at its own timestamps (mean "
              f"{rates[0]:g} req/s): one run per placement and seed, labelled with that rate; "
              f"goodput/device is that rate over the devices where >= 90% met the SLO, else 0")
    else:
        rates = x.rates or search.auto_rates(
            x.profile, sum(it.num_prompt_tokens for it in all_items) / len(all_items),
            sum(it.output_len for it in all_items) / len(all_items), x.plan.devices,
            x.plan.num_rates, x.engine.max_num_seqs)
    print(f"pdlab plan: {len(x.candidates)} placements of {x.plan.devices} devices x {len(rates)} "
          f"rates {rates} {x.spec.rate_unit} x {len(requests)} seeds x {len(all_items) // len(items)} requests; "
          f"profile {x.profile_path} ({x.profile.model}, {x.profile.device_kind} "
          f"{x.profile.device_name}, {x.profile.num_threads} threads)")
    for line in summary_lines(x.profile):
        print("  " + line)
    if isinstance(x.simulated, ProfileSet):
        print(f"  instance sizes (TP, PP) searched: {', '.join(map(str, x.simulated.sizes))}")
        for line in x.simulated.refusal_lines():
            print("  " + line)
    print(kv_cache_line(x.profile, x.engine))
    extrapolated = prefill_range_warning(x.profile, max(it.num_prompt_tokens for it in all_items))
    if extrapolated:
        print(extrapolated)
    if x.transfer_model is not None:
        print(f"  transfer used ({x.transfer.transport}): {x.transfer_model.latency_s:.4g} s + "
              f"bytes / {x.transfer_model.bandwidth_bytes_s / 1e9:.4g} GB/s")
    total = len(x.candidates) * len(rates) * len(requests)
    start = time.perf_counter()
    with tqdm(total=total, desc="simulate", unit="run", file=sys.stderr) as bar:
        runs = search.sweep(x.candidates, rates, requests, x.engine, x.simulated, x.transfer_model,
                            x.slo, x.spec.arrival, x.spec.burstiness, x.policy, bar.update,
                            x.plan.num_jobs)
        if not x.rates and not timed:  # automatic ladder: read each goodput finer inside its bracket
            extra = search.refine_rates(runs)
            by_label = {c.label: c for c in x.candidates}
            bar.total += sum(len(r) for r in extra.values()) * len(requests)
            more = {label: r for label, r in extra.items() if r}
            if more:
                runs = pd.concat([runs, search.sweep(
                    [by_label[label] for label in more], more, requests, x.engine, x.simulated,
                    x.transfer_model, x.slo, x.spec.arrival, x.spec.burstiness, x.policy,
                    bar.update, x.plan.num_jobs)], ignore_index=True)
            total = len(runs)
    wall_s = time.perf_counter() - start
    ranked, curve = search.rank(runs), search.curves(runs)
    x.out.mkdir(parents=True, exist_ok=True)
    band_text = ""
    if x.plan.speed_spread > 0:
        by_label = {c.label: c for c in x.candidates}
        top = [by_label[label] for label in ranked["candidate"].head(x.plan.top)]
        with tqdm(total=2 * int(runs["candidate"].isin(ranked["candidate"].head(x.plan.top)).sum()),
                  desc=f"speed band ±{x.plan.speed_spread:g}", unit="run", file=sys.stderr) as bar:
            banded = band.band_runs(top, runs, requests, x.engine, x.simulated, x.transfer_model,
                                    x.slo, x.plan.speed_spread, x.spec.arrival, x.spec.burstiness,
                                    x.policy, bar.update, x.plan.num_jobs)
        banded.to_csv(x.out / "plan_band_runs.csv", index=False)
        ranked, curve = band.with_band(ranked, banded), band.curve_band(curve, banded)
        band_text = band.verdict(ranked, x.plan.speed_spread)
    ranked.to_csv(x.out / "plan.csv", index=False)
    curve.to_csv(x.out / "plan_curves.csv", index=False)
    runs.to_csv(x.out / "plan_runs.csv", index=False)
    plot = plots.plot_best(curve, ranked, x.out / "plan_attainment.png", x.plan.top,
                            f"{x.model.model} on {x.plan.devices} x {x.profile.device_kind}; SLO "
                            f"TTFT <= {x.slo.ttft_s:g} s, TPOT <= {x.slo.tpot_s:g} s")
    print(f"\nsimulated {total} runs ({int(runs['num_requests'].sum())} requests) in {wall_s:.1f} s "
          f"over {x.plan.num_jobs} process(es) (simulator time summed over runs "
          f"{runs['sim_s'].sum():.1f} s)\n")
    print(_console(ranked))
    if band_text:
        print("\n" + band_text)
    ceiling = [] if timed else ranked.loc[ranked["at_sweep_top"], "candidate"].tolist()
    warning = (f"Warning: {', '.join(ceiling)} still met the SLO target at the highest swept "
               "rate, so their goodput is a lower bound set by the sweep, not a capacity: "
               "rerun with higher --rates." if ceiling else "")
    if warning:
        print("\n" + warning)
    timing = ([f"The mooncake trace is replayed at its own timestamps (mean {rates[0]:g} "
               "req/s): one run per placement and seed; goodput/device is that rate over the "
               "devices where >= 90% met the SLO, else 0.", ""] if timed else [])
    text = [f"# pdlab plan: {x.model.model} on {x.plan.devices} devices", "", *timing,
            f"SLO TTFT <= {x.slo.ttft_s:g} s, TPOT <= {x.slo.tpot_s:g} s; rates {rates} {x.spec.rate_unit}; "
            f"{x.spec.num_requests} requests x seeds {x.spec.seed_list}; profile "
            f"`{x.profile_path}`; simulated (pdlab's Scheduler and router policy, fitted step "
            "and transfer times).", "", "Goodput per device: DistServe's definition (highest "
            "swept rate with >= 90% SLO attainment there and at every lower rate, over the "
            "placement's devices), on the mean-over-seeds curve; seed min/max beside it.", "",
            markdown_table(ranked), "", *([band_text, ""] if band_text else []),
            *([warning, ""] if warning else []), *([extrapolated, ""] if extrapolated else []),
            f"![attainment]({plot.name})", ""]
    if x.plan.validate:
        text += _validate(x, rates)
    (x.out / "plan.md").write_text("\n".join(text))
    print(f"\nResults: {x.out}/ (plan.csv, plan_curves.csv, plan_runs.csv, plan_attainment.png, "
          f"plan.md{', plan_band_runs.csv' if band_text else ''}"
          f"{', validation.csv, measured/, simulated/' if x.plan.validate else ''}"
          f"{', validation_reruns.csv, measured_rerun*/' if x.plan.validate and x.plan.validate_reruns else ''})")
    return 0


def _validate(x: PlanJob, rates: list[float]) -> list[str]:
    devices = (emulated_devices(x.plan.devices) if x.engine.device_profile is not None
               else parse_devices(None))
    ranked = pd.read_csv(x.out / "plan.csv")
    by_label = {c.label: c for c in x.candidates}
    chosen = []
    for label in ranked["candidate"]:
        cand = by_label[label]
        try:
            worker_layout(cand.placement, devices)
        except ValueError:
            continue  # needs more devices than this machine has: simulated only
        if cand.placement not in {c.placement for c in chosen}:
            chosen.append(cand)
        if len(chosen) == x.plan.top:
            break
    if not chosen:
        print("validation: no placement of the search fits this machine's devices "
              f"({','.join(devices)})", file=sys.stderr)
        return ["## Validation", "", "No placement fits this machine: nothing validated.", ""]
    spec = dataclasses.replace(x.spec, num_requests=min(x.plan.validate_requests, x.spec.num_requests))
    print(f"\nvalidating {', '.join(c.label for c in chosen)} for real at {rates} req/s "
          f"({spec.num_requests} requests x {spec.seeds} seeds each)")
    errors, summary = validate.validate(chosen, rates, spec, x.model, x.engine, x.transfer,
                                        x.simulated, x.transfer_model, x.slo, x.out,
                                        ",".join(devices), None, x.policy,
                                        speed_spread=x.plan.speed_spread,
                                        num_reruns=x.plan.validate_reruns)
    text = validate.summary_text(summary)
    if summary.get("added_stages"):  # emulated devices: where pdlab's own overhead goes
        text += ("\npdlab's own overhead by stage (added_latency_stages.csv; measured - "
                 "modelled medians):\n" + summary["added_stages"])
    print("\n" + errors.to_string(index=False, float_format="{:.3g}".format) + "\n\n" + text)
    return ["## Validation against real runs", "", text, "", markdown_table(errors), "",
            "![measured vs simulated](measured/slo_attainment.png)", ""]
