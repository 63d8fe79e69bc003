"""``pdlab serve``: one placement deployed on the device set, behind the OpenAI-compatible HTTP
server (``server.app``) until interrupted. ``--local`` runs the workers in this process and needs
the in-process transport (a Ray transport cannot cross threads of one process)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from engine.config import (ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig,
                           TransferConfig, add_dataclass_args, dataclass_from_args, is_emulated,
                           parse_devices)
from engine.model import load_geometry, load_tokenizer, smollm2_tokenizer
from experiments.options import (add_deployment_args, add_engine_args, add_model_args,
                                 add_transfer_args, check_model, check_placements, engine_config, option_error,
                                 placement_list)
from deployment.placement import Deployment, emulation_for
from experiments.results import emulation_row
from server.app import OpenAIServer, serve_forever, text_of
from server.config import ServeConfig
from server.emulated_text import EmulatedText
from server.text import HFText, Text

HELP = "an OpenAI-compatible HTTP server over one placement"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab serve``."""
    parser.add_argument("--placement", type=placement_list, default=["disagg:1p1d"],
                        help="one placement: colocated:N, disagg:xPyD or conditional:xPyD "
                             "(default: disagg:1p1d)")
    add_deployment_args(parser)
    add_model_args(parser)
    add_dataclass_args(parser.add_argument_group("HTTP server"), ServeConfig)
    add_engine_args(parser)
    add_transfer_args(parser)


@dataclass(frozen=True)
class Serving:
    """Everything ``pdlab serve`` needs, checked (``check``)."""

    placement: str
    devices: tuple[str, ...]
    model: ModelConfig
    engine: EngineConfig
    transfer: TransferConfig
    conditional: ConditionalConfig
    server: ServeConfig


def check(args: argparse.Namespace) -> Serving:
    """Every ``serve`` option; nothing is started and no weights are read.

    Raises:
        ValueError: the first bad option."""
    if len(args.placement) != 1:
        raise option_error("--placement", f"serve takes one placement, got {len(args.placement)}")
    placement = args.placement[0]
    devices = args.devices or parse_devices(None)
    check_placements([placement], devices, args.address, "--placement")
    model = ModelConfig(args.model, args.dtype)
    check_model(model)
    engine = engine_config(args, model)
    if engine.emu_time_scale != 1:  # a client would see every latency x S
        raise option_error("--emu-time-scale", "dilates a replay (run, compare, plan "
                           "--validate, map --validate-on emu), not a server's clients")
    emulation = emulation_for(devices, model, engine)  # ValueError names the option
    if emulation is not None:  # the emulated GPU keeps the profile's KV dtype
        model = ModelConfig(args.model, emulation.device.dtype)
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


def serving_text(model: ModelConfig, devices: tuple[str, ...]) -> Text:
    """The model's tokenizer; without one ``EmulatedText`` on emulated devices, else
    ``ByteText`` (tiny models). ModelLoadError: a tokenizer that cannot be read."""
    tokenizer = load_tokenizer(model)
    if tokenizer is None and is_emulated(devices):
        return EmulatedText(HFText(smollm2_tokenizer()), load_geometry(model).vocab_size)
    return text_of(tokenizer)


def build(args: argparse.Namespace, x: Serving) -> tuple[Deployment, OpenAIServer]:
    """The deployment and its HTTP app, not serving yet (``run`` serves them; tests serve
    them on a ``ServerThread``). The caller closes the deployment."""
    text = serving_text(x.model, x.devices)
    name = x.server.served_model_name or x.model.model
    dep = Deployment(PlacementConfig(x.placement, ",".join(x.devices), args.address), x.model,
                     x.engine, x.transfer, local=x.server.local, policy=args.policy,
                     conditional=x.conditional, max_worker_restarts=args.max_worker_restarts)
    try:
        return dep, OpenAIServer(dep.router, text, name, x.server.max_body_bytes,
                                 emulation_row(x.engine))
    except BaseException:
        dep.close()
        raise


def run(args: argparse.Namespace, x: Serving) -> int:
    """Start the placement, then serve until interrupted."""
    dep, server = build(args, x)
    with dep:
        print(f"pdlab serve: {x.placement} on {','.join(x.devices)}, model {server.model_name}, "
              f"http://{x.server.host}:{x.server.port}/v1 (tokenizer: {server.text.name}; a "
              f"worker that dies restarts up to {args.max_worker_restarts} times)", flush=True)
        serve_forever(server, x.server.host, x.server.port)
    return 0
