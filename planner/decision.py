"""Decision-grade figures of a planner against real runs (no torch): "would following the planner
have chosen well", per decision (one SLO, one workload) from each placement's predicted and
measured goodput per device: **top-1 agreement** (the predicted first, ties to the first listed, is
a measured first); **regret** (best - measured[planner's first]) / best, 0 when best is 0;
**Kendall tau-b** between predicted and measured (NaN with under two placements or all tied).
**Undecided**: a measured goodput that is a lower bound (met at the top rate run) may overtake the
measured first. ``figures`` summarizes the decided: top-1 share, mean and worst regret, mean tau."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import pandas as pd

DECISION_COLUMNS = ["cell", "predicted_first", "measured_first", "top1_agrees", "regret",
                    "kendall_tau", "num_placements", "undecided"]


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (Kendall 1945; ``scipy.stats.kendalltau``'s default): (concordant -
    discordant) / sqrt((n0 - ties in x) (n0 - ties in y)) over n0 = n (n - 1) / 2 pairs.

    Raises:
        ValueError: the lengths differ."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau needs equal lengths, got {len(x)} and {len(y)}")
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(a), k=1)
    dx, dy = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    n0 = len(i)
    tx, ty = int(np.sum(dx == 0)), int(np.sum(dy == 0))
    denom = math.sqrt((n0 - tx) * (n0 - ty))
    return float(np.sum(dx * dy) / denom) if denom > 0 else math.nan


def decide(predicted: Mapping[str, float], measured: Mapping[str, float],
           lower_bound: Collection[str] = ()) -> dict:
    """One decision over the placements both sides have, in ``predicted``'s order:
    ``predicted_first``, ``measured_first`` (tied firsts joined by " = "), ``top1_agrees``,
    ``regret``, ``kendall_tau``, ``num_placements``, ``undecided`` (by ``lower_bound``).

    Raises:
        ValueError: the two share no placement."""
    common = [p for p in predicted if p in measured]
    if not common:
        raise ValueError("the predicted and measured goodputs share no placement")
    first = max(common, key=lambda p: predicted[p])  # the first listed of a tie
    best = max(measured[p] for p in common)
    firsts = [p for p in common if measured[p] == best]
    regret = (best - measured[first]) / best if best > 0 else 0.0
    open_ended = [p for p in common if p in lower_bound]  # a sole first of them stays first
    return {"predicted_first": first, "measured_first": " = ".join(firsts),
            "top1_agrees": first in firsts, "regret": float(regret),
            "kendall_tau": kendall_tau([predicted[p] for p in common],
                                       [measured[p] for p in common]),
            "num_placements": len(common),
            "undecided": bool(open_ended) and not (len(firsts) == 1 and open_ended == firsts)}


def figures(table: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Many decisions: ``table`` has one row per (cell, placement) with ``cell``, ``placement``,
    ``predicted``, ``measured`` (goodput per device, req/s), optionally ``lower_bound`` (bool).
    Returns (one row per cell, ``DECISION_COLUMNS``; summary: ``num_cells``, ``num_undecided``,
    over decided cells ``top1_agreement``, ``regret_mean``, ``regret_max`` (NaN: none decided),
    ``kendall_tau_mean`` where defined).

    Raises:
        ValueError: an empty table."""
    if table.empty:
        raise ValueError("no decisions to score")
    rows = []
    for cell, g in table.groupby("cell", sort=False):
        lower = g["placement"][g["lower_bound"].astype(bool)] if "lower_bound" in g else ()
        rows.append({"cell": cell, **decide(dict(zip(g["placement"], g["predicted"])),
                                            dict(zip(g["placement"], g["measured"])),
                                            set(lower))})
    per_cell = pd.DataFrame(rows, columns=DECISION_COLUMNS)
    decided = per_cell[~per_cell["undecided"]]
    taus = decided["kendall_tau"].dropna()
    return per_cell, {"num_cells": len(per_cell), "num_undecided": len(per_cell) - len(decided),
                      "top1_agreement": float(decided["top1_agrees"].astype(float).mean()),
                      "regret_mean": float(decided["regret"].mean()),
                      "regret_max": float(decided["regret"].max()),
                      "kendall_tau_mean": float(taus.mean()) if len(taus) else math.nan}


def summary_line(s: Mapping, undecided: str = "undecided") -> str:
    """``figures``' summary as one sentence; ``undecided`` names the undecided ones."""
    tau, skipped = s["kendall_tau_mean"], s.get("num_undecided", 0)
    decided = s["num_cells"] - skipped
    more = f" (and {skipped} {undecided}, not counted)" if skipped else ""
    if not decided:
        return f"no decided decision{more}"
    return (f"top-1 agreement {100 * s['top1_agreement']:.0f}% of {decided} decision(s){more}; "
            f"regret mean {100 * s['regret_mean']:.1f}%, worst "
            f"{100 * s['regret_max']:.1f}% of the measured best goodput; Kendall tau "
            + (f"{tau:.2f}" if math.isfinite(tau) else "undefined (ties)"))
