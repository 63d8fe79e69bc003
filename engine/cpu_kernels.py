"""Fused CPU float32 kernels (``engine/cpu_kernels.c``), built on first use with the system C
compiler and called through ctypes, single-threaded on the calling thread: ``add_rms_norm``,
``silu_mul``, ``rope_kv``; ``linear`` / ``linear512`` on weights packed once into column panels
(BLIS's Haswell 6 x 16 AVX2/FMA blocking; 12 x 32 AVX-512, bit-equal, where the CPU has avx512f);
``causal_attention`` / ``causal_attention512`` for a prompt chunk; ``decode_attention`` (paged).

Build: ``cc -O3 -march=native -ffp-contract=off -fno-trapping-math -fno-math-errno -shared -fPIC``
(nothing that changes a result; ``$CC`` overrides ``cc``) into
``$PDLAB_CACHE_DIR/kernels/<hash>/``, the hash covering source, command and machine.
``PDLAB_CPU_KERNELS_ISA=avx2`` leaves AVX-512 out; ``avx512-emulated`` (tests) builds it on SIMDe.
``load()`` returns None (torch's kernels then run) when ``PDLAB_CPU_KERNELS=0`` or the build or
load fails (one warning says why). The wrappers refuse (``ValueError``) anything but float32 CPU
tensors in the layouts their docstrings give."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from engine.model import cache_dir  # transformers is imported there only lazily

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ENV_SWITCH = "PDLAB_CPU_KERNELS"  # "0": never build or use the kernels
ISA_ENV = "PDLAB_CPU_KERNELS_ISA"  # "avx2": no AVX-512 in the build; unset/"native": -march only
# avx512-emulated: SIMDe's portable intrinsics, so kernel tests run on a CPU without avx512f.
EMULATED_AVX512 = "avx512-emulated"
_ISA_CAPS = {"": (), "native": (), "avx2": ("-mno-avx512f", "-DPD_NO_AVX512"),
             EMULATED_AVX512: ("-DPD_EMULATE_AVX512", "-Wno-psabi")}
SIMDE_ENV = "PDLAB_SIMDE_INCLUDE"  # SIMDe's include folder for the avx512-emulated build
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno",
          "-shared", "-fPIC")
_LIBRARY = "libpdlab_kernels.so"
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "pd_add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "pd_rope_kv": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                   _ptr, _ptr, _i64, _ptr],
    "pd_silu_mul": [_ptr, _ptr, _i64, _i64],
    "pd_pack_linear": [_ptr, _ptr, _i64, _i64],
    "pd_linear": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64],
    "pd_pack_linear_width": [_ptr, _ptr, _i64, _i64, _i64],
    "pd_linear512": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr],
    "pd_causal_attention": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                            _f32, _ptr, _ptr, _ptr, _ptr],
    "pd_causal_attention512": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                               _f32, _ptr, _ptr, _ptr, _ptr],
    "pd_paged_decode_attention": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr,
                                  _i64, _i64, _i64, _i64, _f32, _ptr, _ptr],
}
PANEL = 16  # output columns per packed weight panel (PD_PANEL in cpu_kernels.c)
PANEL512 = 32  # the same for the AVX-512 kernel (PD_PANEL512)


def enabled() -> bool:
    """False when ``$PDLAB_CPU_KERNELS`` is ``0``."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def simde_include() -> Path:
    """SIMDe's include folder: ``$PDLAB_SIMDE_INCLUDE``, else ``$PDLAB_CACHE_DIR/simde/include``
    (where ``tests/fetch_simde.py`` puts it)."""
    return Path(os.environ.get(SIMDE_ENV) or cache_dir() / "simde" / "include")


def has_simde(include: Path) -> bool:
    """``include`` holds SIMDe's AVX-512 header (what the ``avx512-emulated`` build needs)."""
    return (include / "simde" / "x86" / "avx512.h").is_file()


def build(compiler: str | None = None, extra_flags: tuple[str, ...] = (),
          source_path: Path = SOURCE) -> Path:
    """Compile ``source_path`` into the cache (once per source/command/machine); returns the
    library's path. ``extra_flags`` follow the standard ones.

    Raises:
        RuntimeError: no compiler, or it failed (its stderr in the message); or the
            ``avx512-emulated`` build without SIMDe's headers."""
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC)")
    cap = os.environ.get(ISA_ENV, "").lower()
    if cap not in _ISA_CAPS:
        raise RuntimeError(f"${ISA_ENV}={cap!r}: expected one of {sorted(k for k in _ISA_CAPS if k)}")
    source = source_path.read_bytes()
    flags = (*_FLAGS, *_ISA_CAPS[cap], *extra_flags)
    if cap == EMULATED_AVX512:
        include = simde_include()
        if not has_simde(include):
            raise RuntimeError(f"${ISA_ENV}={EMULATED_AVX512} needs SIMDe's headers in {include} "
                               f"(tests/fetch_simde.py fetches them; or set ${SIMDE_ENV})")
        flags += (f"-I{include}",)
    key = hashlib.sha256(source + " ".join((compiler, *flags, platform.machine(),
                                            _cpu_flags())).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / key / _LIBRARY
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent first uses never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, "-o", tmp, str(source_path), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Kernels:
    """The loaded library; each method is one C call on float32 CPU tensors. Shared by every
    runner of the process, so no method keeps state between calls (engines in threads call it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        lib.pd_linear_vectorized.restype = ctypes.c_int
        lib.pd_paged_decode_attention.restype = ctypes.c_int
        lib.pd_linear512.restype = ctypes.c_int
        lib.pd_causal_attention.restype = ctypes.c_int
        lib.pd_causal_attention512.restype = ctypes.c_int
        lib.pd_linear512_available.restype = ctypes.c_int
        self._norm, self._rope_kv, self._silu_mul = (lib.pd_add_rms_norm, lib.pd_rope_kv,
                                                     lib.pd_silu_mul)
        self._pack_linear, self._linear = lib.pd_pack_linear, lib.pd_linear
        self._decode_attention = lib.pd_paged_decode_attention
        # False where the build lacks AVX2 + FMA: ``linear`` is scalar C and torch's kernels run.
        self.linear_vectorized = bool(lib.pd_linear_vectorized())
        self._pack_width, self._linear512 = lib.pd_pack_linear_width, lib.pd_linear512
        # avx512f here (cpuid) and the AVX-512 GEMM built; ``linear512`` is refused otherwise.
        self.linear_avx512 = bool(lib.pd_linear512_available())
        # the chunk attention on each GEMM's blocks: (C function, panel width, most rows)
        self._causal = {False: (lib.pd_causal_attention, PANEL, 6),
                        True: (lib.pd_causal_attention512, PANEL512, 12)}

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``hidden += delta`` in place (if given), then RMSNorm of each row: ``weight * (hidden *
        rsqrt(mean(hidden^2, -1) + eps))`` (transformers' ``LlamaRMSNorm``; Gemma's ``(1 + w)``
        folded into ``weight``). ``hidden``, ``delta``: ``[N, H]``; ``weight``: ``[H]``. Returns a
        new ``[N, H]`` tensor."""
        _check(hidden, weight, *(() if delta is None else (delta,)))
        out = torch.empty_like(hidden)
        rows, dim = hidden.shape
        self._norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                   out.data_ptr(), weight.data_ptr(), rows, dim, eps)
        return out

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor) -> None:
        """RoPE (rotate_half, full rotary) on ``q`` in place and on ``k``; the rotated k and ``v``
        written into ``kv_layer`` ``[2, H_kv, NB, B, D]`` (contiguous) at the flat positions
        ``slots`` ``[N]`` int64 (``block * B + offset``, distinct). ``q``: ``[N, H_q, D]``, ``k``,
        ``v``: ``[N, H_kv, D]``, rows of any stride, each head contiguous; ``cos``, ``sin``:
        ``[N, D]`` contiguous."""
        n, hq, d = q.shape
        hkv = k.shape[1]
        for t in (q, k, v):
            if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride()[1:] != (d, 1):
                raise ValueError("rope_kv needs float32 CPU q/k/v with contiguous heads")
        _check(cos, sin, kv_layer)
        if (slots.dtype != torch.int64 or slots.device.type != "cpu"
                or not slots.is_contiguous() or slots.shape != (n,)):
            raise ValueError("rope_kv needs [N] contiguous int64 CPU slots")
        head_stride = kv_layer.stride(1)
        base = kv_layer.data_ptr()
        self._rope_kv(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                      v.stride(0), cos.data_ptr(), sin.data_ptr(), n, hq, hkv, d,
                      base, base + kv_layer.stride(0) * 4, head_stride, slots.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[N, 2 I]`` contiguous (gate then up) -> ``[N, I]``
        (SwiGLU, Shazeer 2020, with ``silu(g) = g / (1 + e^-g)`` as torch computes it)."""
        _check(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [n, k]`` (contiguous float32 CPU) -> its panels for ``linear``: a new ``[ceil(n
        / 16), k, 16]`` tensor (``PANEL`` columns each, zero padded).

        Raises:
            ValueError: another dtype/device, or not contiguous."""
        _check(weight)
        n, k = weight.shape
        panels = weight.new_empty(-(-n // PANEL), k, PANEL)
        self._pack_linear(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def linear(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
               out_features: int, prefetch: bool = True) -> torch.Tensor:
        """``x @ W.T + bias`` (``F.linear``) on ``W``'s ``pack_linear`` panels, to float32 rounding
        (the sum over ``k`` runs in order). ``x``: ``[m, k]`` float32 CPU, each row contiguous;
        ``bias``: ``[out_features]`` or None; ``prefetch``: the next panel in software (False:
        hardware prefetcher alone), same results. Returns a new ``[m, out_features]`` tensor.

        Raises:
            ValueError: other dtypes/devices, a non-contiguous row, or sizes that do not match."""
        m, k = x.shape
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
                or panels.shape[1:] != (k, PANEL) or panels.shape[0] * PANEL < out_features):
            raise ValueError(f"linear needs float32 CPU rows of {panels.shape[1]} features "
                             f"matching the panels, got {tuple(x.shape)} {x.dtype}")
        _check(panels, *(() if bias is None else (bias,)))
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"linear's bias must be [{out_features}], got {tuple(bias.shape)}")
        out = x.new_empty(m, out_features)
        self._linear(x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), out_features,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), int(prefetch))
        return out

    def pack_linear512(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [n, k]`` -> its panels for ``linear512``: ``[ceil(n / 32), k, 32]``, zero padded.

        Raises:
            ValueError: another dtype/device, or not contiguous."""
        _check(weight)
        n, k = weight.shape
        panels = weight.new_empty(-(-n // PANEL512), k, PANEL512)
        self._pack_width(weight.data_ptr(), panels.data_ptr(), n, k, PANEL512)
        return panels

    def linear512(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
        """``linear`` with the AVX-512 kernel on ``pack_linear512`` panels, equal bit for bit.

        Raises:
            ValueError: as ``linear``; or this CPU/build has no AVX-512 (``linear_avx512``)."""
        if not self.linear_avx512:
            raise ValueError("linear512 needs a CPU with avx512f and a build that keeps it "
                             f"(not ${ISA_ENV}=avx2)")
        m, k = x.shape
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1
                or panels.shape[1:] != (k, PANEL512) or panels.shape[0] * PANEL512 < out_features):
            raise ValueError(f"linear512 needs float32 CPU rows of {panels.shape[1]} features "
                             f"matching the panels, got {tuple(x.shape)} {x.dtype}")
        _check(panels, *(() if bias is None else (bias,)))
        if bias is not None and bias.shape != (out_features,):
            raise ValueError(f"linear512's bias must be [{out_features}], got {tuple(bias.shape)}")
        out = x.new_empty(m, out_features)
        if self._linear512(x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), out_features,
                           None if bias is None else bias.data_ptr(), out.data_ptr()):
            raise ValueError("linear512: this CPU has no avx512f")
        return out

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         start: int, scale: float) -> torch.Tensor:
        """``causal_attention512`` on the AVX2 GEMM blocks (6 x 16): the same arguments, result and
        errors, where the build targets AVX2 + FMA (``linear_vectorized``)."""
        if not self.linear_vectorized:
            raise ValueError("causal_attention needs a build for AVX2 + FMA")
        return self._causal_attention(q, k, v, start, scale, avx512=False)

    def causal_attention512(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            start: int, scale: float) -> torch.Tensor:
        """Causal attention of one prompt chunk with the AVX-512 GEMM blocks: query ``i`` (position
        ``start + i``) attends to keys ``0 .. start + i`` (GQA: query head ``h * G + g`` reads KV
        head ``h``), ``softmax(scale * q K^T) V``, as SDPA with a lower-right causal mask.
        ``q``: ``[n, H_q, D]`` float32 CPU, heads contiguous; ``k``, ``v``: ``[H_kv, start + n, D]``,
        each head's rows contiguous, the same strides; ``start``: the cached prefix's length.
        Returns a new ``[n, H_q, D]`` tensor.

        Raises:
            ValueError: another layout or sizes that do not match, or no AVX-512 here."""
        if not self.linear_avx512:
            raise ValueError("causal_attention512 needs a CPU with avx512f and a build that "
                             f"keeps it (not ${ISA_ENV}=avx2)")
        return self._causal_attention(q, k, v, start, scale, avx512=True)

    def _causal_attention(self, q, k, v, start, scale, avx512: bool) -> torch.Tensor:
        name = "causal_attention512" if avx512 else "causal_attention"
        n, hq, d = q.shape
        hkv, ctx, kd = k.shape
        if (q.dtype != torch.float32 or q.device.type != "cpu" or q.stride()[1:] != (d, 1)
                or k.dtype != torch.float32 or v.dtype != torch.float32
                or k.device.type != "cpu" or v.device.type != "cpu"
                or k.shape != v.shape or k.stride() != v.stride() or k.stride()[1:] != (d, 1)
                or kd != d or hq % hkv or ctx != start + n or start < 0):
            raise ValueError(f"{name} needs float32 CPU q [n, H_q, D] and k/v "
                             f"[H_kv, start + n, D] with contiguous rows, got q "
                             f"{tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                             f"start {start}")
        fn, width, max_rows = self._causal[avx512]
        panels = -(-ctx // width)
        kpack = q.new_empty(panels * d * width)
        vpack = q.new_empty(-(-d // width) * ctx * width)
        scores = q.new_empty(max_rows * panels * width)
        out = q.new_empty(n, hq, d)
        if fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), n, start,
              hkv, hq // hkv, d, scale, kpack.data_ptr(), vpack.data_ptr(), scores.data_ptr(),
              out.data_ptr()):
            raise ValueError(f"{name}: this CPU or build lacks its ISA")
        return out


    def decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor,
                         block_tables: torch.Tensor, lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Paged attention of one query token per request, K/V read in place through its block
        table (GQA: query head ``h * G + g`` reads KV head ``h``): ``softmax(scale * q K^T) V`` over
        row r's first ``lens[r]`` tokens, as SDPA over the gathered K/V with a key-padding mask.
        ``q``: ``[n, H_q, D]`` float32, heads contiguous; ``kv_layer``: ``[2, H_kv, NB, B, D]``
        contiguous; ``block_tables``: ``[n, max_blocks]`` int64 (token t in block
        ``block_tables[r, t // B]``); ``lens``: ``[n]`` int64. Returns a new ``[n, H_q, D]``.

        Raises:
            ValueError: other dtypes/devices or layouts, a length outside ``1 .. max_blocks * B``,
                or a block it would read outside ``0 .. NB - 1``."""
        n, hq, d = q.shape
        _check(kv_layer)
        _, hkv, num_blocks, block_size, kv_d = kv_layer.shape
        if (q.dtype != torch.float32 or q.device.type != "cpu" or q.stride()[1:] != (d, 1)
                or kv_d != d or hq % hkv):
            raise ValueError(f"decode_attention needs float32 CPU q [n, H_q, D] with "
                             f"contiguous heads matching the store's [2, {hkv}, NB, B, "
                             f"{kv_d}], got {tuple(q.shape)} strides {q.stride()}")
        for name, t, shape in (("block_tables", block_tables, (n, block_tables.shape[-1])),
                               ("lens", lens, (n,))):
            if (t.dtype != torch.int64 or t.device.type != "cpu" or t.shape != shape
                    or not t.is_contiguous()):
                raise ValueError(f"decode_attention needs contiguous int64 CPU {name} with "
                                 f"{n} rows, got {t.dtype} {tuple(t.shape)}")
        group, max_blocks = hq // hkv, block_tables.shape[1]
        # per call: one Kernels instance is shared by the engines of a process' threads
        scores = q.new_empty(group * max_blocks * block_size)
        out = q.new_empty(n, hq, d)
        if self._decode_attention(q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(),
                                  kv_layer[1].data_ptr(), kv_layer.stride(1), num_blocks, block_size,
                                  block_tables.data_ptr(), max_blocks, lens.data_ptr(), n, hkv,
                                  group, d, scale, scores.data_ptr(), out.data_ptr()):
            raise ValueError(f"decode_attention: lengths must be in 1 .. {max_blocks * block_size}"
                             f" and blocks in 0 .. {num_blocks - 1}, got lengths "
                             f"{lens.tolist()}, tables {block_tables.tolist()}")
        return out


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"cpu kernels need contiguous float32 CPU tensors, got "
                             f"{t.dtype} {t.device} contiguous={t.is_contiguous()}")


_LOADED: dict[str, Kernels | None] = {}


def load() -> Kernels | None:
    """The kernels (built and loaded once per process), or None where disabled or unbuildable."""
    if not enabled():
        return None
    if "kernels" not in _LOADED:
        try:
            _LOADED["kernels"] = Kernels(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            warnings.warn(f"pdlab CPU kernels unavailable, using the PyTorch path: {e}",
                          RuntimeWarning, stacklevel=2)
            _LOADED["kernels"] = None
    return _LOADED["kernels"]
