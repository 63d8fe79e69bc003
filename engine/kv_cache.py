"""KV geometry (``KVSpec``) and one engine's KV store.

The store preallocates one slot per concurrent request (DESIGN §4): a request joining or
leaving costs only its own KV, and a step writes only its new tokens' K/V. Slot numbers
come from the scheduler's ``KVCapacity`` (which never touches a tensor).

Layouts:
    store:        [L, 2, S, H_kv, T_max, D]   (L layers, K/V, S slots, T_max = max_model_len)
    exported KV:  [L, 2, H_kv, T, D]          (one request's first T tokens, contiguous)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVSpec:
    """The KV geometry of a model; two engines can exchange KV only if their specs are equal.

    Attributes:
        model_fingerprint: identifies the weights (name + a hash of the config); differing
            fingerprints mean the KV is meaningless to the receiver.
        num_layers: decoder layers L.
        num_kv_heads: KV heads H_kv (not query heads: GQA shares each KV head).
        head_dim: D.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
    """

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_ITEMSIZE)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """``2 * num_layers * num_kv_heads * head_dim * itemsize`` (K and V, every layer)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    def kv_bytes(self, num_tokens: int, num_layers: int | None = None) -> int:
        """Bytes of KV for ``num_tokens`` tokens over ``num_layers`` layers (default: all):
        ``2 * layers * kv_heads * head_dim * tokens * itemsize`` (DistServe §2, vLLM docs)."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * num_tokens * self.itemsize

    def kv_shape(self, num_tokens: int, num_layers: int | None = None) -> tuple[int, ...]:
        """Shape of an exported KV tensor: ``[L, 2, H_kv, T, D]``."""
        layers = self.num_layers if num_layers is None else num_layers
        return (layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


class KVStore:
    """Preallocated per-slot KV for one engine: ``num_slots * max_model_len * bytes_per_token``
    bytes, allocated once.

    The store starts zeroed: batched decode attention reads padded positions (masked out),
    and uninitialised memory there could hold NaN, which a zero attention weight does not
    cancel (0 * NaN = NaN). Stale values of finished requests are finite, so masking them
    is exact.
    """

    def __init__(self, spec: KVSpec, num_slots: int, max_model_len: int, device: str = "cpu"):
        self.spec = spec
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.kv = torch.zeros(  # [L, 2, S, H_kv, T_max, D]
            (spec.num_layers, 2, num_slots, spec.num_kv_heads, max_model_len, spec.head_dim),
            dtype=spec.torch_dtype, device=device,
        )

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for all slots, each ``[S, H_kv, T_max, D]`` (views, no copy)."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def read(self, slot: int, num_tokens: int, layers: slice = slice(None)) -> torch.Tensor:
        """Copy out one request's KV: ``[L', 2, H_kv, T, D]``, contiguous (a new tensor)."""
        return self.kv[layers, :, slot, :, :num_tokens].contiguous()

    def write(self, slot: int, kv: torch.Tensor, layer_start: int = 0) -> None:
        """Place ``kv`` ``[L', 2, H_kv, T, D]`` into ``slot`` at tokens ``[0, T)``, layers
        ``[layer_start, layer_start + L')``.

        Raises:
            ValueError: shape or dtype differs from this store's geometry.
        """
        num_layers, _, heads, num_tokens, head_dim = kv.shape
        expected = self.spec.kv_shape(num_tokens, num_layers)
        if tuple(kv.shape) != expected or kv.dtype != self.spec.torch_dtype:
            raise ValueError(
                f"KV tensor mismatch: expected shape {expected} dtype {self.spec.torch_dtype}, "
                f"got {tuple(kv.shape)} {kv.dtype}"
            )
        if num_tokens > self.max_model_len or layer_start + num_layers > self.spec.num_layers:
            raise ValueError(f"KV of {num_tokens} tokens / layers {layer_start}+{num_layers} "
                             f"does not fit a slot of {self.max_model_len} tokens")
        self.kv[layer_start:layer_start + num_layers, :, slot, :, :num_tokens].copy_(kv)
