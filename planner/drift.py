"""The machine's speed over one real run, and its replay in the simulator (no torch).

A device profile is measured once; a shared machine's speed drifts within minutes. No offline
planner can predict that, but a validation can take it out of the comparison: the real run's own
steps say how fast the machine was at each moment, and the simulation of the same run is made to run
at that speed. What is left is the simulator's own error: the figure DistServe's "< 2 points" is
about.

1. Per real step (``diagnose.step_table``: its features from its recorded batch, the
   step model evaluated on exactly that batch): factor = measured ÷ modelled seconds.
2. ``speed_trace``: per worker, the run's time from its origin (the simulated clock's 0:
   a request's scheduled arrival minus its offset, ``run_origin``) cut into windows of
   ``window_s``; a window's factor is the median factor of the steps (whose batch agrees
   with their counts) that start in it; a window with no step keeps the last factor before
   it (the first windows, the first measured one's): speed persists while the worker idles.
3. ``SpeedTrace(worker, t_s)``: the factor at simulated time ``t_s``. The simulator
   multiplies each modelled step that starts at ``t_s`` by it (``Simulator(speed_trace=)``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from engine.metrics import ARRIVED, RequestRecord

# A window must hold enough steps for its median to average out one step's jitter, and be
# much shorter than the drift (tens of seconds); 5 s is the longest that still follows it.
DEFAULT_WINDOW_S = 5.0
ALL_WORKERS = "*"  # the trace of every worker's steps pooled: for a worker without steps


@dataclass(frozen=True)
class SpeedTrace:
    """Piecewise-constant step-speed factors over a run's time (module docstring, step 3).

    Attributes:
        window_s: width of every window (seconds); window ``i`` covers
            ``[i * window_s, (i + 1) * window_s)`` of the run's clock.
        factors: per worker name (and ``ALL_WORKERS``), one factor per window from 0; times
            before 0 take the first window's, times after the last window the last one's."""

    window_s: float
    factors: dict[str, tuple[float, ...]]

    def __call__(self, worker: str, t_s: float) -> float:
        """Measured ÷ modelled step time of ``worker`` at ``t_s`` (seconds on the run's
        clock); 1.0 when the trace has no step at all."""
        f = self.factors.get(worker) or self.factors.get(ALL_WORKERS)
        if not f:
            return 1.0
        i = int(t_s // self.window_s) if t_s > 0 else 0
        return f[i] if i < len(f) else f[-1]

    def table(self) -> pd.DataFrame:
        """``worker, window_start_s, factor``: one row per worker and window."""
        return pd.DataFrame([{"worker": w, "window_start_s": i * self.window_s, "factor": v}
                             for w, fs in self.factors.items() for i, v in enumerate(fs)],
                            columns=["worker", "window_start_s", "factor"])


def _windows(start_s: np.ndarray, ratio: np.ndarray, window_s: float) -> tuple[float, ...]:
    """Step 2 for one worker: per window the median ratio, gaps filled forward then back."""
    index = np.floor(np.maximum(start_s, 0.0) / window_s).astype(int)
    medians = pd.Series(ratio).groupby(index).median()
    full = medians.reindex(range(int(index.max()) + 1)).ffill().bfill()
    return tuple(float(v) for v in full)


def speed_trace(steps: pd.DataFrame, origin_s: float,
                window_s: float = DEFAULT_WINDOW_S) -> SpeedTrace:
    """Step 2: the speed trace of one run from its steps.

    Args:
        steps: ``diagnose.step_table`` of the run (``worker, start_s, rebuilt, ratio``;
            ``start_s`` on the same clock as ``origin_s``, wall seconds for a real run).
        origin_s: the run's clock 0 on that clock (``run_origin``).
        window_s: window width in seconds (``DEFAULT_WINDOW_S``: why 5 s).

    Returns:
        A ``SpeedTrace``; no usable step (none whose batch agrees, or none with a modelled time > 0):
        one with no factors (every factor 1.0).

    Raises:
        ValueError: ``window_s`` is not a finite number > 0."""
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"window_s must be a finite number > 0, got {window_s!r}")
    ok = steps[steps["rebuilt"].astype(bool) & np.isfinite(steps["ratio"].astype(float))
               & (steps["ratio"].astype(float) > 0)]
    factors: dict[str, tuple[float, ...]] = {}
    if len(ok):
        t = ok["start_s"].to_numpy(dtype=float) - origin_s
        ratio = ok["ratio"].to_numpy(dtype=float)
        workers = ok["worker"].to_numpy()
        for worker in dict.fromkeys(workers):
            mine = workers == worker
            factors[str(worker)] = _windows(t[mine], ratio[mine], window_s)
        factors[ALL_WORKERS] = _windows(t, ratio, window_s)
    return SpeedTrace(window_s, factors)


def run_origin(records: Sequence[RequestRecord], offsets_s: Sequence[float]) -> float:
    """A real run's clock 0 (wall seconds): the router stamps ``arrived`` = start + the request's
    scheduled offset (``Router.run``), so start = arrived - offset, the median over the run's
    requests. A record's offset is ``offsets_s[i]`` for the request at position ``i`` of its
    workload (the ``-<i>`` its id ends with).

    Raises:
        ValueError: no record has an arrival and an offset."""
    starts = []
    for r in records:
        i = int(r.request_id.rsplit("-", 1)[-1])
        if ARRIVED in r.timeline and 0 <= i < len(offsets_s):
            starts.append(r.timeline[ARRIVED] - float(offsets_s[i]))
    if not starts:
        raise ValueError("no record with an arrival time and a workload offset: no origin")
    return float(np.median(starts))
