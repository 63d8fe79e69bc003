"""``pdlab run`` and ``pdlab compare``: placements x arrival rates on one workload.

1. Build one workload per seed (``seed``, ``seed + 1``, ...) with the model's tokenizer, and
   check that every request fits the model's context before anything starts. The same requests
   and arrival seeds go to every placement.
2. Per placement, ``experiments.replay.run_placement``: deploy once, replay at each rate and seed.
3. Derive the metrics (``experiments.analysis``), print the side-by-side table and write the
   results directory (``experiments.results``)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, TransferConfig,
                           add_dataclass_args, dataclass_from_args, parse_devices)
from engine.metrics import SLO
from engine.model import model_context_len
from engine.placement import Placement
from experiments import dilation, report, validate, workload_map
from experiments.options import (add_deployment_args, add_engine_args, add_model_args, add_slo_args,
                                 add_transfer_args, check_model, check_out, check_placements,
                                 engine_config,
                                 load_profile_for, load_profiles_for, option_error, placement_list, rate_list,
                                 transfer_model_for)
from deployment.placement import emulation_for, worker_layout
from experiments.replay import RunResult, calibrated_slo, default_placements, run_placement
from experiments.results import experiment_config, print_outcome, write_results
from experiments.workload_spec import Timed, WorkloadSpec, build_workload, context_len, trace_rate

HELP = "several placements on the same device set (run: one placement)"


def run_experiment(placements: list[str], rates: list[float], spec: WorkloadSpec,
                   model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                   devices: str | None, address: str | None, slo: SLO, out_dir: Path,
                   policy: str = "least_loaded", local: bool = False,
                   conditional: ConditionalConfig | None = None,
                   simulate=None, max_worker_restarts: int = 0) -> tuple[pd.DataFrame, str]:
    """Steps 1-3 of the module docstring; returns (summary table, verdict text).

    ``simulate``: a ``DeviceProfile``; the same runs are simulated too and validation.csv holds
    the per-point errors (``experiments.validate``). The planner's small SLO map of this workload
    (``experiments.workload_map``) goes into the report and verdict. With ``spec.calibrate`` the
    rates and SLO are calibrated on the first placement. A ``mooncake`` trace runs once per
    placement and seed at its own timestamps, labelled with its mean rate.

    Raises:
        ValueError: a bad placement, device set or workload option, or a workload that does not
            fit the model (before anything runs)."""
    device_set = parse_devices(devices)
    for placement in placements:  # fail fast, before any model loads
        worker_layout(placement, device_set)
    max_len = context_len(model, engine)
    items = {seed: build_workload(spec, model, seed, max_len) for seed in spec.seed_list}
    results: list[RunResult] = []
    worker_info: list[dict] = []
    calibration: dict = {}
    sweep: list[float] | None = None if spec.calibrate else list(rates)
    if isinstance(items[spec.seed], Timed):  # a trace keeps its own times: one run per seed,
        # labelled with its mean rate (``--rates`` and calibration do not apply)
        sweep = [float(f"{min(trace_rate(its) for its in items.values()):.4g}")]
        print(f"pdlab: the mooncake trace is replayed at its own timestamps (mean {sweep[0]:g} "
              "req/s): one run per placement and seed, labelled with that rate", file=sys.stderr)
    for placement in placements:
        results += run_placement(placement, sweep, items, spec, model, engine, transfer,
                                 ",".join(device_set), address, policy, worker_info, local,
                                 calibration, conditional, max_worker_restarts)
        sweep = sorted({r.rate for r in results})  # calibrated once, on the first placement
    if calibration:
        given, slo = slo, calibrated_slo(slo, calibration["lone_ttft_s"], calibration["lone_tpot_s"])
        calibration["slo_given"] = dataclasses.asdict(given)
        if slo != given:
            print(f"pdlab: a lone request takes TTFT {calibration['lone_ttft_s']:.3g} s, TPOT "
                  f"{calibration['lone_tpot_s'] or math.nan:.3g} s here: judging by SLO TTFT <= "
                  f"{slo.ttft_s:.3g} s, TPOT <= {slo.tpot_s:.3g} s instead of {given.ttft_s:g} s, "
                  f"{given.tpot_s:g} s", file=sys.stderr)
    config = experiment_config(model, device_set, placements, sweep, calibration, spec, engine,
                               transfer, slo, policy, conditional, worker_info)
    if simulate is None and engine.device_profile is not None:  # emulated devices: the twin
        simulate = load_profiles_for(  # (each instance's profile) gives added_latency.csv
            engine.device_profile, model, "--device-profile", len(device_set), engine,
            max(i.pp for p in placements for i in Placement.parse(p).instances),
            prune=False)[1]
    if simulate is None:
        summary, verdict = write_results(out_dir, results, config, slo)
    else:
        summary, verdict = validate.write_with_twin(out_dir, results, config, slo, items, spec,
                                                    engine, transfer.transport, simulate, policy)
    lines, png = workload_map.report_map(out_dir, results, items, spec, model, engine,
                                         transfer.transport, len(device_set), slo, policy,
                                         simulate)
    report.append_section(out_dir, workload_map.TITLE, lines, png)
    return summary, verdict + "\n" + "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, single: bool = False) -> None:
    """Options of ``pdlab compare`` (``single``: of ``pdlab run``, one ``--placement``)."""
    if single:
        parser.add_argument("--placement", type=placement_list, default=["disagg:1p1d"],
                            help="colocated:N, colocated-nochunk:N, disagg:xPyD or "
                                 "conditional:xPyD (decode workers prefill short prompts) "
                                 "(default: disagg:1p1d)")
    else:
        parser.add_argument("--simulate", default=None, metavar="PROFILE.json",
                            help="also simulate every run with this device profile (pdlab "
                                 "profile) and report the simulator's error (validation.csv; "
                                 "the attainment plot overlays the simulated curve)")
        parser.add_argument("--placements", type=placement_list, default=None,
                            help="comma-separated, e.g. colocated:2,colocated-nochunk:2,disagg:1p1d "
                                 "(colocated-nochunk = chunked prefill off; default: colocated:N "
                                 "and every disagg:xPyD with x+y=N)")
    add_deployment_args(parser)
    add_model_args(parser)
    parser.add_argument("--rates", type=rate_list, default=[0.5],
                        help="arrival rates in req/s, comma-separated (a sweep gives "
                             "goodput; default: 0.5)")
    add_slo_args(parser)
    parser.add_argument("--out", default=None, help="results directory (default: results/<cmd>-<time>)")
    add_dataclass_args(parser.add_argument_group("workload"), WorkloadSpec)
    add_engine_args(parser)
    add_transfer_args(parser)


@dataclass(frozen=True)
class Experiment:
    """Everything ``run_experiment`` needs, checked (``check``)."""

    placements: list[str]
    devices: tuple[str, ...]
    spec: WorkloadSpec
    model: ModelConfig
    engine: EngineConfig
    transfer: TransferConfig
    slo: SLO
    out: Path
    conditional: ConditionalConfig = ConditionalConfig()
    simulate: object = None  # planner.latency.DeviceProfile for --simulate


def check(args: argparse.Namespace) -> Experiment:
    """Every ``run``/``compare`` option, joined to the device set and the model's config file;
    nothing is started and no weights are read.

    Raises:
        ValueError: the first bad option (``argument --x: ...`` or ``<field> must ...``)."""
    single = args.command == "run"
    devices = args.devices or parse_devices(None)
    placements = args.placement if single else args.placements or default_placements(len(devices))
    check_placements(placements, devices, args.address, "--placement" if single else "--placements")
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    spec = dataclass_from_args(WorkloadSpec, args)
    engine = engine_config(args, model)
    emulation = emulation_for(devices, model, engine)  # ValueError names the option
    dilation.check_dataset(spec.dataset, engine.emu_time_scale)
    if emulation is not None:  # the emulated GPU keeps the profile's KV dtype
        model = ModelConfig(args.model, emulation.device.dtype)
    longest = spec.max_request_len()
    if longest is not None and longest > engine.max_model_len:
        lengths = ("--prompt-len and --output-len" if spec.dataset == "synthetic"
                   else "--max-prompt-len and --max-output-len")
        raise option_error(lengths.split(" and ")[0], (
            f"{lengths} allow requests of {longest} tokens, more than --max-model-len "
            f"{engine.max_model_len} (those requests would fail): lower them or raise it"))
    capacity = engine.kv_capacity_tokens
    if longest is not None and capacity is not None and capacity < longest:
        raise option_error("--kv-capacity-tokens", (
            f"must hold the workload's longest request ({longest} tokens), got {capacity} "
            "(longer requests would fail)"))
    transfer = dataclass_from_args(TransferConfig, args)
    conditional = dataclass_from_args(ConditionalConfig, args)
    check_out(args.out)
    simulate = None
    if getattr(args, "simulate", None):
        simulate = load_profile_for(args.simulate, model, "--simulate")
        if any(Placement.parse(p).needs_transfer for p in placements):
            transfer_model_for(simulate, transfer.transport, "--simulate")
    out = Path(args.out or f"results/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Experiment(placements, devices, spec, model, engine, transfer,
                      SLO(args.slo_ttft_s, args.slo_tpot_s), out, conditional, simulate)


def run(args: argparse.Namespace, x: Experiment) -> int:
    """Run the experiment (module docstring), print the table and the verdict."""
    print(f"pdlab {args.command}: {', '.join(x.placements)} on {','.join(x.devices)}, model "
          f"{x.model.model}, {x.spec.dataset} x {x.spec.num_requests}, rates "
          + ("from the calibration below" if x.spec.calibrate else f"{args.rates} {x.spec.rate_unit}")
          + f", max_model_len {x.engine.max_model_len}")
    if model_context_len(x.model) is None:
        print(f"note: the context of model {x.model.model} is known only once it loads; each "
              "engine caps max_model_len at it (the config row records the value asked for)")
    summary, verdict = run_experiment(x.placements, args.rates, x.spec, x.model, x.engine,
                                      x.transfer, ",".join(x.devices), args.address, x.slo,
                                      x.out, args.policy, conditional=x.conditional,
                                      simulate=x.simulate,
                                      max_worker_restarts=args.max_worker_restarts)
    print_outcome(summary, verdict, x.out, "requests.jsonl, summary.csv, steps.csv, "
                   "transfers.csv, report.md, *.png")
    return 0
