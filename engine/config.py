"""Frozen, validated configuration dataclasses (no torch).

Every field has a default and a rule in its metadata (``min``, ``gt``, ``choices`` or
``pattern`` with a ``hint``; a bool needs none), checked by ``check_fields`` in
``__post_init__``, then the rules joining fields: a bad value raises ``ValueError`` naming the
field and what is allowed. ``add_dataclass_args`` derives the CLI options from the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass, field

from engine.placement import NOCHUNK, Placement  # noqa: F401  (NOCHUNK: importable here too)

DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("inprocess", "ray", "torchdist", "shm", "nixl")
GRANULARITIES = ("request", "layer")
KV_RESERVATIONS = ("on_demand", "full")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


RULE_KEYS = ("min", "gt", "choices", "pattern")
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "int | None": int,
          "str | None": str, "float | None": float}


def field_type(f: dataclasses.Field) -> type:
    """The Python type of a config field (``int | None`` -> int)."""
    return f.type if isinstance(f.type, type) else _TYPES.get(str(f.type), str)


def allowed(f: dataclasses.Field) -> str:
    """What a field accepts, in words (for error messages and ``--help``)."""
    rule = f.metadata
    parts = []
    if "min" in rule:
        parts.append(f">= {rule['min']}")
    if "gt" in rule:
        parts.append(f"> {rule['gt']}")
    if "choices" in rule:
        parts.append(f"one of {tuple(rule['choices'])}")
    if "pattern" in rule:
        parts.append(f"like {rule.get('hint', rule['pattern'])}")
    if f.default is None:
        parts.append("(or unset)")
    return " ".join(parts)


def check_fields(obj) -> None:
    """Check each field of ``obj`` against its rule: the type (a finite number for int/float;
    bool is not an int), ``min`` (inclusive), ``gt`` (exclusive), ``choices``, ``pattern`` (full).

    Raises:
        ValueError: ``"<field> must be <what is allowed>, got <value>"``.
    """
    for f in dataclasses.fields(obj):
        value, rule, kind = getattr(obj, f.name), f.metadata, field_type(f)
        if value is None and f.default is None:
            continue
        if kind is bool:
            _check(isinstance(value, bool), f"{f.name} must be true or false, got {value!r}")
            continue
        if kind in (int, float):
            ok = isinstance(value, numbers.Integral if kind is int else numbers.Real)
            _check(ok and not isinstance(value, bool) and math.isfinite(value),
                   f"{f.name} must be a finite {kind.__name__} {allowed(f)}, got {value!r}")
        what = allowed(f)
        if "min" in rule:
            _check(value >= rule["min"], f"{f.name} must be {what}, got {value}")
        if "gt" in rule:
            _check(value > rule["gt"], f"{f.name} must be {what}, got {value}")
        if "choices" in rule:
            _check(value in rule["choices"], f"{f.name} must be {what}, got {value!r}")
        if "pattern" in rule:
            _check(isinstance(value, str) and re.fullmatch(rule["pattern"], value) is not None,
                   f"{f.name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load: ``smollm2-135m`` (bundled GGUF, the default), ``tiny-random-llama``
    (seeded test model), a local Hugging Face directory or a hub id (needs network); ``dtype``
    is that of the parameters and the KV cache."""

    # which names exist is checked by engine.model.check_model_name (it reads the disk)
    model: str = field(default="smollm2-135m", metadata={"pattern": r".*\S.*",
                                                         "hint": "a model name or path"})
    dtype: str = field(default="float32", metadata={"choices": DTYPES})

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model.strip() != "", "model must not be empty")
        check_fields(self)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and KV cache of one engine instance.

    The KV cache is ``num_blocks`` blocks of ``block_size`` tokens: the memory budget over the
    bytes of one block, capped by what ``max_num_seqs`` requests of ``max_model_len`` tokens
    can use and by ``kv_capacity_tokens`` (``kv_num_blocks_for``).

    Attributes:
        max_num_seqs: requests holding KV at once (vLLM's default, 256).
        max_model_len: tokens of one request, prompt + output; capped by the model's context.
        max_num_batched_tokens: per-step token budget (prompt chunks + decodes), >= max_num_seqs.
        enable_chunked_prefill: split long prompts across steps, mixed with running decodes
            (Sarathi-Serve); off = a prompt runs whole in one step.
        kv_capacity_tokens: extra cap on the KV cache in tokens (rounded up to whole blocks).
        block_size: tokens per KV block (vLLM's default, 16).
        kv_cache_memory_gb: KV budget in GiB (2**30 bytes, as vLLM's ``VLLM_CPU_KVCACHE_SPACE``);
            None = ``DEFAULT_CPU_KV_CACHE_GB`` on CPU, ``gpu_memory_utilization`` on CUDA.
        gpu_memory_utilization: CUDA without ``kv_cache_memory_gb``: the fraction of the
            device's memory for weights + KV, the KV cache getting what the weights leave.
        device: ``cpu`` or ``cuda[:i]``.
        enable_prefix_caching: vLLM's automatic prefix caching: full KV blocks stay cached by
            the hash of their token prefix, and a prompt starting with them skips their
            prefill (``engine.kv_blocks``).
        kv_reservation: ``on_demand`` (vLLM v1): blocks as tokens arrive, preempting the newest
            running request (freed, recomputed later) when none is free; ``full``: blocks for
            prompt + max_tokens at admission, never preempted.
        tp, pp: the instance's TP and PP sizes, set by the deployment from the placement
            (no command-line option).
    """

    max_num_seqs: int = field(default=256, metadata={"min": 1})
    max_model_len: int = field(default=2048, metadata={"min": 2})
    max_num_batched_tokens: int = field(default=512, metadata={"min": 1})
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int | None = field(default=None, metadata={"min": 2})
    block_size: int = field(default=16, metadata={"min": 1})
    kv_cache_memory_gb: float | None = field(default=None, metadata={
        "gt": 0, "help": "KV cache budget per engine in GiB (unset: 4 GiB on CPU; on CUDA "
                         "--gpu-memory-utilization of the device)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "gt": 0, "help": "CUDA only, with no --kv-cache-memory-gb: fraction of the device's "
                         "memory for weights + KV, in (0, 1]"})
    device: str = field(default="cpu", metadata={"pattern": r"cpu|cuda(:\d+)?",
                                                 "hint": "'cpu' or 'cuda[:i]'"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of full 16-token blocks whose token prefix is cached (vLLM's "
                "automatic prefix caching)"})
    device_profile: str | None = field(default=None, metadata={
        "pattern": r"[^!]*\.json", "hint": "a .json file (pdlab profile's device_profile.json)",
        "help": "emulated devices (--devices emu:0-7) only: the device_profile.json whose "
                "fitted step models time every step (pdlab profile, e.g. --from-silicon-db); "
                "comma-separated, one per TP size (--tp T): each instance takes its size's"})
    emu_kv_scale: float = field(default=1.0, metadata={
        "gt": 0, "help": "emulated devices only: fraction of the emulated model's KV bytes "
                         "per token actually held and moved, in (0, 1] (e.g. 0.00390625 = "
                         "1/256 when this host cannot hold the GPU's cache)"})
    emu_time_scale: float = field(default=1.0, metadata={
        "min": 1, "help": "emulated devices only (run, compare, plan --validate, map "
                         "--validate-on emu; not serve): time dilation S >= 1: every "
                         "emulated step and every gap between arrivals lasts S x its "
                         "modelled time and every measured time is divided by S, so this "
                         "host's own overhead counts 1/S as much (experiments/dilation.py)"})
    kv_reservation: str = field(default="on_demand", metadata={
        "choices": KV_RESERVATIONS,
        "help": "on_demand: KV blocks as tokens arrive, preempting the newest request when "
                "none is free (vLLM v1); full: blocks for prompt + max_tokens at admission"})
    tp: int = field(default=1, metadata={"min": 1, "cli": False})
    pp: int = field(default=1, metadata={"min": 1, "cli": False})

    def __post_init__(self) -> None:
        check_fields(self)
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
            f"got {self.max_num_batched_tokens}",
        )
        _check(self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be <= 1, got {self.gpu_memory_utilization}")
        _check(self.emu_kv_scale <= 1, f"emu_kv_scale must be <= 1, got {self.emu_kv_scale}")

    @property
    def total_kv_capacity_tokens(self) -> int:
        """Most tokens the KV cache holds before the model's bytes per token are known:
        ``max_kv_blocks * block_size`` (``Engine.kv_capacity_tokens`` obeys the budget too)."""
        return self.max_kv_blocks * self.block_size

    @property
    def max_kv_blocks(self) -> int:
        """``min(max_num_seqs * ceil(max_model_len / block_size),
        ceil(kv_capacity_tokens / block_size))`` blocks."""
        blocks = self.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.kv_capacity_tokens is not None:
            blocks = min(blocks, -(-self.kv_capacity_tokens // self.block_size))
        return blocks


# The KV cache's size: one rule for the engine (engine.kv_cache) and the planner (its profile).
GIB = 2 ** 30
DEFAULT_CPU_KV_CACHE_GB = 4.0  # vLLM's CPU default before "auto" (VLLM_CPU_KVCACHE_SPACE=4)


def kv_budget_bytes_for(config: EngineConfig, device: str,
                        device_memory_bytes: int | None = None,
                        used_memory_bytes: int | None = None) -> int:
    """The KV cache budget in bytes of an engine of ``config`` on ``device`` (``cpu``,
    ``cuda[:i]``), from device facts the caller measures (no torch here).

    ``kv_cache_memory_gb`` GiB (2**30 bytes) when set; else ``DEFAULT_CPU_KV_CACHE_GB`` GiB on
    CPU; else on CUDA ``max(0, int(gpu_memory_utilization * device_memory_bytes) -
    used_memory_bytes)``, vLLM's rule (a step's activations come out of the same share). The
    engine passes ``torch.cuda.mem_get_info``'s ``total`` and ``total - free`` after loading
    its weights; the planner its profile's ``device_memory_bytes`` and ``weight_bytes``.

    Raises:
        ValueError: a CUDA budget from the utilization without ``device_memory_bytes`` or
            ``used_memory_bytes``.
    """
    if config.kv_cache_memory_gb is not None:
        return int(config.kv_cache_memory_gb * GIB)
    if not device.startswith("cuda"):
        return int(DEFAULT_CPU_KV_CACHE_GB * GIB)
    if device_memory_bytes is None or used_memory_bytes is None:
        raise ValueError("a CUDA KV budget from gpu_memory_utilization needs the device's "
                         "memory and the bytes already in use on it (or set "
                         "kv_cache_memory_gb)")
    return max(0, int(config.gpu_memory_utilization * device_memory_bytes) - used_memory_bytes)


def kv_num_blocks_for(config: EngineConfig, bytes_per_token: int, budget_bytes: int,
                      max_model_len: int | None = None) -> int:
    """Blocks of the KV cache: ``budget_bytes // (block_size * bytes_per_token)`` (vLLM's
    ``available_memory // bytes_per_block``, v1/core/kv_cache_utils.py), capped by
    ``config.max_kv_blocks``; ``max_model_len`` overrides the config's. ``bytes_per_token``:
    ``KVSpec.bytes_per_token`` (K and V of every layer), > 0."""
    if max_model_len is not None:
        config = dataclasses.replace(config, max_model_len=max_model_len)
    return min(budget_bytes // (config.block_size * bytes_per_token), config.max_kv_blocks)


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from a prefill worker to a decode worker.

    Attributes:
        transport: ``ray`` (object store, the default, crosses nodes), ``inprocess``
            (reference), ``torchdist`` (point-to-point: gloo on CPU, NCCL on CUDA), ``shm``
            (a shared-memory arena per prefill worker; one node, one copy per transfer),
            ``nixl`` (one-sided READs from a registered arena; crosses nodes; ``nixl`` extra).
        granularity: ``request`` (whole prompt KV after prefill) or ``layer`` (layer ranges
            sent while prefill computes the next).
        layers_per_chunk: layers per layer-wise message.
        checksum: CRC-32C of every tensor byte in the header (zlib CRC-32 without the
            ``crc32c`` package), verified on receipt.
        timeout_s: deadline of every remote wait, seconds.
    """

    transport: str = dataclasses.field(default="ray", metadata={"choices": TRANSPORTS})
    granularity: str = dataclasses.field(default="request", metadata={"choices": GRANULARITIES})
    layers_per_chunk: int = field(default=1, metadata={"min": 1})
    checksum: bool = True
    timeout_s: float = field(default=60.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_fields(self)


ADDRESS_PATTERN = r"auto|local|(ray://)?[A-Za-z0-9_.\-]+:\d{1,5}"
def parse_placement(placement: str) -> tuple[str, int, int]:
    """The kind and instance counts of a placement (``engine.placement.Placement``, whose
    fields everything that deploys reads): ``("colocated", N, 0)``, ``("disagg", x, y)`` or
    ``("conditional", x, y)``, whatever the instances' TP/PP sizes; ValueError as
    ``Placement.parse``."""
    p = Placement.parse(placement)
    return (p.kind, *p.counts)


@dataclass(frozen=True)
class ConditionalConfig:
    """When a ``conditional:xPyD`` placement prefills remotely: only if the prompt is longer
    than ``max_local_prefill_length`` tokens and fewer than ``max_prefill_queue_size``
    requests are queued or prefilling on the prefill workers; else its decode worker
    prefills (and decodes) it, with no KV transfer. NVIDIA Dynamo's conditional
    disaggregation and option names (Dynamo docs v0.2.0, "Dynamo Disaggregation",
    docs.nvidia.com/dynamo/archive/0.2.0/architecture/disagg_serving.html)."""

    max_local_prefill_length: int = field(default=256, metadata={
        "min": 0, "help": "prompts of at most this many tokens prefill on their decode worker "
                          "(conditional:xPyD)"})
    max_prefill_queue_size: int = field(default=4, metadata={
        "min": 1, "help": "remote prefill only while fewer requests wait on the prefill "
                          "workers (conditional:xPyD)"})

    def __post_init__(self) -> None:
        check_fields(self)

    def remote(self, num_prompt_tokens: int, num_queued_prefills: int) -> bool:
        """Dynamo's rule: prefill remotely (True) or on the decode worker (False)."""
        return (num_prompt_tokens > self.max_local_prefill_length
                and num_queued_prefills < self.max_prefill_queue_size)


def placement_engine_overrides(placement: str, engine: EngineConfig) -> EngineConfig:
    """The engine config a placement runs with. ``colocated-nochunk:N`` turns chunked prefill
    off and, as vLLM requires without chunking, raises the token budget to ``max_model_len``
    so any admissible prompt runs whole in one step."""
    if Placement.parse(placement).chunked:
        return engine
    budget = max(engine.max_num_batched_tokens, engine.max_model_len)
    return dataclasses.replace(engine, enable_chunked_prefill=False, max_num_batched_tokens=budget)


def default_devices() -> tuple[str, ...]:
    """All GPUs if CUDA is present, else one ``cpu:i`` device per core."""
    try:
        import torch  # local import: this module stays importable without torch

        if torch.cuda.is_available():
            return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return tuple(f"cpu:{i}" for i in range(len(os.sched_getaffinity(0))))


def parse_devices(devices: str | None) -> tuple[str, ...]:
    """Parse ``cuda:0,cuda:1`` or ``cpu:0,cpu:1`` (a CPU device may be a core group ``cpu:0-3``)
    or ``emu:0-7`` (emulated devices, ``engine.emulated``: a range is that many devices).

    Raises:
        ValueError: empty list, unknown device kind, repeated device, or kinds mixed.
    """
    if not devices:
        return default_devices()
    items = tuple(d.strip() for d in devices.split(",") if d.strip())
    _check(len(items) > 0, "devices must name at least one device")
    for d in items:
        _check(re.fullmatch(r"cuda:\d+|cpu:\d+(-\d+)?|emu:\d+(-\d+)?", d) is not None,
               f"device must look like 'cuda:0' or 'cpu:0' or 'cpu:0-3' or 'emu:0-7', got {d!r}")
    items = tuple(e for d in items for e in _expand_emulated(d))
    for d in items:
        cores = d.split(":")[1].partition("-")
        _check(not cores[2] or int(cores[2]) >= int(cores[0]),
               f"a core group must run low-high (e.g. cpu:0-3), got {d!r}")
    _check(len(set(items)) == len(items), f"devices must not repeat, got {devices!r}")
    _check(len({d.split(":")[0] for d in items}) == 1,
           f"devices must not mix cpu and cuda, nor emu with either: {devices!r}")
    return items


def _expand_emulated(device: str) -> tuple[str, ...]:
    """``emu:0-3`` -> ``emu:0 .. emu:3`` (a range of emulated devices, one worker each,
    unlike a CPU core group); other devices as they are."""
    if not device.startswith("emu:"):
        return (device,)
    lo, _, hi = device[4:].partition("-")
    _check(not hi or int(hi) >= int(lo), f"an emulated range must run low-high (e.g. emu:0-7), "
                                         f"got {device!r}")
    return tuple(f"emu:{i}" for i in range(int(lo), int(hi or lo) + 1))


def is_emulated(devices: tuple[str, ...]) -> bool:
    """True for a device set of emulated devices (``emu:i``, ``engine.emulated``)."""
    return bool(devices) and devices[0].startswith("emu:")


def emulated_devices(n: int) -> tuple[str, ...]:
    """``emu:0`` .. ``emu:n-1``, the emulated devices ``pdlab plan --validate`` and ``pdlab map
    --validate-on emu`` run on; ValueError when ``n < 1``."""
    _check(isinstance(n, int) and n >= 1, f"an emulated device set needs n >= 1 devices, got {n!r}")
    return parse_devices(f"emu:0-{n - 1}")


def device_index(device: str) -> int:
    """The index of a one-device name: ``cuda:3`` -> 3, ``emu:5`` -> 5, ``cpu:2`` -> 2."""
    return int(device.split(":", 1)[1].partition("-")[0])


def cpu_cores_of(device: str) -> list[int]:
    """Cores of a CPU device: ``cpu:2`` -> [2], ``cpu:0-3`` -> [0, 1, 2, 3]."""
    spec = device.split(":", 1)[1]
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


@dataclass(frozen=True)
class PlacementConfig:
    """Where prefill and decode run: ``placement`` as ``engine.placement`` spells it (e.g.
    ``disagg:1p1d+ptp2``); ``devices`` a comma-separated set (None: all GPUs, else one per CPU
    core); ``address`` a Ray cluster to join (None starts a local one)."""

    placement: str = "disagg:1p1d"
    devices: str | None = None
    address: str | None = field(default=None, metadata={
        "pattern": ADDRESS_PATTERN, "hint": "'auto', 'local', 'host:port' or 'ray://host:port'"})

    def __post_init__(self) -> None:
        Placement.parse(self.placement)
        parse_devices(self.devices) if self.devices else None
        check_fields(self)

    @property
    def parsed(self) -> Placement:
        """The typed placement (``engine.placement.Placement``), not bound to devices."""
        return Placement.parse(self.placement)

    @property
    def kind(self) -> str:
        return self.parsed.kind

    @property
    def num_devices_needed(self) -> int:
        """Devices the placement spans: the sum of its instances' ``tp * pp``."""
        return self.parsed.num_devices


def add_dataclass_args(parser, cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Add one ``--field-name`` option per dataclass field (but ``skip``), typed by the field;
    a field's ``metadata`` may carry ``help`` and ``choices``; ``cli: False`` keeps it off the
    command line (a value the deployment sets); ``--help`` shows its rule."""
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default
        rule = allowed(f) if "choices" not in f.metadata else ""  # argparse lists choices
        text = " ".join(t for t in (f.metadata.get("help", ""),
                                    f"({rule + '; ' if rule else ''}default: {default})") if t)
        kind = field_type(f)
        if kind is bool:
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                                help=text)
            continue
        parser.add_argument(flag, type=kind, default=default, help=text,
                            choices=f.metadata.get("choices"))


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str = ""):
    """Build ``cls`` from options added by ``add_dataclass_args``; ValueError on bad values."""
    values = {f.name: getattr(args, (prefix + f.name).replace("-", "_"))
              for f in dataclasses.fields(cls) if hasattr(args, (prefix + f.name).replace("-", "_"))}
    return cls(**values)
