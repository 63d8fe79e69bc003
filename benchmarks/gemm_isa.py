"""Which ISA a side's GEMM libraries run on this CPU, read from their own verbose output:
``probe(python, env)`` starts ``python benchmarks/gemm_isa.py`` with
``ONEDNN_VERBOSE=profile_create`` and ``MKL_VERBOSE=1`` added to ``env`` and parses what
oneDNN and MKL print.

The child (``__main__``, run by pdlab's or vLLM's interpreter, importing no pdlab module)
creates and runs one oneDNN matmul the way that side does (vLLM: its own ``onednn_mm`` from
``vllm._custom_ops``, which links vLLM's oneDNN build; pdlab: torch's packed
``mkldnn._linear_pointwise``) and one ``torch.mm`` (MKL's sgemm). oneDNN names its ISA in
an ``info,cpu,isa:`` line and its kernel in each primitive-creation line (e.g.
``brg:avx2``); MKL names the instruction set it enabled in its version line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

_ONEDNN_ISA = re.compile(r"info,cpu,isa:([^,\n]+)")
_ONEDNN_IMPL = re.compile(r"(?:create|exec)[^,]*,cpu,(?:inner_product|matmul),([^,]+),")
# "... for Intel(R) 64 architecture Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2)
# enabled processors, ..." on Intel; "... architecture Intel(R) Architecture processors" (no
# ISA named: MKL's generic path) on AMD
_MKL_ISA = re.compile(r"64 architecture (.+?)(?: enabled)? processors")
_PATH = re.compile(r"gemm_isa oneDNN via (\S+)")


def parse(text: str) -> dict[str, str]:
    """``{"onednn_via", "onednn_isa", "onednn_kernel", "mkl_isa"}`` from verbose output ('?'
    where a library printed nothing recognisable)."""
    def first(pattern: re.Pattern) -> str:
        found = pattern.search(text)
        return found.group(1).strip() if found else "?"
    kernels = sorted(set(_ONEDNN_IMPL.findall(text)))
    return {"onednn_via": first(_PATH), "onednn_isa": first(_ONEDNN_ISA),
            "onednn_kernel": " ".join(kernels) or "?", "mkl_isa": first(_MKL_ISA)}


def probe(python: str | Path, env: dict[str, str], timeout_s: float = 300.0) -> dict[str, str]:
    """Run the child under ``python`` with ``env`` plus the verbose switches; its parse."""
    env = dict(env, ONEDNN_VERBOSE="profile_create", MKL_VERBOSE="1")
    try:
        proc = subprocess.run([str(python), __file__], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"onednn_via": "?", "onednn_isa": f"? ({e})", "onednn_kernel": "?",
                "mkl_isa": "?"}
    return parse(proc.stdout + proc.stderr)


def _child() -> int:
    torch.set_num_threads(1)
    weight, x = torch.randn(960, 576), torch.randn(16, 576)
    try:  # vLLM's interpreter: its own oneDNN matmul, as its CPU linear dispatch builds it
        from vllm import _custom_ops as ops

        handler = ops.create_onednn_mm(weight.t(), 32)
        ops.onednn_mm(handler, x, None)
        print("gemm_isa oneDNN via vllm.onednn_mm", file=sys.stderr)
    except ImportError:  # pdlab's: torch's packed oneDNN linear (engine/ops.py)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        print("gemm_isa oneDNN via torch.mkldnn", file=sys.stderr)
    torch.mm(x, weight.t())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.exit(_child())
