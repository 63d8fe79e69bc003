"""KV geometry (``KVSpec``), the KV cache's size from a memory budget, and one engine's
paged KV store.

The store is ``num_blocks`` blocks of ``block_size`` tokens (vLLM's PagedAttention, Kwon et
al. 2023); the scheduler's ``BlockAllocator`` hands out blocks, and token ``t`` of a request
lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``.

Layouts: the store ``[L, 2, H_kv, NB, B, D]`` (layers, K/V, KV heads, NB blocks of B tokens);
exported KV, the wire format, ``[L, 2, H_kv, T, D]`` (a request's first T tokens, contiguous).
Blocks sit on the fourth axis so gathering a batch's blocks per layer (``index_select`` over
NB) gives ``[H_kv, rows, T, D]`` for attention, one copy and no transpose.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# The budget rule is torch-free, in engine.config, so the planner applies the same one; GIB
# and DEFAULT_CPU_KV_CACHE_GB stay importable from here (engine.engine, the tests).
from engine.config import (DEFAULT_CPU_KV_CACHE_GB, GIB,  # noqa: F401
                           kv_budget_bytes_for, kv_num_blocks_for)

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVSpec:
    """The KV geometry of a model (L layers, H_kv KV heads, not query heads, D head dim);
    two engines exchange KV only if their specs are equal. ``model_fingerprint`` (name + a
    hash of the config) identifies the weights the KV was computed with."""

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


def kv_budget_bytes(config, device: str = "cpu") -> int:
    """``engine.config.kv_budget_bytes_for`` with this device's facts; on CUDA it counts what
    is in use now (``mem_get_info``), so call it after the weights are loaded."""
    if config.kv_cache_memory_gb is not None or not device.startswith("cuda"):
        return kv_budget_bytes_for(config, device)
    free_bytes, total_bytes = torch.cuda.mem_get_info(torch.device(device))
    return kv_budget_bytes_for(config, device, total_bytes, total_bytes - free_bytes)


def kv_cache_num_blocks(config, spec: KVSpec, device: str = "cpu",
                        budget_bytes: int | None = None, max_model_len: int | None = None) -> int:
    """Blocks of the KV cache (``engine.config.kv_num_blocks_for``); ``budget_bytes`` None =
    ``kv_budget_bytes``."""
    budget = kv_budget_bytes(config, device) if budget_bytes is None else budget_bytes
    return kv_num_blocks_for(config, spec.bytes_per_token, budget, max_model_len)


class KVStore:
    """Paged KV for one engine: ``[L, 2, H_kv, NB, B, D]``, ``NB * B * bytes_per_token``
    bytes, allocated once, never zero-filled whole (start-up does not grow with the budget).
    Masked positions must be finite (0 * NaN = NaN), so ``claim(top)`` zeroes blocks
    ``[high_water, top)`` before any block below ``top`` is used; first fit keeps the used
    blocks low, so zeroing follows the peak use, once per block."""

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: str = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV store needs num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv = torch.empty(  # [L, 2, H_kv, NB, B, D]
            (spec.num_layers, 2, spec.num_kv_heads, num_blocks, block_size, spec.head_dim),
            dtype=spec.torch_dtype, device=device)
        self.high_water = 0  # blocks [0, high_water) have been zeroed once

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def claim(self, top: int) -> None:
        """Make blocks ``[0, top)`` safe to read: zero those never zeroed (class doc)."""
        top = min(top, self.num_blocks)
        if top > self.high_water:
            self.kv[:, :, :, self.high_water:top].zero_()
            self.high_water = top

    def layer_view(self, layer: int) -> torch.Tensor:
        """K and V of one layer, ``[2, H_kv, NB, B, D]`` (a view, no copy)."""
        return self.kv[layer]

    def token_index(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """``[T]`` flat token positions (``block * B + offset``) of a request's first T
        tokens in the store's ``[..., NB * B, D]`` view."""
        t = torch.arange(num_tokens, device=self.device)
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return blocks[t // self.block_size] * self.block_size + t % self.block_size

    def _check_fits(self, block_ids: list[int], num_tokens: int) -> None:
        if num_tokens > len(block_ids) * self.block_size:
            raise ValueError(f"KV of {num_tokens} tokens does not fit {len(block_ids)} blocks "
                             f"of {self.block_size} tokens")

    def _run(self, block_ids: list[int], num_tokens: int) -> slice | None:
        """The flat token slice of the first T tokens when their blocks are consecutive (no
        gather needed), else None."""
        needed = list(block_ids[:-(-num_tokens // self.block_size)])
        if needed and needed == list(range(needed[0], needed[0] + len(needed))):
            start = needed[0] * self.block_size
            return slice(start, start + num_tokens)
        return None

    def _flat(self) -> torch.Tensor:
        """``[L, 2, H_kv, NB * B, D]`` view of the store."""
        s = self.spec
        return self.kv.view(s.num_layers, 2, s.num_kv_heads, self.num_tokens, s.head_dim)

    def read(self, block_ids: list[int], num_tokens: int, layers: slice = slice(None),
             may_view: bool = False) -> torch.Tensor:
        """Copy out one request's KV: a new ``[L', 2, H_kv, T, D]``, contiguous; ValueError
        when T tokens do not fit ``block_ids``. ``may_view``: where the blocks are consecutive,
        a strided view of the store instead (no copy; valid until they are freed or written)."""
        self._check_fits(block_ids, num_tokens)
        run, flat = self._run(block_ids, num_tokens), self._flat()[layers]
        if run is not None:
            return flat[:, :, :, run] if may_view else flat[:, :, :, run].contiguous()
        return flat.index_select(3, self.token_index(block_ids, num_tokens))

    def write(self, block_ids: list[int], kv: torch.Tensor, layer_start: int = 0) -> None:
        """Place ``kv`` ``[L', 2, H_kv, T, D]`` into a request's blocks at tokens ``[0, T)``,
        layers ``[layer_start, layer_start + L')``; ValueError when its shape or dtype differs
        from the store's geometry, or T tokens do not fit ``block_ids``."""
        num_layers, _, heads, num_tokens, head_dim = kv.shape
        expected = self.spec.kv_shape(num_tokens, num_layers)
        if tuple(kv.shape) != expected or kv.dtype != self.spec.torch_dtype:
            raise ValueError(
                f"KV tensor mismatch: expected shape {expected} dtype {self.spec.torch_dtype}, "
                f"got {tuple(kv.shape)} {kv.dtype}"
            )
        if layer_start + num_layers > self.spec.num_layers:
            raise ValueError(f"KV layers {layer_start}+{num_layers} exceed the model's "
                             f"{self.spec.num_layers}")
        self._check_fits(block_ids, num_tokens)
        self.claim(max(block_ids) + 1)
        flat = self._flat()[layer_start:layer_start + num_layers]
        run = self._run(block_ids, num_tokens)
        if run is not None:
            flat[:, :, :, run].copy_(kv)
        else:
            flat.index_copy_(3, self.token_index(block_ids, num_tokens), kv.to(self.device))
