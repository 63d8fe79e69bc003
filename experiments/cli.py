"""The ``pdlab`` command: ``run``, ``compare``, ``profile``, ``kv-cost``, ``interference``,
``plan`` (``experiments.commands.plan``).

Engine, transfer and workload options are derived from the config dataclasses' fields
(``engine.config.add_dataclass_args``), so every knob has one name, one default and one
rule. Every option is checked before anything starts (no Ray, no model weights): its type
and range by argparse and the dataclasses, then what joins options to the machine and the
model (devices exist, placements fit the device set and do not repeat, the model exists,
lengths fit its context, read from its config file). A bad value exits 2 with one line
naming the option and what it allows; an error while running exits 2 with one line that
keeps its root cause (``engine.errors.describe_error``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from engine.config import (DTYPES, ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig,
                           add_dataclass_args, dataclass_from_args, parse_devices, parse_placement)
from engine.errors import describe_error
from engine.metrics import SLO
from engine.model import TINY_NAMES, ModelLoadError, check_model_name, model_context_len
from experiments.commands import interference, kv_cost, profile
from server.config import BenchConfig, ServeConfig
from experiments.commands.compare import WorkloadSpec, default_placements, run_experiment
from experiments.placement import check_devices_exist, worker_layout
from experiments.commands import plan as plan_command
from experiments.report import format_table
from router.policy import POLICIES

OPTION_FIELDS = {f.name for cls in (WorkloadSpec, EngineConfig, TransferConfig, ConditionalConfig,
                                    interference.InterferenceConfig, ServeConfig, BenchConfig,
                                    plan_command.PlanConfig)
                 for f in dataclasses.fields(cls)}

# The default CPU run: small enough for `make run` on 2 cores in under 5 minutes.
# max_num_seqs is vLLM's 256: the KV budget (--kv-cache-memory-gb), not slots, bounds memory.
CPU_ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_model_len": 2048, "max_num_batched_tokens": 512}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``pdlab run: error: argument --x: ...``, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0 req/s, got {text!r}")
    return values


def _placements(text: str) -> list[str]:
    items = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must name at least one placement, got {text!r}")
    for p in items:
        try:
            parse_placement(p)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err))
    repeated = sorted({p for p in items if items.count(p) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"each placement may appear once, {', '.join(repeated)} "
                                         f"repeats in {text!r}")
    return items


def _devices(text: str) -> tuple[str, ...]:
    try:
        return parse_devices(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))


def _add_experiment_args(parser: argparse.ArgumentParser, compare: bool) -> None:
    if compare:
        parser.add_argument("--simulate", default=None, metavar="PROFILE.json",
                            help="also simulate every run with this device profile (pdlab "
                                 "profile) and report the simulator's error (validation.csv; "
                                 "the attainment plot overlays the simulated curve)")
        parser.add_argument("--placements", type=_placements, default=None,
                            help="comma-separated, e.g. colocated:2,colocated-nochunk:2,disagg:1p1d "
                                 "(colocated-nochunk = chunked prefill off; default: colocated:N "
                                 "and every disagg:xPyD with x+y=N)")
    else:
        parser.add_argument("--placement", type=_placements, default=["disagg:1p1d"],
                            help="colocated:N, colocated-nochunk:N, disagg:xPyD or "
                                 "conditional:xPyD (decode workers prefill short prompts) "
                                 "(default: disagg:1p1d)")
    parser.add_argument("--devices", default=None, type=_devices,
                        help="cuda:0,cuda:1,... or cpu:0,cpu:1 (default: all GPUs, else one per core)")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (auto, host:port or ray://host:port) instead "
                             "of starting one")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES,
                        help="router policy: prefill by queued prompt tokens, decode by resident "
                             "KV tokens (least_loaded), or round_robin")
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, tiny-random-llama (or tiny-random-<family>: llama3, mistral, qwen2, qwen3, gemma2, gemma3, phi3), a local HF directory or a hub id")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--rates", type=_floats, default=[0.5],
                        help="arrival rates in req/s, comma-separated (a sweep gives goodput)")
    add_slo_args(parser)
    parser.add_argument("--out", default=None, help="results directory (default: results/<cmd>-<time>)")
    workload = parser.add_argument_group("workload")
    add_dataclass_args(workload, WorkloadSpec)
    _add_engine_args(parser)
    transfer = parser.add_argument_group("KV transfer")
    add_dataclass_args(transfer, TransferConfig)
    add_dataclass_args(parser.add_argument_group("conditional:xPyD (NVIDIA Dynamo's rule)"),
                       ConditionalConfig)


def add_slo_args(parser: argparse.ArgumentParser) -> None:
    """``--slo-ttft-s`` and ``--slo-tpot-s`` (seconds, > 0; defaults 2 and 0.1), the same in
    every command that judges SLO attainment (run/compare, bench, plan)."""
    parser.add_argument("--slo-ttft-s", type=_positive_seconds, default=2.0,
                        help="TTFT SLO in seconds (> 0)")
    parser.add_argument("--slo-tpot-s", type=_positive_seconds, default=0.1,
                        help="TPOT SLO in seconds (> 0)")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="smollm2-135m, tiny-random-llama (or tiny-random-<family>: llama3, mistral, qwen2, qwen3, gemma2, gemma3, phi3), a local HF directory or a hub id")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine (per instance)")
    add_dataclass_args(engine, EngineConfig, skip=("device",))  # each worker binds its own
    # max_model_len None: the CPU default, capped by the model's context (see _engine_config)
    engine.set_defaults(**{**CPU_ENGINE_DEFAULTS, "max_model_len": None})
    for action in engine._group_actions:
        if action.dest == "max_model_len":
            action.help = (f"tokens per request (>= 2, <= the model's context; default: "
                           f"{CPU_ENGINE_DEFAULTS['max_model_len']}, capped by that context)")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placement", type=_placements, default=["disagg:1p1d"],
                        help="one placement: colocated:N, disagg:xPyD or conditional:xPyD "
                             "(default: disagg:1p1d)")
    parser.add_argument("--devices", default=None, type=_devices,
                        help="cuda:0,cuda:1,... or cpu:0,cpu:1 (default: all GPUs, else one per core)")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (auto, host:port or ray://host:port)")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES,
                        help="router policy (least_loaded or round_robin)")
    _add_model_args(parser)
    add_dataclass_args(parser.add_argument_group("HTTP server"), ServeConfig)
    _add_engine_args(parser)
    add_dataclass_args(parser.add_argument_group("KV transfer"), TransferConfig)
    add_dataclass_args(parser.add_argument_group("conditional:xPyD (NVIDIA Dynamo's rule)"),
                       ConditionalConfig)


def _add_bench_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser.add_argument_group("server"), BenchConfig)
    _add_model_args(parser)  # its tokenizer builds the prompts (the server's own model)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens a request may use, prompt + output (>= 2; default: "
                             f"{CPU_ENGINE_DEFAULTS['max_model_len']}, capped by the model's "
                             "context): longer outputs are clipped as in pdlab run")
    parser.add_argument("--rates", type=_floats, default=[0.5],
                        help="arrival rates in req/s, comma-separated")
    add_slo_args(parser)
    parser.add_argument("--out", default=None, help="results directory (default: results/bench-<time>)")
    add_dataclass_args(parser.add_argument_group("workload"), WorkloadSpec, skip=("calibrate",))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdlab", description=(
        "Placement experiments for disaggregated LLM serving: colocated vs disaggregated "
        "prefill/decode on the same devices, interference, KV-transfer cost."))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "one placement, one workload, one or more rates"),
                       ("compare", "several placements on the same device set")):
        command = sub.add_parser(name, help=text)
        _add_experiment_args(command, compare=name == "compare")
        command.set_defaults(command_parser=command)
    command = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over one placement")
    _add_serve_args(command)
    command.set_defaults(command_parser=command)
    command = sub.add_parser("bench", help="the workloads of run/compare against any "
                                           "OpenAI-compatible server (streaming HTTP)")
    _add_bench_args(command)
    command.set_defaults(command_parser=command)
    command = sub.add_parser("profile", help="prefill/decode phase profile of a model")
    profile.add_arguments(command)
    command.set_defaults(command_parser=command)
    command = sub.add_parser("kv-cost", help="KV transfer cost vs prefill cost")
    kv_cost.add_arguments(command)
    command.set_defaults(command_parser=command)
    command = sub.add_parser("interference", help="decode stall caused by a prefill, per mode")
    interference.add_arguments(command)
    command.set_defaults(command_parser=command)
    command = sub.add_parser("plan", help="rank placements of N devices on the simulator "
                                          "(--validate: and check it against real runs)")
    plan_command.add_arguments(command)
    command.set_defaults(command_parser=command)
    return parser


def option_error(option: str, message: str) -> ValueError:
    """A ValueError that ``main`` reports as ``argument <option>: <message>``."""
    return ValueError(f"argument {option}: {message}")


def _option_message(err: ValueError) -> str:
    """The message, naming the option when it starts with a config field's name."""
    message = str(err)
    field = message.split(" ", 1)[0]
    if field in OPTION_FIELDS:
        message = f"argument --{field.replace('_', '-')}: {message}"
    return message


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Everything ``run_experiment`` needs, checked (``check_experiment``)."""

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


def _engine_config(args: argparse.Namespace, model: ModelConfig) -> EngineConfig:
    """EngineConfig of the options; ``--max-model-len`` must fit the model's context where
    its config file says it (unset: the CPU default, capped by that context, so the results
    record the length the engine really uses)."""
    context = model_context_len(model)
    wanted = args.max_model_len
    if wanted is None:
        wanted = min(CPU_ENGINE_DEFAULTS["max_model_len"], context or math.inf)
    elif context is not None and wanted > context:
        raise option_error("--max-model-len", f"must be <= the context of model {model.model} "
                                              f"({context} tokens), got {wanted}")
    return dataclass_from_args(EngineConfig, argparse.Namespace(**{**vars(args),
                                                                   "max_model_len": wanted}))


def check_out(path: str | None) -> None:
    """``--out`` may be a new path or a directory, not an existing file."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise option_error("--out", f"must be a directory (or a new path), {path} is a file")


def check_model(model: ModelConfig) -> None:
    try:
        check_model_name(model)
    except ModelLoadError as err:
        raise option_error("--model", str(err)) from None


def check_experiment(args: argparse.Namespace) -> Experiment:
    """Every ``run``/``compare`` option, joined to the device set and the model's config
    file; nothing is started and no weights are read.

    Raises:
        ValueError: the first bad option (``argument --x: ...`` or ``<field> must ...``).
    """
    option = "--placement" if args.command == "run" else "--placements"
    devices = args.devices or parse_devices(None)
    placements = (args.placement if args.command == "run" else
                  args.placements or default_placements(len(devices)))
    if args.address is None:  # joining a cluster: Deployment checks its resources
        try:
            check_devices_exist(devices)
        except ValueError as err:
            raise option_error("--devices", str(err)) from None
    for placement in placements:
        try:
            worker_layout(placement, devices)
        except ValueError as err:
            raise option_error(option, str(err)) from None
    try:
        PlacementConfig(placements[0], ",".join(devices), args.address)
    except ValueError as err:
        raise option_error("--address", str(err)) from None
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    spec = dataclass_from_args(WorkloadSpec, args)
    engine = _engine_config(args, model)
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
        simulate = plan_command.load_profile_for(args.simulate, model, "--simulate")
        if any(parse_placement(p)[0] != "colocated" for p in placements):
            plan_command.transfer_model_for(simulate, transfer.transport, "--simulate")
    out = Path(args.out or f"results/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Experiment(placements, devices, spec, model, engine, transfer,
                      SLO(args.slo_ttft_s, args.slo_tpot_s), out, conditional, simulate)


def _run_experiment(args: argparse.Namespace, x: Experiment) -> int:
    print(f"pdlab {args.command}: {', '.join(x.placements)} on {','.join(x.devices)}, model "
          f"{x.model.model}, {x.spec.dataset} x {x.spec.num_requests}, rates "
          + ("from the calibration below" if x.spec.calibrate else f"{args.rates} req/s")
          + f", max_model_len {x.engine.max_model_len}")
    if model_context_len(x.model) is None:
        print(f"note: the context of model {x.model.model} is known only once it loads; each "
              "engine caps max_model_len at it (the config row records the value asked for)")
    summary, verdict = run_experiment(x.placements, args.rates, x.spec, x.model, x.engine,
                                      x.transfer, ",".join(x.devices), args.address, x.slo,
                                      x.out, args.policy, conditional=x.conditional,
                                      simulate=x.simulate)
    _print_outcome(summary, verdict, x.out, "requests.jsonl, summary.csv, steps.csv, "
                   "transfers.csv, report.md, *.png")
    return 0


def _print_outcome(summary, verdict: str, out: Path, files: str) -> None:
    """The side-by-side table, the verdict, a warning naming failed requests, and where
    the results went (``run``/``compare`` and ``bench`` alike)."""
    print()
    print(format_table(summary))
    print()
    print(verdict)
    failed = int(summary["num_failed"].sum())
    if failed:
        print(f"\nWarning: {failed} request(s) failed; their errors are in requests.jsonl "
              "(column 'error').", file=sys.stderr)
    print(f"\nResults: {out}/ ({files})")


@dataclasses.dataclass(frozen=True)
class Serving:
    """Everything ``pdlab serve`` needs, checked (``check_serve``)."""

    placement: str
    devices: tuple[str, ...]
    model: ModelConfig
    engine: EngineConfig
    transfer: TransferConfig
    conditional: ConditionalConfig
    server: ServeConfig


def check_serve(args: argparse.Namespace) -> Serving:
    """Every ``serve`` option; nothing is started and no weights are read.

    Raises:
        ValueError: the first bad option.
    """
    if len(args.placement) != 1:
        raise option_error("--placement", f"serve takes one placement, got {len(args.placement)}")
    placement = args.placement[0]
    devices = args.devices or parse_devices(None)
    if args.address is None:
        try:
            check_devices_exist(devices)
        except ValueError as err:
            raise option_error("--devices", str(err)) from None
    try:
        worker_layout(placement, devices)
    except ValueError as err:
        raise option_error("--placement", str(err)) from None
    try:
        PlacementConfig(placement, ",".join(devices), args.address)
    except ValueError as err:
        raise option_error("--address", str(err)) from None
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    engine = _engine_config(args, model)
    server = dataclass_from_args(ServeConfig, args)
    transfer = dataclass_from_args(TransferConfig, args)
    if server.local:
        if args.address is not None:
            raise option_error("--local", "runs the workers in this process: drop --address")
        if transfer.transport not in ("ray", "inprocess"):  # ray: the default, replaced
            raise option_error("--local", f"needs --transport inprocess, got {transfer.transport}")
        transfer = dataclasses.replace(transfer, transport="inprocess")
    elif transfer.transport == "inprocess":
        raise option_error("--transport", "inprocess needs --local (workers in one process)")
    return Serving(placement, devices, model, engine, transfer,
                   dataclass_from_args(ConditionalConfig, args), server)


def _serve(x: Serving, policy: str, address: str | None) -> int:
    """Start the placement, then serve until interrupted."""
    from engine.model import load_tokenizer
    from experiments.placement import Deployment
    from server.app import OpenAIServer, serve_forever, text_of

    text = text_of(load_tokenizer(x.model))
    name = x.server.served_model_name or x.model.model
    with Deployment(PlacementConfig(x.placement, ",".join(x.devices), address), x.model,
                    x.engine, x.transfer, local=x.server.local, policy=policy,
                    conditional=x.conditional) as dep:
        server = OpenAIServer(dep.router, text, name, x.server.max_body_bytes)
        print(f"pdlab serve: {x.placement} on {','.join(x.devices)}, model {name}, "
              f"http://{x.server.host}:{x.server.port}/v1 (tokenizer: {text.name})", flush=True)
        serve_forever(server, x.server.host, x.server.port)
    return 0


@dataclasses.dataclass(frozen=True)
class Benching:
    """Everything ``pdlab bench`` needs, checked (``check_bench``)."""

    config: BenchConfig
    spec: WorkloadSpec
    model: ModelConfig
    max_len: int
    slo: SLO
    out: Path


def check_bench(args: argparse.Namespace) -> Benching:
    """Every ``bench`` option; the server is not contacted and no tokenizer is loaded.

    Raises:
        ValueError: the first bad option.
    """
    config = dataclass_from_args(BenchConfig, args)
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    spec = dataclass_from_args(WorkloadSpec, args)
    if spec.dataset != "synthetic" and model.model in TINY_NAMES:
        raise option_error("--dataset", f"{spec.dataset} needs a tokenizer; model {model.model} "
                                        "has none: use --dataset synthetic")
    context = model_context_len(model)
    max_len = args.max_model_len
    if max_len is None:
        max_len = min(CPU_ENGINE_DEFAULTS["max_model_len"], context or math.inf)
    elif max_len < 2:
        raise option_error("--max-model-len", f"must be >= 2, got {max_len}")
    elif context is not None and max_len > context:
        raise option_error("--max-model-len", f"must be <= the context of model {model.model} "
                                              f"({context} tokens), got {max_len}")
    longest = spec.max_request_len()
    if spec.dataset == "synthetic" and longest is not None and longest > max_len:
        raise option_error("--prompt-len", f"--prompt-len and --output-len allow requests of "
                                           f"{longest} tokens, more than --max-model-len {max_len}")
    check_out(args.out)
    out = Path(args.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    return Benching(config, spec, model, int(max_len), SLO(args.slo_ttft_s, args.slo_tpot_s), out)


def _bench(args: argparse.Namespace, x: Benching) -> int:
    from experiments.commands.bench import bench

    print(f"pdlab bench: {x.config.label} at {x.config.base_url}, {x.spec.dataset} x "
          f"{x.spec.num_requests}, rates {args.rates} req/s, seeds {x.spec.seed_list}")
    summary, verdict = bench(x.config, x.spec, x.model, x.max_len, args.rates, x.slo, x.out)
    _print_outcome(summary, verdict, x.out, "requests.jsonl, summary.csv, report.md, *.png")
    return 0


def check_options(args: argparse.Namespace):
    """Check ``args`` of any command before it starts anything; returns the checked
    experiment of ``run``/``compare``, ``Serving`` of ``serve``, ``Benching`` of ``bench``,
    ``PlanJob`` of ``plan`` (ValueError: the first bad option)."""
    if args.command in ("run", "compare"):
        return check_experiment(args)
    if args.command == "serve":
        return check_serve(args)
    if args.command == "bench":
        return check_bench(args)
    if args.command == "plan":
        return plan_command.check_arguments(args)
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    check_out(args.out)
    commands = {"profile": profile, "kv-cost": kv_cost, "interference": interference}
    commands[args.command].check_arguments(args, model)
    return None


def main(argv: list[str] | None = None) -> int:
    """Parse and check every option (exit 2 naming the first bad one), then run the command.

    Returns:
        0 on success; 2 when the command failed (one line on stderr with the root cause).
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        experiment = check_options(args)
    except ValueError as err:
        args.command_parser.error(_option_message(err))
    try:
        if args.command == "plan":
            return plan_command.main(args, experiment)
        if isinstance(experiment, Serving):
            return _serve(experiment, args.policy, args.address)
        if isinstance(experiment, Benching):
            return _bench(args, experiment)
        if experiment is not None:
            return _run_experiment(args, experiment)
        commands = {"profile": profile, "kv-cost": kv_cost, "interference": interference}
        return commands[args.command].main(args)
    except (ValueError, ModelLoadError, RuntimeError, OSError) as err:
        print(f"pdlab {args.command}: error: {describe_error(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
