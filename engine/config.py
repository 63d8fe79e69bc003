"""Frozen, validated configuration dataclasses (no torch).

Every field has a default and a range checked in ``__post_init__``; a bad value raises
``ValueError`` naming the field and what is allowed. ``add_dataclass_args`` derives CLI
options from the fields, so the CLI and the config never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
TRANSPORTS = ("inprocess", "ray", "torchdist", "shm")
GRANULARITIES = ("request", "layer")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: ``smollm2-135m`` (bundled GGUF, the default), ``tiny-random-llama`` (seeded
            test model), a local Hugging Face model directory, or a hub id (needs network).
        dtype: parameter and KV cache dtype, one of ``float32``, ``bfloat16``, ``float16``.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check(bool(self.model), "model must not be empty")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and KV capacity of one engine instance.

    Attributes:
        max_num_seqs: KV slots, i.e. requests holding KV at once (>= 1).
        max_model_len: tokens per slot: prompt + output of one request must fit (>= 2);
            capped by the model's context length.
        max_num_batched_tokens: per-step token budget (prompt chunks + decodes), >= max_num_seqs.
        enable_chunked_prefill: split long prompts across steps, mixed with running decodes
            (Sarathi-Serve); off = a prompt runs whole in one step.
        kv_capacity_tokens: total tokens reserved (prompt + max_tokens per request) that the
            KV store may hold; None = max_num_seqs * max_model_len.
        device: ``cpu`` or ``cuda[:i]``.
    """

    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}), "
            f"got {self.max_num_batched_tokens}",
        )
        _check(
            self.kv_capacity_tokens is None or self.kv_capacity_tokens >= 2,
            f"kv_capacity_tokens must be >= 2 or None, got {self.kv_capacity_tokens}",
        )
        _check(
            re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
            f"device must be 'cpu' or 'cuda[:i]', got {self.device!r}",
        )

    @property
    def total_kv_capacity_tokens(self) -> int:
        if self.kv_capacity_tokens is None:
            return self.max_num_seqs * self.max_model_len
        return self.kv_capacity_tokens


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from a prefill worker to a decode worker.

    Attributes:
        transport: ``ray`` (object store, default, crosses nodes), ``inprocess`` (reference),
            ``torchdist`` (torch.distributed point-to-point: gloo on CPU, NCCL on CUDA),
            ``shm`` (a shared-memory arena per prefill worker: workers of one node only, one
            copy per transfer; the fastest between processes, see ``kv_transfer.shm``).
        granularity: ``request`` (whole prompt KV after prefill) or ``layer`` (layer ranges
            sent while prefill computes the next).
        layers_per_chunk: layers per layer-wise message (>= 1).
        checksum: add a checksum of every tensor byte to the header (hardware CRC-32C; zlib
            CRC-32 where the ``crc32c`` package is missing) and verify it on receipt.
        timeout_s: deadline of every remote wait in seconds (> 0).
    """

    transport: str = dataclasses.field(default="ray", metadata={"choices": TRANSPORTS})
    granularity: str = dataclasses.field(default="request", metadata={"choices": GRANULARITIES})
    layers_per_chunk: int = 1
    checksum: bool = True
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check(self.transport in TRANSPORTS,
               f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        _check(self.granularity in GRANULARITIES,
               f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        _check(self.layers_per_chunk >= 1,
               f"layers_per_chunk must be >= 1, got {self.layers_per_chunk}")
        _check(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")


_PLACEMENT_RE = re.compile(r"colocated(?:-nochunk)?:(\d+)|disagg:(\d+)p(\d+)d")
NOCHUNK = "colocated-nochunk"


def parse_placement(placement: str) -> tuple[str, int, int]:
    """Parse ``colocated:N``, ``colocated-nochunk:N`` or ``disagg:xPyD`` (case-insensitive).

    ``colocated-nochunk:N`` is ``colocated:N`` with chunked prefill off (see
    ``placement_engine_overrides``), so one comparison can hold both colocated baselines.

    Returns:
        ``("colocated", N, 0)`` or ``("disagg", x, y)``.

    Raises:
        ValueError: anything else, or a zero count.
    """
    m = _PLACEMENT_RE.fullmatch(placement.strip().lower())
    if m is None:
        raise ValueError(
            "placement must be 'colocated:N', 'colocated-nochunk:N' or 'disagg:xPyD' "
            f"(e.g. disagg:1p1d), got {placement!r}")
    if m.group(1) is not None:
        n = int(m.group(1))
        _check(n >= 1, f"colocated:N needs N >= 1, got {placement!r}")
        return "colocated", n, 0
    x, y = int(m.group(2)), int(m.group(3))
    _check(x >= 1 and y >= 1, f"disagg:xPyD needs x, y >= 1, got {placement!r}")
    return "disagg", x, y


def placement_engine_overrides(placement: str, engine: EngineConfig) -> EngineConfig:
    """The engine config a placement runs with. ``colocated-nochunk:N`` turns chunked prefill
    off and, as vLLM requires without chunking, raises the token budget to ``max_model_len``
    so any admissible prompt runs whole in one step."""
    if not placement.strip().lower().startswith(NOCHUNK):
        return engine
    budget = max(engine.max_num_batched_tokens, engine.max_model_len)
    return dataclasses.replace(engine, enable_chunked_prefill=False, max_num_batched_tokens=budget)


def default_devices() -> tuple[str, ...]:
    """All GPUs if CUDA is present, else one ``cpu:i`` device per core (DESIGN §5)."""
    try:
        import torch  # local import: this module stays importable without torch

        if torch.cuda.is_available():
            return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return tuple(f"cpu:{i}" for i in range(len(os.sched_getaffinity(0))))


def parse_devices(devices: str | None) -> tuple[str, ...]:
    """Parse ``cuda:0,cuda:1`` or ``cpu:0,cpu:1`` (a CPU device may be a core group ``cpu:0-3``).

    Raises:
        ValueError: empty list, unknown device kind, repeated device, or CPU and CUDA mixed.
    """
    if not devices:
        return default_devices()
    items = tuple(d.strip() for d in devices.split(",") if d.strip())
    _check(len(items) > 0, "devices must name at least one device")
    for d in items:
        _check(re.fullmatch(r"cuda:\d+|cpu:\d+(-\d+)?", d) is not None,
               f"device must look like 'cuda:0' or 'cpu:0' or 'cpu:0-3', got {d!r}")
    for d in items:
        cores = d.split(":")[1].partition("-")
        _check(not cores[2] or int(cores[2]) >= int(cores[0]),
               f"a core group must run low-high (e.g. cpu:0-3), got {d!r}")
    _check(len(set(items)) == len(items), f"devices must not repeat, got {devices!r}")
    _check(len({d.split(":")[0] for d in items}) == 1, f"devices must not mix cpu and cuda: {devices!r}")
    return items


def cpu_cores_of(device: str) -> list[int]:
    """Cores of a CPU device: ``cpu:2`` -> [2], ``cpu:0-3`` -> [0, 1, 2, 3]."""
    spec = device.split(":", 1)[1]
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


@dataclass(frozen=True)
class PlacementConfig:
    """Where prefill and decode run.

    Attributes:
        placement: ``colocated:N`` or ``disagg:xPyD``.
        devices: comma-separated device set; None = all GPUs, else one device per CPU core.
        address: an existing Ray cluster to join; None starts a local one.
    """

    placement: str = "disagg:1p1d"
    devices: str | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        parse_placement(self.placement)
        parse_devices(self.devices) if self.devices else None

    @property
    def kind(self) -> str:
        return parse_placement(self.placement)[0]

    @property
    def num_devices_needed(self) -> int:
        kind, a, b = parse_placement(self.placement)
        return a if kind == "colocated" else a + b


def add_dataclass_args(parser, cls: type, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Add one ``--field-name`` option per dataclass field (but ``skip``), typed by the field;
    a field's ``metadata`` may carry ``help`` and ``choices``."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        default = f.default
        text = f"{f.metadata.get('help', '')} (default: {default})".strip()
        if f.type in ("bool", bool):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                                help=text)
            continue
        kind = {"int": int, "float": float, "str": str, "int | None": int,
                "str | None": str, "float | None": float}.get(str(f.type), str)
        parser.add_argument(flag, type=kind, default=default, help=text,
                            choices=f.metadata.get("choices"))


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str = ""):
    """Build ``cls`` from options added by ``add_dataclass_args``; ValueError on bad values."""
    values = {f.name: getattr(args, (prefix + f.name).replace("-", "_"))
              for f in dataclasses.fields(cls) if hasattr(args, (prefix + f.name).replace("-", "_"))}
    return cls(**values)
