"""``pdlab map --validate K``: the map's own check against real runs.

1. Cells come from ``planner.slo_map.pick_cells``. Per ratio with one, every candidate runs
   (``experiments.replay.run_placement``) at ``bracketing_rates``, ``run_size`` requests a run,
   ``1 + num_reruns`` passes; on emulated devices each run keeps its steps' lateness p99.
2. Every checked cell of a ratio is scored from the same real requests (a run does not depend
   on the SLO); the measured goodput is the mean over passes.
3. Per cell, ``planner.decision.decide`` of mapped against measured goodputs. A same-schedule
   twin pair is scored as one answer (``one_schedule``). A disagreement is within the noise when
   in at least one pass the mapped winner was measured first (None without reruns); a cell
   ``decide`` leaves undecided (a goodput met at the ladder's top) counts neither way.

``contenders`` runs only each family's best mapped placement per cell (and the winner's twin):
the family verdict at a fraction of the runs, blind to a measured best the map ranked lower."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from engine.config import ConditionalConfig, EngineConfig, ModelConfig, TransferConfig
from engine.emulated import LATENESS_WARN, lateness_p99
from experiments.replay import run_placement
from experiments.workload_spec import WorkloadSpec
from planner import decision, search, slo_map

CHECK_COLUMNS = ["io_ratio", "ttft_slo_s", "tpot_slo_s", "ttft_index", "tpot_index",
                 "map_verdict", "mapped", "measured_first", "top1_agrees", "family_agrees",
                 "regret", "kendall_tau", "inside_rerun_noise", "undecided", "met_at_top",
                 "top_rate_req_s", "measured_goodput", "predicted_goodput"]
UNDECIDED = "undecided at the validation ladder's top"
BRACKET = 1.5  # the ladder's top exceeds every run placement's predicted goodput x this
WINDOW_TTFTS = 4  # --validate-window-s default: x the loosest TTFT SLO (run_size)


def bracketing_rates(rates: Sequence[float], predicted_req_s: float, cap: float) -> list[float]:
    """The validation ladder (req/s, ascending): ``rates`` plus rungs doubling the top until it
    exceeds ``BRACKET`` x ``predicted_req_s`` (the run placements' highest predicted goodput
    over all their devices), none above ``cap``: measured goodputs met at the top cannot rank.

    Raises:
        ValueError: no rates, or a rate or ``cap`` not > 0."""
    ladder = sorted({float(r) for r in rates})
    if not ladder or not ladder[0] > 0 or not cap > 0:
        raise ValueError(f"validation rates and their cap must be > 0 req/s, got {list(rates)} "
                         f"and {cap}")
    while ladder[-1] <= BRACKET * predicted_req_s and ladder[-1] < cap:
        ladder.append(min(2 * ladder[-1], cap))
    return ladder


def run_size(rate: float, window_s: float, floor: int, num_requests: int) -> int:
    """Requests in one real run: ceil(``rate`` x ``window_s``), at least ``floor``, at most
    ``num_requests``, the map's simulated run at every rate; a real run is its first n requests
    and arrivals. Default window 4T (T the loosest TTFT SLO): 25% over capacity queues 0.25 s of
    work per second, past T after 4T s; a shorter run is a burst that drains first.

    Raises:
        ValueError: ``window_s`` not > 0 or ``floor`` < 1."""
    if not window_s > 0 or floor < 1:
        raise ValueError(f"a run's window must be > 0 s and its floor >= 1 request, got "
                         f"{window_s} s and {floor}")
    n = math.ceil(round(rate * window_s, 9))  # 0.1 x 30 is 3.0000000000000004 in floats
    return min(num_requests, max(floor, n))


def real_runs(cands: Sequence[search.Candidate], rates: Sequence[float], items: dict,
              spec: WorkloadSpec, model: ModelConfig, engine: EngineConfig,
              transfer: TransferConfig, devices: str, policy: str = "least_loaded",
              local: bool = False, num_reruns: int = 0,
              progress: Callable[[], None] | None = None,
              num_requests: Callable[[float], int] | None = None) -> pd.DataFrame:
    """Step 1 for one ratio: one row per (pass, candidate, rate, seed) with ``pass`` (0 = the
    first), ``candidate``, ``placement``, ``num_devices``, ``rate``, ``seed``,
    ``search.LATENCY_COLUMNS`` (every real request's TTFT and TPOT, s) and ``lateness_p99`` (the
    run's emulated steps, actual ÷ modelled; NaN on real devices). ``progress`` is called after each
    candidate's runs; ``num_requests(rate)``: ``run_placement``'s.

    Raises:
        ValueError: a placement that does not fit ``devices``, a workload that does not fit."""
    rows = []
    for k in range(1 + num_reruns):
        for cand in cands:
            for r in run_placement(cand.placement, list(rates), items, spec, model,
                                   cand.engine(engine), transfer, devices, None, policy,
                                   local=local, conditional=ConditionalConfig(),
                                   num_requests=num_requests):
                ttft, tpot = search.request_latencies(r.records)
                late = lateness_p99(r.steps)
                rows.append({"pass": k, "candidate": cand.label, "placement": cand.placement,
                             "num_devices": cand.num_devices, "rate": r.rate, "seed": r.seed,
                             "ttft_s_all": ttft, "tpot_s_all": tpot,
                             "lateness_p99": np.nan if late is None else late})
            if progress is not None:
                progress()
    return pd.DataFrame(rows)


def contenders(picked: pd.DataFrame, predicted: Mapping[str, np.ndarray],
               families: Mapping[str, str]) -> list[str]:
    """The candidate labels ``--validate-placements contenders`` runs for one ratio's checked
    cells (``picked``: rows of ``slo_map.cells``): at each cell each family's best by the
    map's goodput (ties: the first listed), and the winner's ``same_schedule_as`` twin; in
    ``predicted``'s order."""
    keep = set()
    for cell in picked.itertuples():
        here = {x: float(g[cell.ttft_index, cell.tpot_index]) for x, g in predicted.items()}
        keep |= {label for _, label, _ in slo_map.best_per_family(here, families)}
        if isinstance(cell.same_schedule_as, str) and cell.same_schedule_as:
            keep.add(cell.same_schedule_as)
    return [x for x in predicted if x in keep]


def one_schedule(pred: dict[str, float], per_pass: list[dict[str, float]], winner: str,
                 twin: str) -> tuple[dict[str, float], list[dict[str, float]], str]:
    """``pred`` and ``per_pass`` with ``winner`` and its same-schedule ``twin`` merged into
    ``"winner / twin"`` (predicted: the winner's; measured per pass: the mean of the two);
    unchanged when ``twin`` is empty or either is missing. Returns (pred, per_pass, label)."""
    if not twin or winner not in pred or twin not in pred:
        return pred, per_pass, winner
    name = f"{winner} / {twin}"

    def merge(d: dict[str, float], value: float) -> dict[str, float]:
        out = {}
        for k, v in d.items():
            if k == winner:
                out[name] = value
            elif k != twin:
                out[k] = v
        return out

    return (merge(pred, pred[winner]),
            [merge(p, (p[winner] + p[twin]) / 2) for p in per_pass], name)


def check_cells(picked: pd.DataFrame, predicted: Mapping[str, np.ndarray], runs: pd.DataFrame,
                ttft_grid: Sequence[float], tpot_grid: Sequence[float],
                families: Mapping[str, str]) -> pd.DataFrame:
    """Steps 2-3 for one ratio's checked cells (``picked``: rows of ``slo_map.cells``;
    ``predicted``: ``slo_map.map_ratio``'s goodput grids; ``runs``: ``real_runs``' rows, one
    ladder for all). Returns one row per checked cell (``CHECK_COLUMNS``; goodputs as
    "label=value; ..." texts; ``met_at_top``: "; "-joined)."""
    passes = [slo_map.goodput_grid(g, ttft_grid, tpot_grid)
              for _, g in runs.groupby("pass", sort=True)]
    labels = [x for x in predicted if x in passes[0]]
    top = float(runs["rate"].max())
    devices = dict(zip(runs["candidate"], runs["num_devices"]))
    rows = []
    for cell in picked.itertuples():
        i, j = cell.ttft_index, cell.tpot_index
        pred = {x: float(predicted[x][i, j]) for x in labels}
        per_pass = [{x: float(p[x][i, j]) for x in labels} for p in passes]
        twin = cell.same_schedule_as if isinstance(cell.same_schedule_as, str) else ""
        pred, per_pass, name = one_schedule(pred, per_pass, cell.winner, twin)
        fams = {**families, name: families.get(cell.winner, "")}
        meas = {x: float(np.mean([p[x] for p in per_pass])) for x in pred}
        at_top = [x for x in meas if np.isclose(  # a merged twin pair: the winner's devices
            meas[x], top / (devices[x] if x in devices else devices[cell.winner]))]
        d = decision.decide(pred, meas, at_top)
        firsts = d["measured_first"].split(" = ")
        noise = None
        if not d["top1_agrees"] and not d["undecided"] and len(per_pass) > 1:
            noise = any(p[d["predicted_first"]] >= max(p.values()) for p in per_pass)
        rows.append({"io_ratio": cell.io_ratio, "ttft_slo_s": cell.ttft_slo_s,
                     "tpot_slo_s": cell.tpot_slo_s, "ttft_index": i, "tpot_index": j,
                     "map_verdict": cell.verdict, "mapped": d["predicted_first"],
                     "measured_first": d["measured_first"], "top1_agrees": d["top1_agrees"],
                     "family_agrees": fams[d["predicted_first"]] in {fams[f] for f in firsts},
                     "regret": d["regret"], "kendall_tau": d["kendall_tau"],
                     "inside_rerun_noise": noise, "undecided": d["undecided"],
                     "met_at_top": "; ".join(at_top), "top_rate_req_s": top,
                     "measured_goodput": goodput_text(meas),
                     "predicted_goodput": goodput_text(pred)})
    return pd.DataFrame(rows, columns=CHECK_COLUMNS)


def goodput_text(goodput: dict[str, float]) -> str:
    """``{placement: goodput}`` as "label=value; ..." text, 6 significant digits (3 would tie
    placements that differ in the 4th)."""
    return "; ".join(f"{label}={value:.6g}" for label, value in goodput.items())


def parse_goodput(text: str) -> dict[str, float]:
    """``goodput_text``'s inverse (labels may hold " / ", never "=")."""
    return {label: float(value) for label, value in
            (kv.rsplit("=", 1) for kv in text.split("; "))}


def decision_table(checked: pd.DataFrame) -> pd.DataFrame:
    """``checked`` (``check_cells`` rows) as ``decision.figures``' input table: one row per
    (cell, placement) with its predicted and measured goodput and ``lower_bound``."""
    rows = []
    for r in checked.itertuples():
        cell = f"{r.io_ratio:g} @ TTFT {r.ttft_slo_s:g} s, TPOT {r.tpot_slo_s:g} s"
        meas = parse_goodput(r.measured_goodput)
        at_top = set(r.met_at_top.split("; ")) if isinstance(r.met_at_top, str) else set()
        for label, value in parse_goodput(r.predicted_goodput).items():
            rows.append({"cell": cell, "placement": label, "predicted": value,
                         "measured": meas[label], "lower_bound": label in at_top})
    return pd.DataFrame(rows, columns=["cell", "placement", "predicted", "measured",
                                       "lower_bound"])


def summary_lines(checked: pd.DataFrame, num_reruns: int, where: str = "for real") -> list[str]:
    """The validation summary: the decision figures (``decision.summary_line``), a line per
    disagreement (inside the rerun noise or not) and per undecided cell. ``where`` says what
    the cells ran on ("for real", or "on emulated devices ...")."""
    per_cell, s = decision.figures(decision_table(checked))
    undecided = checked["undecided"].astype(bool)
    decided = checked[~undecided]
    family = (f"{100 * decided['family_agrees'].astype(float).mean():.0f}%" if len(decided)
              else "undefined (no decided cell)")
    lines = [f"validated {len(checked)} cell(s) {where}: " + decision.summary_line(s, UNDECIDED)
             + f"; family agreement {family}"]
    for r in decided[~decided["top1_agrees"].astype(bool)].itertuples():
        noise = ("no reruns to judge it by (--validate-reruns)" if r.inside_rerun_noise is None
                 else "inside the rerun noise (a pass measured the mapped one first)"
                 if r.inside_rerun_noise else
                 f"outside the rerun noise (no pass of {1 + num_reruns} measured it first)")
        lines.append(f"  disagreement at io {r.io_ratio:g}, TTFT {r.ttft_slo_s:g} s, TPOT "
                     f"{r.tpot_slo_s:g} s: mapped {r.mapped} ({r.map_verdict}), measured "
                     f"{r.measured_first}, regret {100 * r.regret:.1f}%: {noise}")
    for r in checked[undecided].itertuples():
        lines.append(f"  {UNDECIDED} at io {r.io_ratio:g}, TTFT {r.ttft_slo_s:g} s, TPOT "
                     f"{r.tpot_slo_s:g} s: {r.met_at_top.replace('; ', ', ')} met the SLO at {r.top_rate_req_s:g} "
                     f"req/s (goodput a lower bound); mapped {r.mapped}, measured first "
                     f"{r.measured_first}")
    return lines


def every_cell_line(checked: pd.DataFrame, num_at_sweep_top: int) -> str:
    """One line of the decision figures over every cell of the map (``checked``: ``check_cells``
    of all cells, scored from the checked cells' real runs). ``num_at_sweep_top``: cells whose
    winner met the SLO at the top swept rate (their goodput is a lower bound)."""
    _, s = decision.figures(decision_table(checked))
    missed = ~checked["top1_agrees"].astype(bool) & ~checked["undecided"].astype(bool)
    return ("every cell of the map, scored from the same real runs: "
            + decision.summary_line(s, UNDECIDED) + f"; {int(missed.sum())} disagreement(s), "
            f"{num_at_sweep_top} cell(s) at the sweep's top (map_validation_every_cell.csv)")


def lateness_line(runs: pd.DataFrame) -> str | None:
    """The emulated runs' lateness (``real_runs``' ``lateness_p99``): median, the worst run with
    its placement and rate, and how many passed ``engine.emulated.LATENESS_WARN``; None on real
    devices."""
    late = runs.dropna(subset=["lateness_p99"]) if "lateness_p99" in runs else runs.iloc[:0]
    if late.empty:
        return None
    worst = late.loc[late["lateness_p99"].idxmax()]
    over = int((late["lateness_p99"] > LATENESS_WARN).sum())
    return (f"emulated steps' lateness p99 (actual / modelled) per run: median "
            f"{late['lateness_p99'].median():.3f}, worst {worst['lateness_p99']:.3f} "
            f"({worst['candidate']} @ {worst['rate']:g} req/s); {over} of {len(late)} run(s) "
            f"above {LATENESS_WARN}" + (": their latencies include this host's lag" if over else ""))
