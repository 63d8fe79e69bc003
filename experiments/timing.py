"""The one timing estimator every pdlab measurement script uses: ``setup()`` (untimed), ``run()``
timed with ``time.perf_counter`` (on CUDA synchronized before start and stop), ``teardown()``
(untimed); one discarded warm-up, then ``repeats`` timed runs. The estimator is the **minimum**
(the run least disturbed by the machine), the median beside it; ``describe(repeats)`` names it."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

ESTIMATOR = "min of {n} runs after {w} warm-up; the median beside it"


@dataclass(frozen=True)
class Timing:
    """Seconds of ``num_runs`` timed runs: ``min_s`` (the estimator), ``median_s``, ``samples_s``."""

    min_s: float
    median_s: float
    num_runs: int
    samples_s: tuple[float, ...]


def describe(repeats: int, warmup: int = 1) -> str:
    """The estimator's name as printed beside every table."""
    return ESTIMATOR.format(n=repeats, w=warmup)


def device_sync(device: str) -> Callable[[], None] | None:
    """A callable that waits for ``device`` to finish queued work (CUDA), or None (CPU)."""
    if not device.startswith("cuda"):
        return None
    return lambda: torch.cuda.synchronize(device)


def measure(run: Callable[[], object], repeats: int, *,
            setup: Callable[[], object] | None = None,
            teardown: Callable[[], object] | None = None,
            warmup: int = 1, sync: Callable[[], None] | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """``Timing`` of ``repeats`` runs after ``warmup`` discarded ones; ``setup``, ``teardown``
    untimed around each; ``sync`` before starting and stopping the clock; ``clock`` seconds.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``."""
    _check_counts(repeats, warmup)
    samples_s: list[float] = []
    for i in range(warmup + repeats):
        elapsed_s = _timed(run, setup, sync, clock)
        if teardown is not None:
            teardown()
        if i >= warmup:
            samples_s.append(elapsed_s)
    return summarize(samples_s)


def _check_counts(repeats: int, warmup: int) -> None:
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def _timed(run: Callable[[], object], setup: Callable[[], object] | None,
           sync: Callable[[], None] | None, clock: Callable[[], float]) -> float:
    """One run: ``setup`` untimed, then seconds of ``run`` between two ``sync`` calls."""
    if setup is not None:
        setup()
    if sync is not None:
        sync()
    start_s = clock()
    run()
    if sync is not None:
        sync()
    return clock() - start_s


def measure_interleaved(points: dict, repeats: int, *, warmup: int = 1,
                        sync: Callable[[], None] | None = None,
                        clock: Callable[[], float] = time.perf_counter,
                        seed: int | None = 0,
                        on_run: Callable[[], object] | None = None) -> dict:
    """``measure`` in rounds: each round runs every point once (shuffled by ``seed``; None keeps
    ``points``' order), so a machine whose speed drifts within minutes moves every point alike
    instead of favouring those measured in a fast minute. ``points``: key -> ``(setup, run)``;
    ``on_run``: after every run. Returns key -> ``Timing``, in ``points``' order.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``."""
    _check_counts(repeats, warmup)
    rng = None if seed is None else random.Random(seed)
    samples_s: dict = {key: [] for key in points}
    for i in range(warmup + repeats):
        order = list(points)
        if rng is not None:
            rng.shuffle(order)
        for key in order:
            setup, run = points[key]
            elapsed_s = _timed(run, setup, sync, clock)
            if i >= warmup:
                samples_s[key].append(elapsed_s)
            if on_run is not None:
                on_run()
    return {key: summarize(v) for key, v in samples_s.items()}


def summarize(samples_s) -> Timing:
    """The estimator over timed runs collected elsewhere (e.g. across two processes).

    Raises:
        ValueError: no samples."""
    samples_s = tuple(float(s) for s in samples_s)
    if not samples_s:
        raise ValueError("summarize needs at least one timed run")
    return Timing(min(samples_s), statistics.median(samples_s), len(samples_s), samples_s)
