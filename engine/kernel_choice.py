"""Kernels chosen by measurement on the machine, cached per machine: which of MKL's sgemm, oneDNN
and pdlab's AVX2 and AVX-512 kernels is fastest depends on the CPU, the builds and the size, and
does not carry across CPUs. ``engine/ops.py`` asks a ``KernelSelector`` once per op and shape class
(e.g. ``linear 576x960``) which candidate to run per row-count bucket.

- Buckets: ``n`` rows fall in bucket ``ceil(log2 n)``, measured at ``2^i``; past the last, its
  choice holds (every candidate is compute bound there).
- Timing: ``measure_median_s``, medians over interleaved rounds, so load hits all alike.
- Cache: ``$PDLAB_CACHE_DIR/kernels/choices-<key>.json``, keyed by ``machine_key()``; a file with
  another key is rewritten. A choice measured under load sticks: delete the file to remeasure."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# ISA caps of oneDNN, MKL and pdlab's C build: a choice measured under one is invalid under another.
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "PDLAB_CPU_KERNELS_ISA")
# CPU flags named in the reports (the ones that decide which SIMD kernels exist).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")
ROUNDS = 7  # timed rounds per measurement, after one warm-up round (odd: a true median)
MIN_SAMPLE_S = 0.005  # shorter calls are repeated within one timed sample
# After this many rounds, candidates slower than the best by more than PRUNE_RATIO stop.
PRUNE_AFTER = 3
PRUNE_RATIO = 1.3
# The timing method, part of the cache key.
TIMER = (f"median-of-{ROUNDS}x{MIN_SAMPLE_S * 1e3:g}ms-rotated"
         f"-pruned-{PRUNE_AFTER}x{PRUNE_RATIO:g}")


def bucket(num_rows: int) -> int:
    """``ceil(log2 num_rows)`` for ``num_rows`` >= 1 (1 -> 0, 2 -> 1, 3..4 -> 2, ...)."""
    return (num_rows - 1).bit_length()


def choice_for(choices: dict[int, str], num_rows: int, max_bucket: int, default: str) -> str:
    """``choices`` at ``bucket(num_rows)``, the last measured bucket's beyond it; ``default`` when
    nothing was measured."""
    return choices[min(bucket(num_rows), max_bucket)] if choices else default


def cpu_info() -> dict[str, str]:
    """``{"model", "family", "model_id", "flags"}`` from /proc/cpuinfo, '' where unknown."""
    info = {"model": "", "family": "", "model_id": "", "flags": ""}
    names = {"model name": "model", "cpu family": "family", "model": "model_id",
             "flags": "flags"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block only
                key, _, value = line.partition(":")
                if key.strip() in names:
                    info[names[key.strip()]] = value.strip()
    except OSError:
        info["model"] = platform.processor()
    return info


def isa_summary(flags: str | None = None) -> str:
    """The SIMD features that decide the kernels, e.g. ``"avx2 fma avx512f avx512bw"``."""
    present = set((cpu_info()["flags"] if flags is None else flags).split())
    return " ".join(f for f in _ISA_FLAGS if f in present) or "none of " + "/".join(_ISA_FLAGS)


def machine_key(threads: int, kernels_build: str | None) -> dict[str, object]:
    """What a choice depends on besides the problem: the CPU (model, ids, a hash of its flags),
    torch's version and threads, the ISA caps, the C build and ``TIMER``."""
    import torch  # only here: the rest of this module is plain Python, testable without it

    cpu = cpu_info()
    return {"cpu_model": cpu["model"], "cpu_family": cpu["family"], "cpu_model_id": cpu["model_id"],
            "cpu_flags_sha": hashlib.sha256(cpu["flags"].encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": threads,
            "isa_env": {name: os.environ.get(name, "") for name in ISA_ENV},
            "kernels_build": kernels_build, "timer": TIMER}


def cache_path(key: dict[str, object], root: Path) -> Path:
    """``root/choices-<16 hex of the key's hash>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"choices-{digest}.json"


def measure_median_s(runs: dict[str, Callable[[], object]], rounds: int = ROUNDS,
                     min_sample_s: float = MIN_SAMPLE_S, prune_after: int = PRUNE_AFTER,
                     prune_ratio: float = PRUNE_RATIO) -> dict[str, float]:
    """Seconds of one call of each of ``runs``: the median of its samples, after one warm-up each.
    Round i of up to ``rounds`` starts at candidate ``i mod n``; after ``prune_after`` rounds a
    candidate over the best by more than ``prune_ratio`` leaves with its median so far. A call
    shorter than ``min_sample_s`` is repeated within a sample until it lasts that long.

    Raises:
        ValueError: ``rounds`` < 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    loops = {}
    for name in names:  # warm-up: also sizes each sample
        start = time.perf_counter()
        runs[name]()
        loops[name] = max(1, min(1000, int(min_sample_s / max(time.perf_counter() - start,
                                                                1e-7))))
    racing = list(names)
    for i in range(rounds):
        for name in racing[i % len(racing):] + racing[:i % len(racing)]:
            run, count = runs[name], loops[name]
            start = time.perf_counter()
            for _ in range(count):
                run()
            samples[name].append((time.perf_counter() - start) / count)
        if i + 1 >= prune_after:
            best = min(statistics.median(samples[name]) for name in racing)
            racing = [name for name in racing
                      if statistics.median(samples[name]) <= prune_ratio * best]
            if len(racing) == 1:
                break
    return {name: statistics.median(values) for name, values in samples.items()}


class KernelSelector:
    """Per (op, shape class): the fastest candidate per row-count bucket, kept in a JSON cache
    (``path`` None: in memory) under ``key``; ``timer``: ``runs -> seconds`` (tests fake it)."""

    def __init__(self, key: dict[str, object], path: Path | None,
                 timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]]
                 = measure_median_s) -> None:
        self.key, self.path, self.timer = key, path, timer
        self.choices: dict[str, dict[str, str]] = {}  # "op/shape" -> {bucket: candidate}
        self.measured_s = 0.0  # seconds this process spent measuring
        self._lock = threading.Lock()  # engines in threads of one process share a selector
        if path is not None and path.exists():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = {}
            if stored.get("key") == key:  # another CPU, build or cap: measured again
                self.choices = stored.get("choices", {})

    def choose(self, op: str, shape: str, buckets: list[int],
               candidates: dict[str, Callable[[int], Callable[[], object]]]) -> dict[int, str]:
        """``{bucket: candidate name}`` for ``op`` at ``shape`` (e.g. ``"576x960"``), from the cache
        or measured now for missing buckets. ``candidates``: name -> ``make(num_rows)`` returning
        the call to time at ``2^bucket`` rows; a cached name not among them is measured again.

        Raises:
            ValueError: no candidates."""
        if not candidates:
            raise ValueError(f"no candidate kernel for {op} {shape}")
        entry = f"{op}/{shape}"
        with self._lock:
            known = self.choices.setdefault(entry, {})
            missing = [b for b in buckets if known.get(str(b)) not in candidates]
            if len(candidates) == 1:  # nothing to measure
                for b in missing:
                    known[str(b)] = next(iter(candidates))
                return {b: known[str(b)] for b in buckets}
            if missing:
                start = time.perf_counter()
                for b in missing:
                    runs = {name: make(2 ** b) for name, make in candidates.items()}
                    seconds = self.timer(runs)
                    known[str(b)] = min(seconds, key=seconds.__getitem__)
                self.measured_s += time.perf_counter() - start
                self._save()
            return {b: known[str(b)] for b in buckets}

    def _save(self) -> None:
        """Write the cache atomically (temp file, rename); a failed write only loses the cache."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": self.key, "choices": self.choices}, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the machine's other users
            os.replace(tmp, self.path)
        except OSError:
            pass


def describe_buckets(choice: dict[int, str]) -> str:
    """``{0: "pdlab", ..., 8: "pdlab", 9: "mkl"}`` -> ``"1-256 pdlab, 257+ mkl"``."""
    items, parts, i = sorted(choice.items()), [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1][1] == items[i][1]:
            j += 1
        low, name = (1 if i == 0 else 2 ** items[i - 1][0] + 1), items[i][1]
        if j + 1 == len(items):
            parts.append(f"{low}+ {name}")
        else:
            high = 2 ** items[j][0]
            parts.append(f"{low} {name}" if low == high else f"{low}-{high} {name}")
        i = j + 1
    return ", ".join(parts)
