"""The ``pdlab`` command: ``run``, ``compare``, ``profile``, ``kv-cost``.

Engine, transfer and workload options are derived from the config dataclasses' fields
(``engine.config.add_dataclass_args``), so every knob has one name and one default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from engine.config import (DTYPES, EngineConfig, ModelConfig, TransferConfig, add_dataclass_args,
                           dataclass_from_args, parse_devices, parse_placement)
from engine.metrics import SLO
from engine.model import ModelLoadError
from experiments import kv_cost, profile
from experiments.compare import WorkloadSpec, default_placements, run_experiment
from experiments.report import format_table
from router.policy import POLICIES

OPTION_FIELDS = {f.name for cls in (WorkloadSpec, EngineConfig, TransferConfig)
                 for f in dataclasses.fields(cls)}

# The default CPU run: small enough for `make run` on 2 cores in under 5 minutes.
CPU_ENGINE_DEFAULTS = {"max_num_seqs": 16, "max_model_len": 2048, "max_num_batched_tokens": 512}


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0 req/s, got {text!r}")
    return values


def _placements(text: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    for p in items:
        try:
            parse_placement(p)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err))
    return items


def _add_experiment_args(parser: argparse.ArgumentParser, compare: bool) -> None:
    if compare:
        parser.add_argument("--placements", type=_placements, default=None,
                            help="comma-separated, e.g. colocated:2,colocated-nochunk:2,disagg:1p1d "
                                 "(colocated-nochunk = chunked prefill off; default: colocated:N "
                                 "and every disagg:xPyD with x+y=N)")
    else:
        parser.add_argument("--placement", type=_placements, default=["disagg:1p1d"],
                            help="colocated:N, colocated-nochunk:N or disagg:xPyD "
                                 "(default: disagg:1p1d)")
    parser.add_argument("--devices", default=None,
                        help="cuda:0,cuda:1,... or cpu:0,cpu:1 (default: all GPUs, else one per core)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES,
                        help="router policy: prefill by queued prompt tokens, decode by resident "
                             "KV tokens (least_loaded), or round_robin")
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, tiny-random-llama, a local HF directory or a hub id")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--rates", type=_floats, default=[0.5],
                        help="arrival rates in req/s, comma-separated (a sweep gives goodput)")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT SLO in seconds")
    parser.add_argument("--slo-tpot-s", type=float, default=0.1, help="TPOT SLO in seconds")
    parser.add_argument("--out", default=None, help="results directory (default: results/<cmd>-<time>)")
    workload = parser.add_argument_group("workload")
    add_dataclass_args(workload, WorkloadSpec)
    engine = parser.add_argument_group("engine (per instance)")
    add_dataclass_args(engine, EngineConfig, skip=("device",))  # each worker binds its own
    engine.set_defaults(**CPU_ENGINE_DEFAULTS)
    transfer = parser.add_argument_group("KV transfer")
    add_dataclass_args(transfer, TransferConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdlab", description=(
        "Placement experiments for disaggregated LLM serving: colocated vs disaggregated "
        "prefill/decode on the same devices, interference, KV-transfer cost."))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "one placement, one workload, one or more rates"),
                       ("compare", "several placements on the same device set")):
        command = sub.add_parser(name, help=text)
        _add_experiment_args(command, compare=name == "compare")
        command.set_defaults(command_parser=command)
    profile.add_arguments(sub.add_parser("profile", help="prefill/decode phase profile of a model"))
    kv_cost.add_arguments(sub.add_parser("kv-cost", help="KV transfer cost vs prefill cost"))
    return parser


def _option_error(parser: argparse.ArgumentParser, err: ValueError) -> None:
    """Exit with the message, naming the option when it starts with a field name."""
    message = str(err)
    field = message.split(" ", 1)[0]
    if field in OPTION_FIELDS:
        message = f"argument --{field.replace('_', '-')}: {message}"
    parser.error(message)


def _run_experiment(args: argparse.Namespace) -> int:
    parser = args.command_parser
    try:
        devices = parse_devices(args.devices)
        placements = (args.placement if args.command == "run" else
                      args.placements or default_placements(len(devices)))
        spec = dataclass_from_args(WorkloadSpec, args)
        engine = dataclass_from_args(EngineConfig, args)
        transfer = dataclass_from_args(TransferConfig, args)
        model = ModelConfig(args.model, args.dtype)
        slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
    except ValueError as err:
        _option_error(parser, err)
    out = Path(args.out or f"results/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"pdlab {args.command}: {', '.join(placements)} on {','.join(devices)}, model "
          f"{model.model}, {spec.dataset} x {spec.num_requests}, rates {args.rates} req/s")
    try:
        summary, verdict = run_experiment(placements, args.rates, spec, model, engine, transfer,
                                          ",".join(devices), args.address, slo, out,
                                          args.policy)
    except (ValueError, ModelLoadError, RuntimeError) as err:
        print(f"pdlab: error: {err}", file=sys.stderr)
        return 2
    print()
    print(format_table(summary))
    print()
    print(verdict)
    failed = int(summary["num_failed"].sum())
    if failed:
        print(f"\nWarning: {failed} request(s) failed; their errors are in requests.jsonl "
              "(column 'error').", file=sys.stderr)
    print(f"\nResults: {out}/ (requests.jsonl, summary.csv, steps.csv, transfers.csv, "
          "report.md, *.png)")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("run", "compare"):
        return _run_experiment(args)
    if args.command == "profile":
        return profile.main(args)
    return kv_cost.main(args)


if __name__ == "__main__":
    sys.exit(main())
