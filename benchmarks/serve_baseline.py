"""``make vllm-baseline``: the same ShareGPT workload, over streaming HTTP, against vLLM's CPU
OpenAI server and against ``pdlab serve`` (colocated:1 and disagg:1p1d), one after the other
on the same cores, then one comparison report (``experiments.commands.bench.merge``).

For each system: start its server as a subprocess (``taskset`` to the benchmark cores), wait
for ``/v1/models`` to answer (vLLM compiles first: minutes), run ``pdlab bench`` against it
(``experiments.commands.bench.bench``), stop it (SIGTERM to its process group, SIGKILL after 20 s).

vLLM runs as ``benchmarks/vllm_peer.py`` runs it: fp32, prefix caching off, the SmolLM2
directory pdlab caches, ``VLLM_CPU_OMP_THREADS_BIND`` = the benchmark cores, and
``--enforce-eager`` (no graph capture) with ``-O0`` (no torch.compile / inductor pass), so
its first start takes about a minute instead of several; both cost vLLM some decode speed,
say so when quoting the table. pdlab colocated:1 gets all the cores as one device
(``cpu:0-1``), disagg:1p1d one core per worker (``cpu:0,cpu:1``).

Usage: ``python -m benchmarks.serve_baseline [--systems vllm,colocated,disagg]
[--num-requests 8] [--rates 0.5] [--out results/vllm-baseline]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from engine.config import ModelConfig
from engine.metrics import SLO
from engine.model import SMOLLM2_NAME, cache_dir
from experiments.commands import bench
from experiments.workload_spec import WorkloadSpec

from experiments.report import format_table

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
SYSTEMS = ("vllm", "colocated", "disagg")
MAX_MODEL_LEN = 2048


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def server_command(system: str, port: int, cores: list[int], vllm_python: Path = VLLM_PYTHON,
                   vllm_compile: bool = False, vllm_extra: tuple[str, ...] = ()
                   ) -> tuple[list[str], dict]:
    """(argv, env) of one system's server on ``port``; ``vllm_compile``: vLLM's default
    compilation instead of ``--enforce-eager -O0``; ``vllm_extra``: more vLLM options."""
    taskset = ["taskset", "-c", ",".join(map(str, cores))]
    if system == "vllm":
        env = dict(os.environ, VLLM_USE_AOT_COMPILE="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
                   OMP_NUM_THREADS=str(len(cores)), TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)  # pdlab's torch/transformers must not shadow vLLM's
        model = cache_dir() / "models" / SMOLLM2_NAME
        fast_start = [] if vllm_compile else ["--enforce-eager", "-O0"]
        return taskset + [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server",
                          "--model", str(model), "--served-model-name", SMOLLM2_NAME,
                          "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                          "--no-enable-prefix-caching", "--host", "127.0.0.1",
                          "--port", str(port)] + fast_start + list(vllm_extra), env
    placement, devices = {"colocated": ("colocated:1", f"cpu:{cores[0]}-{cores[-1]}"),
                          "disagg": ("disagg:1p1d", f"cpu:{cores[0]},cpu:{cores[-1]}")}[system]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return taskset + [sys.executable, "-m", "experiments.cli", "serve", "--placement", placement,
                      "--devices", devices, "--model", SMOLLM2_NAME, "--port", str(port),
                      "--max-model-len", str(MAX_MODEL_LEN), "--transport", "shm",
                      "--no-enable-prefix-caching"], env  # off on both sides, as vLLM's


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until ``/v1/models`` answers. Raises RuntimeError: the server died or timed out."""
    end_s = time.monotonic() + timeout_s
    while time.monotonic() < end_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} did not come up within {timeout_s} s")


@contextlib.contextmanager
def running_server(argv_: list[str], env: dict, url: str, log_path: Path,
                   timeout_s: float) -> Iterator[subprocess.Popen]:
    """``argv_`` started in its own session, its output into ``log_path``, until ``url``'s
    ``/v1/models`` answers (``wait_ready``); stopped with its process group on exit.

    Raises:
        RuntimeError: the server exited or did not come up within ``timeout_s`` seconds.
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv_, env=env, cwd=str(REPO_ROOT), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            start_s = time.monotonic()
            wait_ready(url, proc, timeout_s)
            print(f"   up after {time.monotonic() - start_s:.0f} s", flush=True)
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_baseline")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--rates", default="0.5")
    parser.add_argument("--max-output-len", type=int, default=32)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--start-timeout-s", type=float, default=1200.0)
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON,
                        help="python of vLLM's virtualenv (default: .venv-vllm, make vllm-venv)")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="vLLM's default torch.compile (first start: minutes) instead of "
                             "--enforce-eager -O0")
    parser.add_argument("--vllm-extra", default="",
                        help="more vLLM server options, one string (e.g. "
                             "'--distributed-executor-backend uni')")
    parser.add_argument("--vllm-name", default=None,
                        help="NAME of vLLM's label NAME@colocated:1 (default: vllm, or "
                             "vllm-compiled with --vllm-compile)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "vllm-baseline")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        parser.error(f"--systems must name some of {SYSTEMS}, got {args.systems!r}")
    if "vllm" in systems and not args.vllm_python.exists():
        parser.error(f"{args.vllm_python} is missing: run `make vllm-venv` first")
    rates = [float(r) for r in args.rates.split(",")]
    spec = WorkloadSpec(dataset="sharegpt", num_requests=args.num_requests, seeds=args.seeds,
                        min_prompt_len=64, max_prompt_len=256, max_output_len=args.max_output_len)
    slo = SLO(2.0, 0.1)
    cores = _cores()
    url = f"http://127.0.0.1:{args.port}"
    dirs = []
    for system in systems:
        argv_, env = server_command(system, args.port, cores, args.vllm_python, args.vllm_compile,
                                    tuple(shlex.split(args.vllm_extra)))
        vllm_name = args.vllm_name or ("vllm-compiled" if args.vllm_compile else "vllm")
        label = {"vllm": f"{vllm_name}@colocated:1", "colocated": "pdlab@colocated:1",
                 "disagg": "pdlab@disagg:1p1d"}[system]
        print(f"== {label}: {' '.join(argv_)}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        with running_server(argv_, env, url, args.out / f"server-{system}.log",
                            args.start_timeout_s):
            out = args.out / system
            bench.bench(bench.BenchConfig(base_url=url, label=label, served_model=SMOLLM2_NAME),
                        spec, ModelConfig(SMOLLM2_NAME), MAX_MODEL_LEN, rates, slo, out)
            dirs.append(out)
    summary, verdict = bench.merge(dirs, args.out / "comparison", slo)
    print(format_table(summary))
    print()
    print(verdict)
    print(f"\nResults: {args.out}/comparison/ (report.md, summary.csv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
