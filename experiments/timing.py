"""The one timing estimator every pdlab measurement script uses.

A measurement:

1. ``setup()`` (untimed) prepares one run, e.g. queues a request in an engine.
2. ``run()`` is timed with ``time.perf_counter`` (on CUDA the device is synchronized before
   the clock starts and before it stops, so queued kernels are counted).
3. ``teardown()`` (untimed) cleans up after the run.
4. One warm-up run comes first and is discarded; then ``repeats`` timed runs.

The estimator is the **minimum** of the timed runs (the run least disturbed by the rest of the
machine); the median is reported beside it to show the spread. Output names it with
``describe(repeats)``: "min of N runs after 1 warm-up; the median beside it"."""

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
    """Seconds of ``num_runs`` timed runs of one callable.

    Attributes:
        min_s: the estimator (fastest run).
        median_s: the median run, shown beside it.
        num_runs: timed runs (warm-up excluded).
        samples_s: every timed run, in order."""

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
    """Time ``run`` ``repeats`` times after ``warmup`` discarded runs.

    Args:
        run: the callable to time.
        repeats: timed runs (>= 1).
        setup, teardown: untimed, called before / after every run (warm-up included).
        warmup: discarded runs first (>= 0).
        sync: called before starting and before stopping the clock (``device_sync``).
        clock: seconds as a float (``time.perf_counter``; tests pass a fake clock).

    Returns:
        ``Timing`` with min (the estimator) and median of the timed runs.

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
    """Time several measurements in rounds instead of one after another.

    ``measure`` runs a point's warm-up and repeats back to back, so a machine whose speed drifts
    within minutes (a shared VM) gives the points measured in a fast minute a faster time than the
    rest, and a model fitted on several sweeps measured minutes apart (prefill, then decode)
    inherits that. Here every round runs each point once, in an order shuffled per round
    (``random.Random(seed)``); the first ``warmup`` rounds are discarded. Each point's samples are
    then spread over the whole measurement, and a drift moves every point alike.

    Args:
        points: key -> ``(setup, run)``: ``setup`` (untimed, may be None) then ``run``
            (timed), as ``measure``'s; the point's own state carries over between rounds.
        repeats, warmup, sync, clock: as ``measure``'s.
        seed: the shuffle's seed; None: no shuffle, every round in the order of ``points``
            (the benchmarks' contenders side by side, ``benchmarks.measure_interleaved``).
        on_run: called after every run (warm-up included), e.g. a progress bar's update.

    Returns:
        key -> ``Timing`` of its ``repeats`` timed runs, in the order of ``points``.

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
