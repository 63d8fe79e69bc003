"""Every CPU-parity figure on this machine, in one command (``make cpu-parity``).

The engine's speed against vLLM's CPU build is a per-machine claim: kernels are chosen by
measurement on each CPU (``engine/kernel_choice.py``). This runs each parity benchmark, one
after another on the last core (``taskset``), and writes each one's output to
``OUT/<step>.txt`` beside ``OUT/lscpu.txt``:

- ``vs_vllm-native``, ``vs_vllm-avx2``: ``benchmarks.vs_vllm --repeats 3`` under both ISAs
  (every row <= 1.0);
- ``prefill_scaling-native``, ``-avx2``: pdlab/vLLM <= 1.0 at every P from 128 to 2048;
- ``roofline``: ``benchmarks.roofline --quick`` (decode B=1 within 1.5x of its memory floor,
  prefill 256 within 1.1x of its compute floor);
- ``prefix_cache``: ``benchmarks.prefix_cache --repeats 2`` (hit rates within 1 point of
  vLLM's, time <= 1.0);
- ``host_memory``: glibc's malloc thresholds raised or not (``engine/host_memory.py``);
- ``kernel_tests``: the kernel tests, every candidate the selector can pick here
  (``tests/integration/test_cpu_kernels.py``, ``test_linear_kernels.py``,
  ``tests/unit/test_kernel_choice.py``).

Prints each step's last lines as it ends. The figures mean something only on an idle machine.

    python -m benchmarks.cpu_parity [--out DIR] [--only STEP ...]

Needs ``.venv-vllm`` (``make vllm-venv``) or ``$PDLAB_VLLM_VENV``; exits 1 if a step failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import vllm_peer

STEPS = {
    "vs_vllm-native": ["-m", "benchmarks.vs_vllm", "--repeats", "3", "--isa", "native"],
    "vs_vllm-avx2": ["-m", "benchmarks.vs_vllm", "--repeats", "3", "--isa", "avx2"],
    "prefill_scaling-native": ["-m", "benchmarks.prefill_scaling", "--isa", "native"],
    "prefill_scaling-avx2": ["-m", "benchmarks.prefill_scaling", "--isa", "avx2"],
    "roofline": ["-m", "benchmarks.roofline", "--quick"],
    "prefix_cache": ["-m", "benchmarks.prefix_cache", "--repeats", "2"],
    "host_memory": ["-m", "benchmarks.host_memory"],
    "kernel_tests": ["-m", "pytest", "-q", "tests/integration/test_cpu_kernels.py",
                     "tests/integration/test_linear_kernels.py",
                     "tests/unit/test_kernel_choice.py"],
}
TAIL_LINES = 12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output directory (default: "
                        "results/cpu-parity/<UTC time>)")
    parser.add_argument("--only", nargs="+", choices=list(STEPS), help="run these steps only")
    args = parser.parse_args(argv)
    if not vllm_peer.available():
        print(f"{vllm_peer.VENV_PYTHON} not found: run `make vllm-venv` first")
        return 2
    out = args.out or Path("results/cpu-parity") / time.strftime("%Y%m%d-%H%M", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    (out / "lscpu.txt").write_text(lscpu)
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "unknown CPU")
    core = str(sorted(os.sched_getaffinity(0))[-1])
    print(f"{model}; each step pinned to core {core}; outputs in {out}/")
    failed = []
    for name in args.only or STEPS:
        start = time.monotonic()
        with open(out / f"{name}.txt", "w") as f:
            rc = subprocess.run(["taskset", "-c", core, sys.executable, *STEPS[name]],
                                stdout=f, stderr=subprocess.STDOUT).returncode
        lines = [line for line in (out / f"{name}.txt").read_text().splitlines()
                 if not line.startswith("Loading")]
        print(f"== {name} ({time.monotonic() - start:.0f} s, exit {rc})")
        print("\n".join(lines[-TAIL_LINES:]))
        if rc:
            failed.append(name)
    print(f"failed: {', '.join(failed)}" if failed else "every step ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
