"""Wire format of one KV transfer: frame 0, a versioned msgpack map of ``KVHeader``'s fields;
frame 1, the KV tensor ``[L', 2, H_kv, T, D]`` as raw C-order bytes, never upcast, so ``len(frame
1) == spec.kv_bytes(T, L')``. ``unpack`` checks the header against the receiver's ``KVSpec``
before touching the bytes (``KVSpecMismatch`` names the field, expected and got); corrupted bytes
raise ``KVChecksumError``; both are ``ValueError``. A message may carry a slice of the heads
(``RankPart``).

Checksum (wire version 2): CRC-32C over every byte of frame 1 with the CPU's CRC instruction (the
``crc32c`` package; without it zlib ``crc32``, named in ``checksum_kind``). ``pack`` never copies a
contiguous CPU tensor; ``unpack`` never copies a writable frame (tensor, bytearray, shared-memory
slot) and copies a read-only one (``bytes``, a Ray store buffer) exactly once."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields

import msgpack
import numpy as np
import torch

from engine.kv_cache import DTYPE_ITEMSIZE, TORCH_DTYPES, KVSpec

try:  # hardware CRC-32C (SSE4.2 / ARMv8 CRC); a dependency, but keep working without it
    from crc32c import crc32c as _crc32c_fn
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    _crc32c_fn = None

WIRE_VERSION = 3  # 3: a message may carry a slice of the KV heads and names its ranks
CHECKSUM_KINDS = ("crc32c", "crc32")
DEFAULT_CHECKSUM_KIND = "crc32c" if _crc32c_fn is not None else "crc32"

Frame = bytes | bytearray | memoryview | torch.Tensor  # frame 1 may be a flat uint8 tensor


class KVSpecMismatch(ValueError):
    """The header does not fit the receiver's KVSpec (or wire version, or byte count)."""

    def __init__(self, request_id: str, field: str, expected, got):
        super().__init__(
            f"KV header mismatch for request {request_id}: {field} expected {expected}, got {got}")
        self.request_id, self.field, self.expected, self.got = request_id, field, expected, got


class KVChecksumError(ValueError):
    """The tensor bytes' checksum differs from the header's: the KV was corrupted in flight."""


@dataclass(frozen=True)
class RankPart:
    """One message of a TP-``prefill_tp`` to TP-``decode_tp`` transfer: global KV heads from
    ``head_start`` (as many as the tensor has), from ``prefill_rank`` to ``decode_rank``."""

    head_start: int = 0
    prefill_rank: int = 0
    decode_rank: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1


WHOLE = RankPart()


@dataclass(frozen=True)
class KVHeader:
    """Frame 0 of a transfer; ranges half-open ``[start, end)``. ``shape`` is ``(layer_end -
    layer_start, 2, num_kv_heads, token_end - token_start, head_dim)``; ``checksum``: of all of
    frame 1 by ``checksum_kind`` (``crc32c`` or zlib ``crc32``), or None; ``part``: its heads."""

    wire_version: int
    request_id: str
    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    shape: tuple[int, ...]
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    checksum: int | None
    checksum_kind: str | None = None
    head_start: int = 0
    prefill_rank: int = 0
    decode_rank: int = 0
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def part(self) -> RankPart:
        """The heads and ranks this message carries."""
        return RankPart(self.head_start, self.prefill_rank, self.decode_rank, self.prefill_tp,
                        self.decode_tp)

    @property
    def num_bytes(self) -> int:
        """Bytes of frame 1: ``prod(shape) * itemsize``."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


_HEADER_FIELDS = tuple(f.name for f in fields(KVHeader))


def checksum_of(kv_u8: torch.Tensor, kind: str = DEFAULT_CHECKSUM_KIND, value: int = 0) -> int:
    """``kind`` checksum of a flat uint8 tensor continuing from ``value`` (chunk by chunk).

    Raises:
        ValueError: unknown ``kind``, or ``crc32c`` without the ``crc32c`` package."""
    if not kv_u8.numel():
        return value
    data = kv_u8.detach().cpu().numpy()
    if kind == "crc32c" and _crc32c_fn is not None:
        return _crc32c_fn(data, value)
    if kind == "crc32":
        return zlib.crc32(data, value)
    raise ValueError(f"checksum kind {kind!r} is not available here (have: "
                     f"{'crc32c, ' if _crc32c_fn is not None else ''}crc32)")


def tensor_bytes(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` as a flat, contiguous uint8 tensor on its own device (no copy if contiguous)."""
    return kv.detach().contiguous().view(torch.uint8).reshape(-1)


def encode_header(header: KVHeader) -> bytes:
    """msgpack bytes of ``header`` (fields by name: ``asdict``'s deep copy costs more)."""
    return msgpack.packb({name: getattr(header, name) for name in _HEADER_FIELDS},
                         use_bin_type=True)


def decode_header(frame: Frame) -> KVHeader:
    """Parse frame 0. Raises ``KVSpecMismatch`` on an unreadable header or another wire version."""
    try:
        d = msgpack.unpackb(bytes(frame), raw=False)
        version = d["wire_version"]
    except Exception as e:  # noqa: BLE001 - any decoding failure means "not our header"
        raise KVSpecMismatch("?", "wire_version", WIRE_VERSION, f"unreadable header ({e})") from e
    if version != WIRE_VERSION:
        raise KVSpecMismatch(d.get("request_id", "?"), "wire_version", WIRE_VERSION, version)
    return KVHeader(**{k: (tuple(v) if k == "shape" else v) for k, v in d.items()
                       if k in _HEADER_FIELDS})


def check_header(header: KVHeader, expected: KVSpec) -> None:
    """Check ``header`` against the receiver's spec. Raises ``KVSpecMismatch`` naming the field."""
    rid = header.request_id
    for name in ("model_fingerprint", "num_layers", "num_kv_heads", "head_dim", "dtype"):
        want, got = getattr(expected, name), getattr(header, name)
        if want != got:
            raise KVSpecMismatch(rid, name, want, got)
    if not 0 <= header.layer_start < header.layer_end <= expected.num_layers:
        raise KVSpecMismatch(rid, "layer range", f"within [0, {expected.num_layers})",
                             f"[{header.layer_start}, {header.layer_end})")
    heads = header.shape[2] if len(header.shape) == 5 else -1
    if not (0 <= header.head_start and 0 < heads and header.head_start + heads <= expected.num_kv_heads):
        raise KVSpecMismatch(rid, "KV heads", f"within [0, {expected.num_kv_heads})",
                             f"[{header.head_start}, {header.head_start + heads})")
    want_shape = expected.kv_shape(header.token_end - header.token_start,
                                   header.layer_end - header.layer_start)
    want_shape = want_shape[:2] + (heads,) + want_shape[3:]
    if header.shape != want_shape:
        raise KVSpecMismatch(rid, "shape", want_shape, header.shape)


def make_header(request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
                layer_start: int = 0, checksum: int | None = None,
                checksum_kind: str | None = None, part: RankPart = WHOLE) -> KVHeader:
    """Header for ``kv`` ``[L', 2, H', T, D]``, tokens from ``token_start``, layers from
    ``layer_start``, heads ``[part.head_start, part.head_start + H')`` of the spec's.

    Raises:
        ValueError: ``kv`` does not have the spec's shape (on those heads) or dtype."""
    num_layers, _, heads, num_tokens, _ = kv.shape if kv.dim() == 5 else (0, 0, 0, 0, 0)
    want = spec.kv_shape(num_tokens, num_layers)
    want = want[:2] + (heads,) + want[3:]
    if (tuple(kv.shape) != want or kv.dtype != spec.torch_dtype or heads < 1
            or part.head_start < 0 or part.head_start + heads > spec.num_kv_heads):
        raise ValueError(f"KV tensor for request {request_id} must be {spec.torch_dtype} of shape "
                         f"[L', 2, {spec.num_kv_heads}, T, {spec.head_dim}], "
                         f"got {kv.dtype} {tuple(kv.shape)}")
    return KVHeader(
        wire_version=WIRE_VERSION, request_id=request_id,
        model_fingerprint=spec.model_fingerprint, num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
        shape=tuple(kv.shape), token_start=token_start, token_end=token_start + num_tokens,
        layer_start=layer_start, layer_end=layer_start + num_layers, checksum=checksum,
        checksum_kind=None if checksum is None else (checksum_kind or DEFAULT_CHECKSUM_KIND),
        head_start=part.head_start, prefill_rank=part.prefill_rank,
        decode_rank=part.decode_rank, prefill_tp=part.prefill_tp, decode_tp=part.decode_tp,
    )


def pack_tensor(request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
                layer_start: int = 0, checksum: bool = True,
                part: RankPart = WHOLE) -> tuple[bytes, torch.Tensor]:
    """``pack`` with frame 1 a flat uint8 tensor on ``kv``'s device (NCCL); the checksum of a
    CUDA tensor costs a device-to-host copy (``checksum=False`` skips it)."""
    kv_u8 = tensor_bytes(kv)
    crc = checksum_of(kv_u8) if checksum else None
    header = make_header(request_id, spec, kv, token_start, layer_start, crc, part=part)
    return encode_header(header), kv_u8


def pack(request_id: str, spec: KVSpec, kv: torch.Tensor, token_start: int = 0,
         layer_start: int = 0, checksum: bool = True,
         part: RankPart = WHOLE) -> list[bytes | memoryview]:
    """``[header_bytes, tensor_bytes]`` for ``kv`` ``[L', 2, H_kv, T, D]`` (any device; moved to
    host, never upcast). Frame 1 views ``kv`` when it is contiguous on CPU: do not modify ``kv``
    until the transport has taken the bytes.

    Raises:
        ValueError: ``kv`` does not match ``spec``'s shape or dtype."""
    header, kv_u8 = pack_tensor(request_id, spec, kv.detach().cpu(), token_start, layer_start,
                                checksum, part)
    return [header, memoryview(kv_u8.numpy())]


def _as_u8_tensor(frame: Frame) -> torch.Tensor:
    """Frame 1 as a flat uint8 tensor sharing a writable buffer; a read-only one is copied once
    (a tensor aliasing store-owned memory could be written or outlive it)."""
    if isinstance(frame, torch.Tensor):
        return frame.reshape(-1)
    view = memoryview(frame).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        return copy_to_tensor(view)
    return torch.frombuffer(view, dtype=torch.uint8)  # keeps the buffer alive


def copy_to_tensor(buffer) -> torch.Tensor:
    """A fresh flat uint8 tensor holding one copy of a bytes-like ``buffer``'s bytes."""
    view = memoryview(buffer).cast("B")
    out = torch.empty(len(view), dtype=torch.uint8)
    if len(view):  # numpy reads even a read-only buffer in place; one copy into ``out``
        np.copyto(out.numpy(), np.frombuffer(view, dtype=np.uint8))
    return out


def tensor_from_frame(header: KVHeader, frame: Frame) -> torch.Tensor:
    """The KV tensor ``header.shape`` from frame 1 (zero-copy where writable).

    Raises:
        KVSpecMismatch: the byte count differs from ``prod(shape) * itemsize``.
        KVChecksumError: the checksum differs from ``header.checksum``."""
    kv_u8 = _as_u8_tensor(frame)
    if kv_u8.numel() != header.num_bytes:
        raise KVSpecMismatch(header.request_id, "num_bytes", header.num_bytes, kv_u8.numel())
    verify_checksum(header, kv_u8)
    return kv_u8.view(TORCH_DTYPES[header.dtype]).view(header.shape)


def verify_checksum(header: KVHeader, kv_u8: torch.Tensor) -> None:
    """Check frame 1's bytes against ``header.checksum`` (no-op when it has none).

    Raises:
        KVSpecMismatch: the header names a checksum kind this receiver cannot compute.
        KVChecksumError: the bytes differ from what the sender checksummed."""
    if header.checksum is None:
        return
    kind = header.checksum_kind or "crc32"
    try:
        got = checksum_of(kv_u8, kind)
    except ValueError:
        raise KVSpecMismatch(header.request_id, "checksum_kind", CHECKSUM_KINDS, kind) from None
    if got != header.checksum:
        raise KVChecksumError(f"KV checksum mismatch for request {header.request_id}: "
                              f"expected {kind} {header.checksum}, got {got}")


def unpack(frames: list[Frame], expected: KVSpec) -> tuple[KVHeader, torch.Tensor]:
    """``(header, kv)`` of ``[header_bytes, tensor_bytes]``: ``kv`` ``header.shape`` in the spec's
    dtype, sharing frame 1 when writable, else a copy.

    Raises:
        KVSpecMismatch: wire version, model fingerprint, geometry, dtype, layer range, shape
            or byte count differ (message names field, expected and got).
        KVChecksumError: the bytes were corrupted."""
    if len(frames) != 2:
        raise KVSpecMismatch("?", "number of frames", 2, len(frames))
    header = decode_header(frames[0])
    check_header(header, expected)
    return header, tensor_from_frame(header, frames[1])
