"""The machine's speed over one real run, and its replay in the simulator (no torch). A shared
machine's speed drifts within minutes of its profile; replaying the real run's own speed leaves
the simulator's own error (what DistServe's "< 2 points" is about).

Per real step (``diagnose.step_table``), factor = measured ÷ modelled seconds. ``speed_trace``
cuts each worker's run time (from ``run_origin``, the simulated clock's 0) into ``window_s``
windows, each the median factor of its steps (an empty window keeps the last factor);
``SpeedTrace(worker, t_s)`` multiplies each modelled step starting at ``t_s``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from engine.metrics import ARRIVED, RequestRecord

# Enough steps for a median to average out jitter, much shorter than the drift (tens of s).
DEFAULT_WINDOW_S = 5.0
ALL_WORKERS = "*"  # the trace of every worker's steps pooled: for a worker without steps


@dataclass(frozen=True)
class SpeedTrace:
    """Piecewise-constant step-speed factors: window ``i`` covers ``[i * window_s, (i + 1) *
    window_s)`` s of the run's clock; ``factors`` per worker (and ``ALL_WORKERS``), clamped to the
    first and last window outside them."""

    window_s: float
    factors: dict[str, tuple[float, ...]]

    def __call__(self, worker: str, t_s: float) -> float:
        """Measured ÷ modelled step time of ``worker`` at ``t_s`` (s); 1.0 for an empty trace."""
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
    """Per window the median ratio, gaps filled forward then back."""
    index = np.floor(np.maximum(start_s, 0.0) / window_s).astype(int)
    medians = pd.Series(ratio).groupby(index).median()
    full = medians.reindex(range(int(index.max()) + 1)).ffill().bfill()
    return tuple(float(v) for v in full)


def speed_trace(steps: pd.DataFrame, origin_s: float,
                window_s: float = DEFAULT_WINDOW_S) -> SpeedTrace:
    """The ``SpeedTrace`` of one run from ``steps`` (``diagnose.step_table``: ``worker, start_s,
    rebuilt, ratio``, ``start_s`` on ``origin_s``'s clock); empty (every factor 1.0) without a
    usable step.

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
    """A real run's clock 0 (wall s): the median of arrived - offset (``Router.run`` stamps
    arrived = start + offset); a record's offset is ``offsets_s[i]``, ``i`` the ``-<i>`` its id
    ends with.

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
