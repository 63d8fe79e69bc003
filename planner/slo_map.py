"""Where disaggregation wins: the planner's answer over a grid of SLO targets and prompt:output
ratios, with how sure it is (no torch). Aggregation tends to win at tight TTFT, disaggregation at
tight TPOT (TaiChi). ``pdlab map``, per ratio:

1. ``map_candidates``: ``search.candidates`` plus ``conditional:xPyD`` per disagg one.
2. One ``search.sweep`` per ratio keeping each request's TTFT and TPOT: every (TTFT, TPOT) cell
   is re-scored from the same requests (``attainment``, ``goodput_grid``).
3. ``cells``: the family with most goodput wins, margin = (winner - runner-up) / winner; "no clear
   winner" where ``band.separates`` does not separate them, "none" where nothing reaches 90%
   attainment at the lowest rate; same-schedule twins are one answer; ``at_sweep_top`` flags a
   goodput that is a lower bound.
4. ``regions``: where each family wins, as text. 5. ``pick_cells``: cells ``--validate K`` runs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from engine import metrics as m
from engine.config import EngineConfig
from engine.metrics import SLO
from engine.placement import Placement
from engine.request import Request
from planner import band, search
from planner.latency import DeviceProfile, TransferModel

FAMILIES = ("colocated", "colocated chunked", "disagg", "conditional")
NONE = "none"  # no placement meets the SLO in the swept rates
NO_CLEAR = "no clear winner"
TOP = "at the sweep's top"  # regions' line for the cells whose winner met the top swept rate
CELL_COLUMNS = ["io_ratio", "ttft_slo_s", "tpot_slo_s", "ttft_index", "tpot_index", "verdict",
                "winner_family", "winner", "goodput_per_device_req_s", "runner_up_family",
                "runner_up", "runner_up_goodput_per_device_req_s", "margin", "clear",
                "winner_goodput_slow", "runner_up_goodput_fast", "at_sweep_top",
                "same_schedule_as"]


def family_of(placement: str) -> str:
    """``colocated-nochunk:N`` -> colocated, ``colocated:N`` -> colocated chunked,
    ``disagg:xPyD`` -> disagg, ``conditional:xPyD`` -> conditional.

    Raises:
        ValueError: another placement string."""
    try:
        parsed = Placement.parse(placement)
    except ValueError:
        raise ValueError(f"no family for placement {placement!r}") from None
    if parsed.kind == "colocated":
        return "colocated chunked" if parsed.chunked else "colocated"
    return parsed.kind


def map_candidates(num_devices: int, chunk_budgets: Sequence[int] = (),
                   conditional: bool = True,
                   sizes: Sequence[tuple[int, int]] = ((1, 1),)) -> list[search.Candidate]:
    """``search.candidates`` (per instance size of ``sizes``) plus, with ``conditional``,
    ``conditional:xPyD`` per ``disagg:xPyD`` (Dynamo's rule prefills short prompts on the
    decode side), with the same sizes.

    Raises:
        ValueError: ``num_devices < 1``."""
    cands = search.candidates(num_devices, chunk_budgets, sizes)
    if conditional:
        cands += [search.Candidate(c.placement.replace("disagg:", "conditional:"))
                  for c in cands if c.placement.startswith("disagg:")]
    return cands


def parse_range(text: str, name: str = "range") -> tuple[float, ...]:
    """``MIN:MAX:STEPS`` -> STEPS values (seconds), geometrically spaced from MIN to MAX inclusive,
    4 significant digits.

    Raises:
        ValueError: not three fields, MIN <= 0, MIN > MAX, STEPS not an integer >= 1, or STEPS 1
            with MIN != MAX; the message starts with ``name``."""
    parts = text.split(":")
    try:
        lo, hi, steps = float(parts[0]), float(parts[1]), int(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"{name} must be MIN:MAX:STEPS (e.g. 0.1:4:8), got {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0:
        raise ValueError(f"{name}: MIN must be a number of seconds > 0, got {text!r}")
    if lo > hi:
        raise ValueError(f"{name}: MIN must be <= MAX, got {text!r}")
    if steps < 1:
        raise ValueError(f"{name}: STEPS must be >= 1, got {text!r}")
    if steps == 1 and lo != hi:
        raise ValueError(f"{name}: one step needs MIN = MAX, got {text!r}")
    return tuple(float(f"{v:.4g}") for v in np.geomspace(lo, hi, steps))


def parse_ratios(text: str) -> tuple[float, ...]:
    """Comma-separated prompt:output token ratios (each > 0, each once), e.g. ``0.25,1,4``.

    Raises:
        ValueError: an empty list, a value that is not a number > 0, or a repeat."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"io ratios must be comma-separated numbers > 0, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"each io ratio may appear once, got {text!r}")
    return values


def ratio_lengths(ratio: float, request_tokens: int) -> tuple[str, str]:
    """Mean prompt p = round(request_tokens x ratio / (1 + ratio)), output o = request_tokens - p
    (each >= 1), each uniform in [0.5 x, 1.5 x] of its mean, as ``WorkloadSpec`` ``lo-hi`` strings.

    Raises:
        ValueError: ``request_tokens < 2``."""
    if request_tokens < 2:
        raise ValueError(f"request_tokens must be >= 2, got {request_tokens}")
    p = min(max(1, round(request_tokens * ratio / (1 + ratio))), request_tokens - 1)
    o = request_tokens - p

    def span(mean: int) -> str:
        lo, hi = max(1, round(0.5 * mean)), max(1, round(1.5 * mean))
        return f"{lo}-{hi}"

    return span(p), span(o)


def attainment(ttft: np.ndarray, tpot: np.ndarray, ttft_grid: Sequence[float],
               tpot_grid: Sequence[float]) -> np.ndarray:
    """Share of a run's requests with TTFT <= T and TPOT <= P per cell, shape (len(ttft_grid),
    len(tpot_grid)) (= ``engine.metrics.slo_attainment``); NaN without requests."""
    n = len(ttft)
    if n == 0:
        return np.full((len(ttft_grid), len(tpot_grid)), math.nan)
    ok_t = (np.asarray(ttft)[:, None] <= np.asarray(ttft_grid)[None, :]).astype(float)
    ok_p = (np.asarray(tpot)[:, None] <= np.asarray(tpot_grid)[None, :]).astype(float)
    return ok_t.T @ ok_p / n


def goodput_grid(runs: pd.DataFrame, ttft_grid: Sequence[float],
                 tpot_grid: Sequence[float]) -> dict[str, np.ndarray]:
    """Candidate -> goodput per device (req/s) per cell: per (candidate, rate) the mean over seeds
    of ``attainment``, then ``goodput_rate`` per cell. ``runs``: ``sweep(latencies=True)`` rows."""
    out = {}
    shape = (len(ttft_grid), len(tpot_grid))
    for label, g in runs.groupby("candidate", sort=False):
        n_dev = int(g["num_devices"].iloc[0])
        rates, curves = [], []
        for rate, at in g.groupby("rate", sort=True):
            rates.append(float(rate))
            curves.append(np.mean([attainment(t, p, ttft_grid, tpot_grid)
                                   for t, p in zip(at["ttft_s_all"], at["tpot_s_all"])], axis=0))
        stack = np.stack(curves)  # (rates, T, P)
        goodput = np.zeros(shape)
        for i in range(shape[0]):
            for j in range(shape[1]):
                goodput[i, j] = m.goodput_rate(rates, list(stack[:, i, j]), n_dev)
        out[label] = goodput
    return out


def best_per_family(goodput: Mapping[str, float],
                    family: Mapping[str, str]) -> list[tuple[str, str, float]]:
    """(family, candidate, goodput) of each family's best, best first (ties: listed order)."""
    best: dict[str, tuple[str, float]] = {}
    for label, g in goodput.items():
        f = family[label]
        if f not in best or g > best[f][1]:
            best[f] = (label, g)
    ranked = sorted(best.items(), key=lambda kv: -kv[1][1])  # stable
    return [(f, label, g) for f, (label, g) in ranked]


def cells(goodput: Mapping[str, np.ndarray], families: Mapping[str, str],
          ttft_grid: Sequence[float], tpot_grid: Sequence[float], io_ratio: float,
          slow: Mapping[str, np.ndarray] | None = None,
          fast: Mapping[str, np.ndarray] | None = None,
          top: Mapping[str, float] | None = None,
          twins: Mapping[str, str] | None = None) -> pd.DataFrame:
    """One row per cell (``CELL_COLUMNS``), TTFT index major.

    ``goodput``: candidate -> goodput per device per cell, in candidate order (breaks ties);
    ``slow``, ``fast``: the same at the band's ends (None: no band). ``top``: goodput at the top
    swept rate; a winner there has ``at_sweep_top`` (a lower bound). ``twins``:
    ``same_schedule``'s map; a winner whose twin is the runner-up at the same goodput names it
    in ``same_schedule_as``. ``verdict``: the winner when clear, ``NO_CLEAR`` when the band does
    not separate it from the runner-up, ``NONE`` when no goodput > 0 (margin NaN). Margin 1.0
    without a runner-up family."""
    slow, fast, top, twins = slow or {}, fast or {}, top or {}, twins or {}
    rows = []
    for i, ttft in enumerate(ttft_grid):
        for j, tpot in enumerate(tpot_grid):
            ranked = best_per_family({k: float(v[i, j]) for k, v in goodput.items()}, families)
            row = {"io_ratio": io_ratio, "ttft_slo_s": ttft, "tpot_slo_s": tpot,
                   "ttft_index": i, "tpot_index": j}
            if not ranked or ranked[0][2] <= 0:
                rows.append({**row, "verdict": NONE, "winner_family": NONE, "winner": "",
                             "goodput_per_device_req_s": 0.0, "runner_up_family": "",
                             "runner_up": "", "runner_up_goodput_per_device_req_s": 0.0,
                             "margin": math.nan, "clear": False, "winner_goodput_slow": 0.0,
                             "runner_up_goodput_fast": 0.0, "at_sweep_top": False,
                             "same_schedule_as": ""})
                continue
            wf, w, wg = ranked[0]
            same = ""
            if len(ranked) > 1 and twins.get(w) == ranked[1][1] and ranked[1][2] == wg:
                same = ranked.pop(1)[1]  # one schedule under two names: not a rival
            rf, r, rg = ranked[1] if len(ranked) > 1 else ("", "", 0.0)
            w_slow = float(slow[w][i, j]) if w in slow else wg
            r_fast = float(fast[r][i, j]) if r in fast else rg
            clear = band.separates(w_slow, r_fast)
            rows.append({**row, "verdict": w if clear else NO_CLEAR, "winner_family": wf,
                         "winner": w, "goodput_per_device_req_s": wg, "runner_up_family": rf,
                         "runner_up": r, "runner_up_goodput_per_device_req_s": rg,
                         "margin": (wg - rg) / wg, "clear": bool(clear),
                         "winner_goodput_slow": w_slow, "runner_up_goodput_fast": r_fast,
                         "at_sweep_top": bool(w in top and np.isclose(wg, top[w])),
                         "same_schedule_as": same})
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def same_schedule(cands: Sequence[search.Candidate], engine: EngineConfig,
                  max_prompt_tokens: int) -> dict[str, str]:
    """``colocated:N`` (chunked at the engine's budget) and ``colocated-nochunk:N`` map to each
    other when the longest prompt fits the chunk budget: then the two run nearly the same
    schedule, and an equal goodput is one answer under two names. Candidates with their own
    ``chunk_budget`` are left out; each instance size pairs with its own."""
    if max_prompt_tokens > engine.max_num_batched_tokens:
        return {}
    twins: dict[str, str] = {}
    labels = {c.label for c in cands if c.chunk_budget is None}
    for c in cands:
        p = Placement.parse(c.placement)
        if c.chunk_budget is None and p.kind == "colocated" and p.chunked:
            twin = str(dataclasses.replace(p, chunked=False))
            if twin in labels:
                twins[c.label], twins[twin] = twin, c.label
    return twins


def contenders(table: pd.DataFrame) -> list[str]:
    """Labels that are winner or runner-up in some cell, first-seen order (the ones step 3 bands)."""
    labels = list(table["winner"]) + list(table["runner_up"])
    return [x for x in dict.fromkeys(labels) if x]


def map_ratio(cands: Sequence[search.Candidate], rates: Sequence[float],
              requests_by_seed: dict[int, list[Request]], engine: EngineConfig,
              profile: DeviceProfile, transfer: TransferModel | None,
              ttft_grid: Sequence[float], tpot_grid: Sequence[float], io_ratio: float,
              spread: float = 0.0, process: str = "poisson", burstiness: float = 1.0,
              policy: str = "least_loaded", progress: Callable[[], None] | None = None,
              jobs: int = 1) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, np.ndarray]]:
    """Steps 2-3 for one ratio: (``cells`` table, the sweep's rows without per-request columns
    and with ``speed``: nominal/slow/fast, nominal goodput grids per candidate).

    Raises:
        ValueError: a bad ``spread`` (``band.scales``)."""
    scales = band.scales(spread) if spread > 0 else {}
    loosest = SLO(max(ttft_grid), max(tpot_grid))
    runs = search.sweep(cands, list(rates), requests_by_seed, engine, profile, transfer, loosest,
                        process, burstiness, policy, progress, jobs, latencies=True)
    families = {c.label: family_of(c.placement) for c in cands}
    goodput = goodput_grid(runs, ttft_grid, tpot_grid)
    top = {c.label: max(rates) / c.num_devices for c in cands}
    longest = max((len(r.prompt_token_ids) for reqs in requests_by_seed.values() for r in reqs),
                  default=0)
    twins = same_schedule(cands, engine, longest)
    table = cells(goodput, families, ttft_grid, tpot_grid, io_ratio, top=top, twins=twins)
    kept = [runs.drop(columns=search.LATENCY_COLUMNS).assign(speed="nominal")]
    if scales:
        banded = [c for c in cands if c.label in set(contenders(table))]
        ends = {}
        for speed, scale in scales.items():
            rows = search.sweep(banded, list(rates), requests_by_seed, engine,
                                profile.scaled(scale), transfer, loosest, process, burstiness,
                                policy, progress, jobs, latencies=True)
            ends[speed] = goodput_grid(rows, ttft_grid, tpot_grid)
            kept.append(rows.drop(columns=search.LATENCY_COLUMNS).assign(speed=speed))
        table = cells(goodput, families, ttft_grid, tpot_grid, io_ratio, ends["slow"], ends["fast"],
                      top, twins)
    return table, pd.concat(kept, ignore_index=True), goodput


def _condition(name: str, grid: Sequence[float], lo: int, hi: int) -> list[str]:
    """The bounds of index span [lo, hi] of ``grid`` that are not the grid's own edges."""
    if lo == 0 and hi == len(grid) - 1:
        return []
    if lo == hi:
        return [f"{name} = {grid[lo]:g} s"]
    out = []
    if lo > 0:
        out.append(f"{name} >= {grid[lo]:g} s")
    if hi < len(grid) - 1:
        out.append(f"{name} <= {grid[hi]:g} s")
    return out


def regions(table: pd.DataFrame, ttft_grid: Sequence[float], tpot_grid: Sequence[float]) -> list[str]:
    """One line per family that wins some cell clearly (naming a same-schedule twin), then for the
    cells without a clear winner, at the sweep top, and met by nobody. Each is the bounding box of
    those cells, "<family> (<placements>) wins when TPOT <= X s and TTFT >= Y s", or "wins in n of
    the m cells where ..."; bounds at the grid's edge are left out ("everywhere")."""
    lines = []
    clear = table[table["clear"]]
    groups = [(f, clear[clear["winner_family"] == f]) for f in FAMILIES]
    groups += [(NO_CLEAR, table[table["verdict"] == NO_CLEAR]),
               (TOP, table[table["at_sweep_top"]]),
               (NONE, table[table["verdict"] == NONE])]
    for name, part in groups:
        if part.empty:
            continue
        ti, pi = part["ttft_index"], part["tpot_index"]
        cond = (_condition("TPOT", tpot_grid, int(pi.min()), int(pi.max()))
                + _condition("TTFT", ttft_grid, int(ti.min()), int(ti.max())))
        box = (int(ti.max()) - int(ti.min()) + 1) * (int(pi.max()) - int(pi.min()) + 1)
        where = " and ".join(cond)
        if name in FAMILIES:
            subject = f"{name} ({', '.join(dict.fromkeys(part['winner']))}) wins"
            twins = [x for x in dict.fromkeys(part["same_schedule_as"]) if x]
            if twins:
                subject += (f" (tied with {', '.join(twins)} in {int((part['same_schedule_as'] != '').sum())}"
                            " cells: every prompt fits the chunk budget, one schedule)")
            top = int(part["at_sweep_top"].sum())
            if top:  # its goodput there is the top rate over its devices: a lower bound
                subject += (f" ({'all' if top == len(part) else top} of these cells at the "
                            "top swept rate, where goodput is only a lower bound: sweep "
                            "higher --rates before trusting the win)")
        elif name == NO_CLEAR:
            subject = "no clear winner (the speed bands overlap)"
        elif name == TOP:
            subject = ("the winner met the SLO at the top swept rate (goodput a lower bound: "
                       "sweep higher --rates)")
        else:
            subject = "nothing meets the SLO at the lowest swept rate"
        if len(part) == box:
            lines.append(f"{subject} " + (f"when {where}" if where else "everywhere on the map"))
        else:
            lines.append(f"{subject} in {len(part)} of the {box} cells "
                         + (f"where {where}" if where else "of the map"))
    return lines


def pick_cells(table: pd.DataFrame, k: int) -> pd.DataFrame:
    """``k`` rows of ``table`` (every ratio's ``cells``) to check for real: per ratio corners
    ((min, min), (max, max), (min, max), (max, min)) alternating with boundary cells (a right or
    upper neighbour with another verdict, smallest margin first), round-robin over ratios.

    Raises:
        ValueError: ``k < 1``."""
    if k < 1:
        raise ValueError(f"the number of cells to check must be >= 1, got {k}")
    orders = []
    for _, part in table.groupby("io_ratio", sort=False):
        key = {(r.ttft_index, r.tpot_index): idx for idx, r in zip(part.index, part.itertuples())}
        verdict = {k_: table.at[idx, "verdict"] for k_, idx in key.items()}
        ti, pi = max(i for i, _ in key), max(j for _, j in key)
        corners = [key[c] for c in dict.fromkeys([(0, 0), (ti, pi), (0, pi), (ti, 0)])]
        beside = [idx for (i, j), idx in key.items()
                  if verdict.get((i + 1, j), verdict[(i, j)]) != verdict[(i, j)]
                  or verdict.get((i, j + 1), verdict[(i, j)]) != verdict[(i, j)]]
        beside.sort(key=lambda idx: (np.nan_to_num(table.at[idx, "margin"], nan=2.0)))
        mixed = []
        for n in range(max(len(corners), len(beside))):
            mixed += corners[n:n + 1] + beside[n:n + 1]
        orders.append(list(dict.fromkeys(mixed + list(part.index))))
    picked: list = []
    for n in range(max(map(len, orders), default=0)):
        for order in orders:
            if n < len(order) and order[n] not in picked and len(picked) < k:
                picked.append(order[n])
    return table.loc[picked]
