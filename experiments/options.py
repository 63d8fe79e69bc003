"""Command-line option helpers every ``pdlab`` command shares: the parser class, argparse types,
the option groups several commands take (model, engine, SLO), and the checks that join options to
the machine and the model's config file before anything starts (no Ray, no weights).

A bad value exits 2 with one line naming the option and what it allows; a check that needs more than
one option raises ``option_error`` (``argument --x: ...``), which ``experiments.cli`` prints too."""

from __future__ import annotations

import argparse
import glob
import math
import re
from pathlib import Path

from engine.config import (DTYPES, TRANSPORTS, ConditionalConfig, EngineConfig, ModelConfig,
                           PlacementConfig, TransferConfig, add_dataclass_args,
                           dataclass_from_args, parse_devices)
from engine.placement import Placement
from engine.model import ModelLoadError, check_model_name, model_context_len
from deployment.placement import check_devices_exist, worker_layout
from planner.latency import LINKS, DeviceProfile, TransferModel, link_transfer
from planner.sizes import ProfileSet, geometry_of
from router.policy import POLICIES

# The default CPU run: small enough for `make run` on 2 cores in under 5 minutes.
# max_num_seqs is vLLM's 256: the KV budget (--kv-cache-memory-gb), not slots, bounds memory.
CPU_ENGINE_DEFAULTS = {"max_num_seqs": 256, "max_model_len": 2048, "max_num_batched_tokens": 512}
MODEL_HELP = ("smollm2-135m, tiny-random-llama (or tiny-random-<family>: llama3, mistral, qwen2, "
              "qwen3, gemma2, gemma3, phi3), a local HF directory or a hub id")


def option_error(option: str, message: str) -> ValueError:
    """A ValueError that ``experiments.cli`` reports as ``argument <option>: <message>``."""
    return ValueError(f"argument {option}: {message}")


def _type_error(fn):
    """Turn a parser's ValueError into argparse's own error (``argument --x: <message>``)."""
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = fn.__name__
    return parse


def positive_seconds(text: str) -> float:
    """A number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def rate_list(text: str) -> list[float]:
    """Comma-separated arrival rates, each > 0 req/s."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0 req/s, got {text!r}")
    return values


def placement_list(text: str) -> list[str]:
    """Comma-separated placements (``engine.placement.Placement``), each once."""
    items = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must name at least one placement, got {text!r}")
    for p in items:
        _type_error(Placement.parse)(p)
    repeated = sorted({p for p in items if items.count(p) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"each placement may appear once, {', '.join(repeated)} "
                                         f"repeats in {text!r}")
    return items


device_set = _type_error(parse_devices)  # cuda:0,cuda:1 or cpu:0,cpu:1 (a core group cpu:0-3)


@_type_error
def existing_device_set(text: str) -> tuple[str, ...]:
    """A device set whose devices exist on this machine (``placement.check_devices_exist``)."""
    devices = parse_devices(text)
    check_devices_exist(devices)
    return devices


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"must be comma-separated positive integers (e.g. 16,64,256), got {text!r}")
    return values


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def device_arg(text: str) -> str:
    """One device a measuring command runs on: ``cpu`` or ``cuda:i``."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"must be 'cpu' or 'cuda:i' (e.g. cuda:0), got {text!r}")
    return text


def measure_device_arg(text: str) -> str:
    """The device ``pdlab kv-cost`` measures on: ``cpu``, ``cuda:i`` or one emulated device
    ``emu:i`` (``engine.emulated``; it needs ``--device-profile``)."""
    if re.fullmatch(r"emu:\d+", text) is not None:
        return text
    try:
        return device_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'cpu' or 'cuda:i' (e.g. cuda:0), or 'emu:i' (an emulated device, e.g. "
            f"emu:0), got {text!r}") from None


def transport_list(text: str) -> tuple[str, ...]:
    """Comma-separated distinct transport names (``engine.config.TRANSPORTS``)."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TRANSPORTS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of distinct transports from {', '.join(TRANSPORTS)}, "
            f"got {text!r}")
    return names


def add_slo_args(parser: argparse.ArgumentParser) -> None:
    """``--slo-ttft-s`` and ``--slo-tpot-s`` (seconds, > 0; defaults 2 and 0.1), the same in
    every command that judges SLO attainment (run/compare, bench, plan)."""
    parser.add_argument("--slo-ttft-s", type=positive_seconds, default=2.0,
                        help="TTFT SLO in seconds (> 0)")
    parser.add_argument("--slo-tpot-s", type=positive_seconds, default=0.1,
                        help="TPOT SLO in seconds (> 0)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype``."""
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The ``EngineConfig`` fields (per instance), with the CPU defaults."""
    engine = parser.add_argument_group("engine (per instance)")
    add_dataclass_args(engine, EngineConfig, skip=("device",))  # each worker binds its own
    # max_model_len None: the CPU default, capped by the model's context (see engine_config)
    engine.set_defaults(**{**CPU_ENGINE_DEFAULTS, "max_model_len": None})
    for action in engine._group_actions:
        if action.dest == "max_model_len":
            action.help = (f"tokens per request (>= 2, <= the model's context; default: "
                           f"{CPU_ENGINE_DEFAULTS['max_model_len']}, capped by that context)")


def add_transfer_args(parser: argparse.ArgumentParser, conditional: bool = True) -> None:
    """The ``TransferConfig`` fields (KV transfer) and, with ``conditional``, the
    ``ConditionalConfig`` fields (NVIDIA Dynamo's rule of ``conditional:xPyD``)."""
    add_dataclass_args(parser.add_argument_group("KV transfer"), TransferConfig)
    if conditional:
        add_dataclass_args(parser.add_argument_group("conditional:xPyD (NVIDIA Dynamo's rule)"),
                           ConditionalConfig)
DEFAULT_RESTARTS = 3  # --max-worker-restarts


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_deployment_args(parser: argparse.ArgumentParser) -> None:
    """``--devices``, ``--address``, ``--policy`` and ``--max-worker-restarts``: where the
    workers of ``run``, ``compare`` and ``serve`` go, and how the router picks among them."""
    parser.add_argument("--devices", default=None, type=device_set,
                        help="cuda:0,cuda:1,... or cpu:0,cpu:1 (default: all GPUs, else one per core)")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (auto, host:port or ray://host:port) instead "
                             "of starting one")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES,
                        help="router policy: prefill by queued prompt tokens, decode by resident "
                             "KV tokens (least_loaded); round_robin; or cache_aware (SGLang's: "
                             "in each pool the worker already sent the longest prefix of the "
                             "prompt, least_loaded once requests per worker differ by > 32 "
                             "and by > 1.0001x)")
    parser.add_argument("--max-worker-restarts", type=non_negative_int, default=DEFAULT_RESTARTS,
                        metavar="N",
                        help="restart a worker that dies up to N times; it rejoins its pool "
                             f"once its engine is ready (default {DEFAULT_RESTARTS}; 0: never)")


def check_model(model: ModelConfig) -> None:
    """The model exists (its config file, or a known built-in name); no weights are read."""
    try:
        check_model_name(model)
    except ModelLoadError as err:
        raise option_error("--model", str(err)) from None


def check_out(path: str | None) -> None:
    """``--out`` may be a new path or a directory, not an existing file."""
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise option_error("--out", f"must be a directory (or a new path), {path} is a file")


def check_placements(placements: list[str], devices: tuple[str, ...], address: str | None,
                     option: str) -> None:
    """Each placement fits the device set, whose devices exist here (joining a cluster with
    ``address``: the deployment checks its resources), and the address is well formed.

    Raises:
        ValueError: ``argument --devices/<option>/--address: ...``."""
    if address is None:
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
        PlacementConfig(placements[0], ",".join(devices), address)
    except ValueError as err:
        raise option_error("--address", str(err)) from None


def check_device(device: str) -> None:
    """A measuring command's ``cuda:i`` device must exist here (``cpu`` always does).

    Raises:
        ValueError: ``argument --device: ...`` naming what exists."""
    if device.startswith("cuda"):
        try:
            check_devices_exist((device if ":" in device else "cuda:0",))
        except ValueError as err:
            raise option_error("--device", f"{err} (use cpu)") from None


def context_limit(model: ModelConfig, max_model_len: int | None) -> int:
    """Tokens one request may use: ``max_model_len`` (unset: the CPU default, capped by the model's
    context), which must fit the model's context where its config file says it.

    Raises:
        ValueError: ``argument --max-model-len: ...``."""
    context = model_context_len(model)
    if max_model_len is None:
        return int(min(CPU_ENGINE_DEFAULTS["max_model_len"], context or math.inf))
    if max_model_len < 2:
        raise option_error("--max-model-len", f"must be >= 2, got {max_model_len}")
    if context is not None and max_model_len > context:
        raise option_error("--max-model-len", f"must be <= the context of model {model.model} "
                                              f"({context} tokens), got {max_model_len}")
    return max_model_len


def engine_config(args: argparse.Namespace, model: ModelConfig) -> EngineConfig:
    """``EngineConfig`` of the options, ``max_model_len`` from ``context_limit``."""
    wanted = context_limit(model, args.max_model_len)
    return dataclass_from_args(EngineConfig, argparse.Namespace(**{**vars(args),
                                                                   "max_model_len": wanted}))


def find_profile(model: ModelConfig, root: Path = Path("results")) -> Path | None:
    """The newest ``root/profile-*/device_profile.json`` measured on ``model`` (name and dtype)."""
    for path in sorted(glob.glob(str(root / "profile-*" / "device_profile.json")), reverse=True):
        try:
            prof = DeviceProfile.load(path)
        except ValueError:
            continue
        if (prof.model, prof.dtype) == (model.model, model.dtype):
            return Path(path)
    return None


def load_profile_for(path: str | Path, model: ModelConfig, option: str) -> DeviceProfile:
    """The device profile at ``path``, measured on ``model`` (name and dtype).

    Raises:
        ValueError: ``argument <option>: ...`` when it cannot be read or names another model."""
    try:
        profile = DeviceProfile.load(path)
    except ValueError as err:
        raise option_error(option, str(err)) from None
    if (profile.model, profile.dtype) != (model.model, model.dtype):
        raise option_error(option, f"{path} was measured on {profile.model} "
                                   f"({profile.dtype}), not {model.model} ({model.dtype})")
    return profile


def load_profiles_for(text: str, model: ModelConfig, option: str, num_devices: int,
                      engine: EngineConfig, max_pp: int, prune: bool = True
                      ) -> tuple[DeviceProfile, DeviceProfile | ProfileSet]:
    """``--profile`` / ``--device-profile``: one path, or comma-separated paths of one PP-1
    profile per TP size (``pdlab profile --from-silicon-db --tp T``). Returns the smallest
    offered size's profile (for rate ladders and headers) and what the simulator reads: that
    same profile when one TP-1 profile is given (one device per instance), else the
    ``planner.sizes.ProfileSet`` of every ``(tp, pp)`` that fits (PP up to ``max_pp``, weights
    and one ``max_model_len`` request's KV within ``gpu_memory_utilization``; ``prune=False``:
    dominated sizes kept, for the twin of a run that deploys them).

    Raises:
        ValueError: ``argument <option>: ...``: a file as ``load_profile_for`` refuses, or
            profiles that do not form a set, or no size that fits (naming each refusal)."""
    paths = [p.strip() for p in text.split(",") if p.strip()]
    profiles = [load_profile_for(p, model, option) for p in paths]
    if len(profiles) == 1 and profiles[0].size == (1, 1) and max_pp == 1:
        return profiles[0], profiles[0]
    try:
        geometry = geometry_of(profiles[0], model.model)
        found = ProfileSet.build(profiles, geometry, num_devices, engine.max_model_len,
                                 engine.gpu_memory_utilization, max_pp, prune=prune)
        return found.base, found
    except ValueError as err:
        raise option_error(option, str(err)) from None


def transfer_model_for(profile: DeviceProfile, transport: str, option: str) -> TransferModel:
    """The profile's transfer model of ``transport``; ValueError ``argument <option>: ...``."""
    try:
        return profile.transfer(transport)
    except ValueError as err:
        raise option_error(option, str(err)) from None


def what_if_transfer(profile: DeviceProfile, transport: str, latency_s: float | None,
                     bandwidth_gbps: float | None, needed: bool,
                     link: str | None = None) -> TransferModel | None:
    """The KV transfer model the planner uses (``pdlab plan``, ``pdlab map``): the profile's model
    of ``transport``, or of ``link`` (``planner.latency.LINKS``) where it has one, else the link's
    nominal one; ``latency_s`` (s) and ``bandwidth_gbps`` (GB/s) replace its fixed cost and rate
    ("what if"). None when nothing gives one and ``needed`` is False.

    Raises:
        ValueError: ``argument --transport: ...`` when a placement needs a model the profile
            lacks; ``argument --link: ...`` for an unknown link."""
    if link is not None:
        if link not in LINKS:
            raise option_error("--link", f"unknown link {link!r}: use one of {', '.join(LINKS)}")
        base = profile.transfers.get(link) or link_transfer(link)
    else:
        base = profile.transfers.get(transport)
    if latency_s is None and bandwidth_gbps is None:
        if base is None and needed:
            transfer_model_for(profile, transport, "--transport")
        return base
    base = base or TransferModel(0.0, math.inf)
    latency = base.latency_s if latency_s is None else latency_s
    bandwidth = base.bandwidth_bytes_s if bandwidth_gbps is None else bandwidth_gbps * 1e9
    return TransferModel(latency, bandwidth, base.put_share)
