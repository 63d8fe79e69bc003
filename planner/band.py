"""How sure ``pdlab plan``'s answer is when the machine's speed is not the profile's (no torch).
With ``--speed-spread S``: ``band_runs`` simulates the best few again with every step x (1 + S)
("slow") and x (1 - S) ("fast") on the same requests; ``with_band`` and ``curve_band`` give the
goodput and attainment bands; ``verdict``: the first is a clear winner only if its slow goodput
exceeds the second's fast one (real runs of two placements may meet different speeds, so opposite
ends are the fair comparison). ``validate.score(speed_spread=S)`` uses the same band."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pandas as pd

from engine.config import EngineConfig
from engine.metrics import SLO
from engine.request import Request
from planner import search
from planner.latency import DeviceProfile, TransferModel

SPEEDS = ("slow", "fast")


def scales(spread: float) -> dict[str, float]:
    """``{"slow": 1 + spread, "fast": 1 - spread}``.

    Raises:
        ValueError: ``spread`` is not in [0, 1)."""
    if not (0 <= spread < 1):
        raise ValueError(f"speed spread must be >= 0 and < 1, got {spread!r}")
    return {"slow": 1.0 + spread, "fast": 1.0 - spread}


def band_runs(cands: Sequence[search.Candidate], runs: pd.DataFrame,
              requests_by_seed: dict[int, list[Request]], engine: EngineConfig,
              profile: DeviceProfile, transfer: TransferModel | None, slo: SLO, spread: float,
              process: str = "poisson", burstiness: float = 1.0, policy: str = "least_loaded",
              progress: Callable[[], None] | None = None, jobs: int = 1) -> pd.DataFrame:
    """``sweep`` rows of ``cands`` at both ends, each on its rates in ``runs``, with ``speed``.
    Raises ValueError for a bad ``spread``."""
    ladders = {c.label: sorted(set(runs.loc[runs["candidate"] == c.label, "rate"])) for c in cands}
    out = []
    for speed, scale in scales(spread).items():
        rows = search.sweep(cands, ladders, requests_by_seed, engine, profile.scaled(scale),
                            transfer, slo, process, burstiness, policy, progress, jobs)
        out.append(rows.assign(speed=speed))
    return pd.concat(out, ignore_index=True)


def _goodput(g: pd.DataFrame) -> float:
    """``search.rank``'s goodput per device of one candidate's rows (mean over seeds)."""
    return float(search.rank(g)["goodput_per_device_req_s"].iloc[0])


def with_band(ranked: pd.DataFrame, band: pd.DataFrame) -> pd.DataFrame:
    """``ranked`` with ``goodput_slow`` and ``goodput_fast`` (NaN outside the band runs)."""
    out = ranked.copy()
    for speed in SPEEDS:
        got = {label: _goodput(g) for label, g in
               band[band["speed"] == speed].groupby("candidate", sort=False)}
        out[f"goodput_{speed}"] = [got.get(label, math.nan) for label in out["candidate"]]
    return out


def curve_band(curve: pd.DataFrame, band: pd.DataFrame) -> pd.DataFrame:
    """``search.curves`` with ``slo_attainment_slow`` / ``_fast`` (NaN outside the band runs)."""
    out = curve.copy()
    for speed in SPEEDS:
        att = (band[band["speed"] == speed].groupby(["candidate", "rate"])["slo_attainment"]
               .mean().rename(f"slo_attainment_{speed}").reset_index())
        out = out.merge(att, on=["candidate", "rate"], how="left")
    return out


def separates(first_slow: float, second_fast: float) -> bool:
    """Slow first > fast second (req/s per device; spread 0: a tie is no clear winner)."""
    return first_slow > second_fast


def verdict(ranked: pd.DataFrame, spread: float) -> str:
    """Step 3 in one sentence, from ``with_band``'s table (best first)."""
    banded = ranked.dropna(subset=["goodput_slow", "goodput_fast"])
    pct = f"{100 * spread:g}%"
    if len(banded) < 2:
        return f"speed band ±{pct}: fewer than two placements banded, nothing to compare"
    first, second = banded.iloc[0], banded.iloc[1]

    def span(row) -> str:
        return (f"{row.candidate} {row.goodput_per_device_req_s:.3g} req/s/device "
                f"[{row.goodput_slow:.3g} slow, {row.goodput_fast:.3g} fast]")

    if separates(first.goodput_slow, second.goodput_fast):
        return (f"speed band ±{pct}: {span(first)} stays first even with its steps {pct} "
                f"slower and the next one's {pct} faster ({span(second)})")
    return (f"speed band ±{pct}: no clear winner: {span(first)} and {span(second)} overlap "
            f"(each could come first if the machine runs {pct} slower or faster during its "
            "real runs)")
