"""``pdlab plan --validate``: the simulator's own error against real runs, every time.

1. The same requests run for real (``run_placement``) and through the simulator with the same
   arrival times (``measured/``, ``simulated/``).
2. Per (placement, rate), means over seeds: ``attainment_err_points`` = 100 x (simulated -
   measured) attainment, TTFT/TPOT p50/p99 relative errors (validation.csv), ``num_flipped``.
3. Step speed: each real run's ``step_factor``, median measured / modelled step time (as Dynamo's
   SLA planner corrects its profile), rerun in validation_corrected.csv; drift replay: a
   per-worker 5 s speed trace scales each simulated step (validation_replay.csv).
4. Band (``speed_spread`` S > 0): the planner's first is accepted when it is the real first or
   its (1 ± S) goodput band reaches the real first's.
5. Reruns (``num_reruns``): each point again for real (validation_reruns.csv), the machine's
   run-to-run difference: the floor under any simulator's error."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from engine import metrics
from engine.arrivals import arrival_times
from engine.config import ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import SLO, RequestRecord
from experiments import analysis
from experiments.replay import RunResult, run_placement
from experiments.results import write_results
from experiments.workload_spec import WorkloadSpec, build_workload, context_len, requests_of
from planner import band, decision, diagnose, drift, search
from engine.placement import Placement
from planner.latency import DeviceProfile, TransferModel
from planner.sizes import ProfileSet

LATENCIES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
COLUMNS = (["placement", "rate", "measured_attainment", "simulated_attainment",
            "attainment_err_points"]
           + [f"{k}_{c}" for c in LATENCIES for k in ("measured", "simulated")]
           + [f"{c.removesuffix('_s')}_rel_err" for c in LATENCIES])
OUTCOME_COLUMNS = ["num_requests", "num_flipped", "step_factor"]
# The replayed twin's columns of the error table, each kept as "replay_<column>".
_REPLAYED = (["simulated_attainment", "attainment_err_points"]
             + [f"{c.removesuffix('_s')}_rel_err" for c in LATENCIES] + ["num_flipped"])
REPLAY_COLUMNS = [f"replay_{c}" for c in _REPLAYED]
# A rerun's columns (the first real run against a rerun), each kept as "rerun_<column>".
_RERUN = _REPLAYED
RERUN_COLUMNS = ["rerun_measured_attainment"] + [f"rerun_{c}" for c in _RERUN[1:]]
BAND_COLUMNS = ["band_slow_attainment", "band_fast_attainment", "measured_in_band"]


def error_table(measured: pd.DataFrame, simulated: pd.DataFrame) -> pd.DataFrame:
    """Step 3: one row per (placement, rate) both summary tables have (``COLUMNS``).

    Raises:
        ValueError: the tables share no (placement, rate) point."""
    key = ["placement", "rate"]
    both = measured.merge(simulated, on=key, suffixes=("_measured", "_simulated"))
    if both.empty:
        raise ValueError("the measured and simulated runs share no (placement, rate) point")
    out = pd.DataFrame({"placement": both["placement"], "rate": both["rate"],
                        "measured_attainment": both["slo_attainment_measured"],
                        "simulated_attainment": both["slo_attainment_simulated"]})
    out["attainment_err_points"] = 100 * (out["simulated_attainment"] - out["measured_attainment"])
    for c in LATENCIES:
        meas, sim = both[f"{c}_measured"].astype(float), both[f"{c}_simulated"].astype(float)
        out[f"measured_{c}"], out[f"simulated_{c}"] = meas, sim
        out[f"{c.removesuffix('_s')}_rel_err"] = (sim - meas) / meas
    return out[COLUMNS].reset_index(drop=True)


def _position(request_id: str) -> str:
    """The ``-<i>`` both sides' request ids end with (``workload_spec.requests_of``)."""
    return request_id.rsplit("-", 1)[-1]


def outcome_table(measured: Sequence[RunResult], simulated: Sequence[RunResult],
                  slo: SLO) -> pd.DataFrame:
    """Per (placement, rate), pooled over seeds: ``num_requests`` (real) and ``num_flipped``
    (``meets_slo`` differs from the twin's, paired by seed and position; a missing twin flips a
    request that met the SLO)."""
    twin = {(r.placement, r.rate, r.seed): {_position(x.request_id): metrics.meets_slo(x, slo)
                                            for x in r.records} for r in simulated}
    counts: dict[tuple[str, float], list[int]] = {}
    for r in measured:
        sim = twin.get((r.placement, r.rate, r.seed), {})
        c = counts.setdefault((r.placement, r.rate), [0, 0])
        for x in r.records:
            c[0] += 1
            c[1] += metrics.meets_slo(x, slo) != sim.get(_position(x.request_id), False)
    return pd.DataFrame([{"placement": p, "rate": rate, "num_requests": n, "num_flipped": f}
                         for (p, rate), (n, f) in counts.items()],
                        columns=["placement", "rate", "num_requests", "num_flipped"])


def step_factors(measured: Sequence[RunResult], profile: DeviceProfile | ProfileSet
                 ) -> tuple[dict[tuple[str, float, int], float], dict[str, float], float, pd.DataFrame]:
    """(median measured ÷ modelled per run ``(placement, rate, seed)``, the same per
    ``"<placement> <worker>"``, the table of every step with its run in front); NaN where a run has
    no usable step. Each worker's steps are modelled on its instance's profile
    (``ProfileSet.of_worker``) when ``profile`` is a set."""
    tables = []
    for r in measured:
        by_worker: dict[str, list[dict]] = {}
        for st in r.steps:
            by_worker.setdefault(st["worker"], []).append(st)
        for worker, its in by_worker.items():
            own = (profile.of_worker(Placement.parse(r.placement), worker)
                   if isinstance(profile, ProfileSet) else profile)
            t = diagnose.step_table(its, own.step_time())
            tables.append(t.assign(placement=r.placement, rate=r.rate, seed=r.seed))
    cols = ["placement", "rate", "seed", *diagnose.STEP_COLUMNS]
    steps = pd.concat(tables, ignore_index=True)[cols] if tables else pd.DataFrame(columns=cols)
    rows = steps.to_dict("records")
    by_run: dict = {}
    by_worker_rows: dict = {}
    for row in rows:
        by_run.setdefault((row["placement"], row["rate"], row["seed"]), []).append(row)
        by_worker_rows.setdefault(f"{row['placement']} {row['worker']}", []).append(row)
    return ({k: _median_ratio(v) for k, v in by_run.items()},
            {k: _median_ratio(v) for k, v in by_worker_rows.items()},
            _median_ratio(rows), steps)


def _median_ratio(rows: Sequence[dict]) -> float:
    """``latency.step_correction`` on ``step_table`` rows (their ``model_s``, already of each
    worker's profile): the median measured ÷ modelled over rebuilt steps; NaN without one."""
    ratios = [r["duration_s"] / r["model_s"] for r in rows
              if r.get("rebuilt", True) and r["model_s"] > 0 and r["duration_s"] > 0]
    return float(np.median(ratios)) if ratios else math.nan


def with_outcomes(errors: pd.DataFrame, measured: Sequence[RunResult],
                  simulated: Sequence[RunResult], slo: SLO,
                  factor_of: Callable[[tuple[str, float, int]], float]) -> pd.DataFrame:
    """``errors`` with ``outcome_table``'s counts and ``step_factor`` (mean over seeds)."""
    out = errors.merge(outcome_table(measured, simulated, slo), on=["placement", "rate"], how="left")
    seeds = sorted({r.seed for r in measured})
    out["step_factor"] = [float(np.mean([factor_of((p, rate, seed)) for seed in seeds]))
                          for p, rate in zip(out["placement"], out["rate"])]
    return out[COLUMNS + OUTCOME_COLUMNS]


def _with_columns(errors: pd.DataFrame, other: pd.DataFrame, names: list[str],
                  renamed: list[str]) -> pd.DataFrame:
    """``errors`` with ``other``'s ``names`` (means per (placement, rate)) added as ``renamed``."""
    part = other.groupby(["placement", "rate"], as_index=False, sort=False)[names].mean()
    part = part.rename(columns=dict(zip(names, renamed)))
    return errors.merge(part, on=["placement", "rate"], how="left")[list(errors.columns) + renamed]


def with_replay(errors: pd.DataFrame, replay: pd.DataFrame) -> pd.DataFrame:
    """``errors`` with ``REPLAY_COLUMNS`` from the drift-replayed ``with_outcomes`` table."""
    return _with_columns(errors, replay, _REPLAYED, REPLAY_COLUMNS)


def with_reruns(errors: pd.DataFrame, reruns: pd.DataFrame) -> pd.DataFrame:
    """``errors`` with ``RERUN_COLUMNS`` (means over ``reruns``' rows; NaN without reruns)."""
    if reruns.empty:
        return errors.assign(**{c: math.nan for c in RERUN_COLUMNS})
    return _with_columns(errors, reruns, _RERUN, RERUN_COLUMNS)


def speed_traces(measured: Sequence[RunResult], steps: pd.DataFrame, items: dict,
                 spec: WorkloadSpec, window_s: float = drift.DEFAULT_WINDOW_S
                 ) -> dict[tuple[str, float, int], drift.SpeedTrace]:
    """Each real run's ``drift.speed_trace`` on the simulated clock (origin: its scheduled start)."""
    out = {}
    for r in measured:
        offsets = arrival_times(len(items[r.seed]), r.rate, r.seed, spec.arrival,
                                          spec.burstiness)
        mine = steps[(steps["placement"] == r.placement) & np.isclose(steps["rate"], r.rate)
                     & (steps["seed"] == r.seed)]
        out[(r.placement, r.rate, r.seed)] = drift.speed_trace(
            mine, drift.run_origin(r.records, offsets), window_s)
    return out


def validation_summary(errors: pd.DataFrame, measured_goodput: dict[str, float],
                       simulated_goodput: dict[str, float]) -> dict:
    """Mean |attainment error| (points), mean |relative error| per latency, each side's first
    placement (ties: first listed), ``first_agrees`` (a measured tie accepts either), and with
    ``outcome_table``'s columns the requests compared, flipped, and the resolution (points)."""
    out = {"num_points": len(errors),
           "attainment_mae_points": float(errors["attainment_err_points"].abs().mean())}
    for c in LATENCIES:
        col = f"{c.removesuffix('_s')}_rel_err"
        v = errors[col].abs().replace([np.inf], np.nan).dropna()
        out[f"{col}_mean_abs"] = float(v.mean()) if len(v) else math.nan
    if "num_requests" in errors and len(errors):
        out["num_requests"] = int(errors["num_requests"].sum())
        out["num_flipped"] = int(errors["num_flipped"].sum())
        out["attainment_resolution_points"] = 100.0 / float(errors["num_requests"].min())
    best = lambda g: max(g, key=g.get) if g else None  # noqa: E731
    out["measured_first"], out["simulated_first"] = best(measured_goodput), best(simulated_goodput)
    out["first_agrees"] = bool(measured_goodput) and (
        measured_goodput.get(out["simulated_first"]) == max(measured_goodput.values()))
    out["measured_goodput"], out["simulated_goodput"] = measured_goodput, simulated_goodput
    if measured_goodput and any(p in measured_goodput for p in simulated_goodput):
        d = decision.decide(simulated_goodput, measured_goodput)  # rank agreement and regret
        out["kendall_tau"], out["regret"] = d["kendall_tau"], d["regret"]
    return out


def summary_text(s: dict) -> str:
    """The validation in one paragraph (with the corrected figures when there are any)."""
    text = _summary_line(s)
    if "step_correction" in s:
        text += (f"\nreal steps took {s['step_correction']:.3g}x the modelled time (median of "
                 "measured ÷ modelled on each real step's batch)")
        if s.get("step_factor_by_run"):
            text += "; per run " + ", ".join(f"{k} {v:.3g}" for k, v in s["step_factor_by_run"].items())
        if s.get("step_correction_by_worker"):
            text += "; per worker " + ", ".join(f"{k} {v:.3g}" for k, v in s["step_correction_by_worker"].items())
    if "corrected" in s:
        text += "\nwith each run's steps scaled by its own factor: " + _summary_line(s["corrected"])
    if "replay" in s:
        text += (f"\nreplaying each run's measured machine speed (median measured ÷ modelled "
                 f"step time per {s.get('replay_window_s', drift.DEFAULT_WINDOW_S):g} s window): "
                 + _summary_line(s["replay"]))
        text += (f"\nopen-loop: MAE {s['attainment_mae_points']:.1f} points; replaying this run's "
                 f"measured machine speed: MAE {s['replay']['attainment_mae_points']:.1f} points "
                 "(open-loop is the planner's predictive error on this machine; the replay "
                 "gives the simulator the speed the machine had, so what is left is the "
                 "simulator's own error)")
    if "rerun" in s:
        text += (f"\nrun to run (the same requests run again for real, {s['num_reruns']} "
                 f"rerun(s), first run against rerun): " + _summary_line(s["rerun"], "rerun")
                 + f"\nthe simulator against the first run: MAE {s['attainment_mae_points']:.1f} "
                 f"points; the machine against itself: MAE {s['rerun']['attainment_mae_points']:.1f} "
                 "points (no simulator can be held to less than the machine's own "
                 "repeatability)")
    if "band" in s:
        b = s["band"]
        spans = ", ".join(f"{p} [{lo:.3g} slow, {hi:.3g} fast]" for p, (lo, hi) in b["goodput_band"].items())
        text += (f"\nspeed band ±{100 * b['spread']:g}% (every step 1 ± {b['spread']:g} x the "
                 f"model): measured attainment inside the simulated band at {b['num_in_band']} of "
                 f"{b['num_points']} points; goodput per device {spans}; the planner's first "
                 f"{s['simulated_first']} is "
                 + ("the real first or within its band" if b["first_within_band"]
                    else "outside the real first's band"))
    return text


def _firsts(goodput: dict[str, float] | None, first: str | None) -> str:
    """The placement ranked first, or all those tied first (``a = b (tied)``)."""
    tied = [p for p, g in (goodput or {}).items() if g == max(goodput.values())]
    return " = ".join(tied) + " (tied)" if len(tied) > 1 else str(first)


def _summary_line(s: dict, other: str = "simulated") -> str:
    """One summary as a sentence; ``other``: ``simulated`` or ``rerun``."""
    lat = ", ".join(f"{c.removesuffix('_s').replace('_', ' ')} {100 * s[c.removesuffix('_s') + '_rel_err_mean_abs']:.1f}%"
                    for c in LATENCIES)
    agree = "agree" if s.get("first_agrees", s["measured_first"] == s["simulated_first"]) else "DISAGREE"
    flips = ""
    if "num_flipped" in s:
        flips = (f" ({s['num_flipped']} of {s['num_requests']} requests flipped; one request "
                 f"= {s['attainment_resolution_points']:.2g} points)")
    measured = _firsts(s.get("measured_goodput"), s["measured_first"])
    if other != "simulated":  # the other side is real too: its ties are shown as well
        return (f"over {s['num_points']} points: SLO attainment mean abs difference "
                f"{s['attainment_mae_points']:.1f} points{flips}; mean |relative difference| "
                f"{lat}; first by goodput per device: first run {measured}, {other} "
                f"{_firsts(s.get('simulated_goodput'), s['simulated_first'])} ({agree})")
    ranks = ""
    if "kendall_tau" in s:  # planner.decision's figures, beside the point errors
        tau = s["kendall_tau"]
        ranks = (f"; decision: top-1 {agree}, regret {100 * s['regret']:.1f}% of the measured "
                 f"best goodput, Kendall tau over placements "
                 + (f"{tau:.2f}" if math.isfinite(tau) else "undefined (ties or one placement)"))
    return (f"validation over {s['num_points']} points: SLO attainment mean abs error "
            f"{s['attainment_mae_points']:.1f} points{flips}; mean |relative error| {lat}; first "
            f"by goodput per device: measured {measured}, simulated {s['simulated_first']} "
            f"({agree}){ranks}")


def _goodput(summary: pd.DataFrame) -> dict[str, float]:
    devices = {p: PlacementConfig(p).num_devices_needed for p in dict.fromkeys(summary["placement"])}
    return analysis.goodput_per_device(analysis.attainment_curve(summary), devices)


def simulate_like(results: Sequence[RunResult], items: dict, spec: WorkloadSpec,
                  engine: EngineConfig, transport: str, profile: DeviceProfile | ProfileSet,
                  transfer_model: TransferModel | None, policy: str = "least_loaded",
                  step_scale: float = 1.0) -> list[RunResult]:
    """The simulated twin of real ``results`` on the same requests and arrival times."""
    out = []
    for placement in dict.fromkeys(r.placement for r in results):
        rates = sorted({r.rate for r in results if r.placement == placement})
        seeds = sorted({r.seed for r in results if r.placement == placement})
        requests = {seed: requests_of(items[seed], f"{placement}/s{seed}") for seed in seeds}
        for rate, seed, res in search.simulate_runs(placement, engine, profile, transfer_model, rates,
                                                    requests, spec.arrival, spec.burstiness, policy,
                                                    transport, step_scale):
            out.append(RunResult(placement, rate, res.records, res.steps, res.transfers,
                                         res.duration_s, seed))
    return out


def validate(cands: Sequence[search.Candidate], rates: Sequence[float], spec: WorkloadSpec,
             model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
             profile: DeviceProfile | ProfileSet, transfer_model: TransferModel | None, slo: SLO,
             out_dir: Path, devices: str | None = None, address: str | None = None,
             policy: str = "least_loaded", local: bool = False, config: dict | None = None,
             speed_spread: float = 0.0, num_reruns: int = 0) -> tuple[pd.DataFrame, dict]:
    """Real runs of ``cands`` (first per placement string) at ``rates``, then ``score``; ``local``:
    workers in this process (tests); ``speed_spread``: the band (0: none); ``num_reruns``: second
    passes over every placement.

    Raises:
        ValueError: a placement that does not fit ``devices``, a workload that does not fit."""
    by_placement = {}
    for cand in cands:
        by_placement.setdefault(cand.placement, cand)
    max_len = context_len(model, engine)
    items = {seed: build_workload(spec, model, seed, max_len) for seed in spec.seed_list}
    passes: list[list[RunResult]] = []
    for _ in range(1 + num_reruns):
        passes.append([])
        for placement, cand in by_placement.items():
            passes[-1] += run_placement(placement, list(rates), items, spec, model,
                                                cand.engine(engine), transfer, devices, address,
                                                policy, local=local, conditional=ConditionalConfig())
    return score(passes[0], list(by_placement.values()), rates, items, spec, engine, transfer,
                 profile, transfer_model, slo, out_dir, policy, config, speed_spread=speed_spread,
                 reruns=passes[1:])


def score(measured: Sequence[RunResult], cands: Sequence[search.Candidate],
          rates: Sequence[float], items: dict, spec: WorkloadSpec, engine: EngineConfig,
          transfer: TransferConfig, profile: DeviceProfile | ProfileSet,
          transfer_model: TransferModel | None,
          slo: SLO, out_dir: Path, policy: str = "least_loaded", config: dict | None = None,
          replay_window_s: float = drift.DEFAULT_WINDOW_S, speed_spread: float = 0.0,
          reruns: Sequence[Sequence[RunResult]] = ()) -> tuple[pd.DataFrame, dict]:
    """Everything after the real runs (also ``benchmarks.plan_accuracy --rescore``): simulate the
    twins (``items``: seed -> workload), write ``out_dir/measured/``, ``simulated/`` and the
    validation*.csv files (``measured_rerun<k>/`` with ``reruns``). Returns (error table: ``COLUMNS
    + OUTCOME_COLUMNS + REPLAY_COLUMNS + BAND_COLUMNS + RERUN_COLUMNS``, NaN where not run;
    ``validation_summary`` plus ``step_correction``, ``step_correction_by_worker``,
    ``step_factor_by_run``, ``corrected``, ``replay``, ``replay_window_s``, ``band``, ``rerun``,
    ``num_reruns``)."""
    by_placement = {c.placement: c for c in cands}
    out_dir.mkdir(parents=True, exist_ok=True)
    factors, by_worker, factor, steps = step_factors(measured, profile)
    steps.to_csv(out_dir / "validation_steps.csv", index=False)

    def simulate(scale, trace=lambda key: None) -> list[RunResult]:
        """Every measured point simulated, steps x ``scale(key)`` (and the trace ``trace(key)``)."""
        out = []
        for placement, cand in by_placement.items():
            for rate in rates:
                for seed, its in items.items():
                    requests = {seed: requests_of(its, f"{placement}/s{seed}")}
                    for _, _, res in search.simulate_runs(
                            placement, cand.engine(engine), profile, transfer_model, [rate],
                            requests, spec.arrival, spec.burstiness, policy, transfer.transport,
                            scale((placement, rate, seed)), trace((placement, rate, seed))):
                        out.append(RunResult(placement, rate, res.records, res.steps,
                                                     res.transfers, res.duration_s, seed))
        return out

    def summarize(twins: list[RunResult]) -> pd.DataFrame:
        """The summary table of simulated twins (few bootstrap draws: only means are read)."""
        return analysis.summary_table(twins, slo, num_boot=10)

    def own_factor(key) -> float:  # a run without a usable step takes the overall factor
        f = factors.get(key, math.nan)
        return f if math.isfinite(f) else (factor if math.isfinite(factor) else 1.0)

    simulated = simulate(lambda key: 1.0)
    config = {**(config or {}), "placements": list(by_placement), "rates": list(rates),
              "workload": spec.options(), "seeds": spec.seed_list,
              "engine": dataclasses.asdict(engine), "transfer": dataclasses.asdict(transfer),
              "slo": dataclasses.asdict(slo), "policy": policy,
              "chunk_budgets": {p: c.chunk_budget for p, c in by_placement.items()}}
    sim_summary, _ = write_results(
        out_dir / "simulated", simulated,
        {**config, "simulated": True, "device_profile": _profile_dict(profile)}, slo)
    meas_summary, _ = write_results(out_dir / "measured", measured,
                                            {**config, "simulated": False}, slo,
                                            simulated=analysis.attainment_curve(sim_summary))
    errors = with_outcomes(error_table(meas_summary, sim_summary), measured, simulated, slo, own_factor)
    summary = validation_summary(errors, _goodput(meas_summary), _goodput(sim_summary))
    summary["step_correction"] = factor
    summary["step_correction_by_worker"] = by_worker
    summary["step_factor_by_run"] = {f"{p}@{rate:g}/s{seed}": f for (p, rate, seed), f in factors.items()}
    if engine.device_profile is not None:  # emulated: the twin is the device, the gap pdlab's
        stages = stage_latency(measured, simulated)
        stages.to_csv(out_dir / "added_latency_stages.csv", index=False)
        summary["added_stages"] = largest_stage_text(stages, engine.emu_time_scale)
    if math.isfinite(factor):
        twins = simulate(own_factor)
        corrected = summarize(twins)
        fixed = with_outcomes(error_table(meas_summary, corrected), measured, twins, slo, own_factor)
        fixed.to_csv(out_dir / "validation_corrected.csv", index=False)
        summary["corrected"] = validation_summary(fixed, _goodput(meas_summary), _goodput(corrected))
    traces = speed_traces(measured, steps, items, spec, replay_window_s)
    pd.DataFrame(
        [{"placement": p, "rate": rate, "seed": seed, **row}
         for (p, rate, seed), trace in traces.items() for row in trace.table().to_dict("records")],
        columns=["placement", "rate", "seed", "worker", "window_start_s", "factor"]
    ).to_csv(out_dir / "validation_speed_trace.csv", index=False)
    replayed = simulate(lambda key: 1.0, traces.get)
    replay_summary = summarize(replayed)
    replay = with_outcomes(error_table(meas_summary, replay_summary), measured, replayed, slo, own_factor)
    replay.to_csv(out_dir / "validation_replay.csv", index=False)
    summary["replay"] = validation_summary(replay, _goodput(meas_summary), _goodput(replay_summary))
    summary["replay_window_s"] = replay_window_s
    errors = with_replay(errors, replay)
    tables = {speed: summarize(simulate(lambda key, scale=scale: scale))
              for speed, scale in (band.scales(speed_spread).items() if speed_spread > 0 else ())}
    errors = with_band(errors, tables)
    if tables:
        summary["band"] = band_summary(errors, summary, speed_spread,
                                       {k: _goodput(t) for k, t in tables.items()})
    rerun_rows, rerun_goodput = [], {}
    for k, again in enumerate(reruns, start=1):
        table, _ = write_results(out_dir / f"measured_rerun{k}", again,
                                         {**config, "simulated": False, "rerun": k}, slo)
        rerun_goodput = rerun_goodput or _goodput(table)
        rerun_rows.append(with_outcomes(error_table(meas_summary, table), measured, again, slo,
                                        own_factor).assign(rerun=k))
    reruns_table = pd.concat(rerun_rows, ignore_index=True) if rerun_rows else pd.DataFrame()
    if rerun_rows:
        reruns_table.to_csv(out_dir / "validation_reruns.csv", index=False)
        summary["rerun"] = validation_summary(reruns_table, _goodput(meas_summary), rerun_goodput)
        summary["num_reruns"] = len(rerun_rows)
    errors = with_reruns(errors, reruns_table)
    errors.to_csv(out_dir / "validation.csv", index=False)
    return errors, summary


def _profile_dict(profile: DeviceProfile | ProfileSet) -> dict:
    """The simulated run's profile: the profile, or a set's base with every offered size's."""
    if isinstance(profile, DeviceProfile):
        return profile.to_dict()
    return {**profile.base.to_dict(), "sizes": {f"tp{tp}pp{pp}": p.to_dict()
                                                for (tp, pp), p in profile.profiles.items()}}


def with_band(errors: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """``errors`` with ``BAND_COLUMNS`` from the slow and fast twins' tables (empty: NaN);
    ``measured_in_band``: 1.0 when the measured attainment lies between them (inclusive)."""
    out = errors.copy()
    if not tables:
        for c in BAND_COLUMNS:
            out[c] = math.nan
        return out
    for speed in band.SPEEDS:
        part = tables[speed][["placement", "rate", "slo_attainment"]].rename(
            columns={"slo_attainment": f"band_{speed}_attainment"})
        out = out.merge(part, on=["placement", "rate"], how="left")
    lo = out[["band_slow_attainment", "band_fast_attainment"]].min(axis=1)
    hi = out[["band_slow_attainment", "band_fast_attainment"]].max(axis=1)
    out["measured_in_band"] = ((out["measured_attainment"] >= lo - 1e-12)
                               & (out["measured_attainment"] <= hi + 1e-12)).astype(float)
    return out


def band_summary(errors: pd.DataFrame, summary: dict, spread: float,
                 goodput: dict[str, dict[str, float]]) -> dict:
    """``spread``, ``num_in_band`` of ``num_points``, ``goodput_band`` (placement -> (slow, fast))
    and ``first_within_band`` (a real first, or its band overlaps one)."""
    bands = {p: (goodput["slow"].get(p, math.nan), goodput["fast"].get(p, math.nan))
             for p in goodput["slow"]}
    measured = summary["measured_goodput"]
    firsts = [p for p, g in measured.items() if measured and g == max(measured.values())]
    planner = summary["simulated_first"]
    lo, hi = bands.get(planner, (math.nan, math.nan))
    within = summary["first_agrees"] or any(  # the two [slow, fast] intervals overlap
        bands.get(p, (math.nan, math.nan))[1] >= lo and hi >= bands.get(p, (math.nan, math.nan))[0]
        for p in firsts)
    return {"spread": spread, "num_points": len(errors),
            "num_in_band": int(errors["measured_in_band"].sum()), "goodput_band": bands,
            "measured_firsts": firsts, "first_within_band": bool(within)}


ADDED_METRICS = ("ttft_p50_s", "tpot_p50_s")


def added_latency(measured: pd.DataFrame, modelled: pd.DataFrame) -> pd.DataFrame:
    """pdlab's added latency on emulated devices per placement and rate: measured minus modelled
    TTFT p50 and TPOT p50, in seconds (``added_<metric>``) and % of modelled (``_pct``); on
    emulated devices what remains is the router, calls, hand-over and transports (or a late host).
    Both frames are ``analysis.summary_table``s."""
    keys = ["placement", "rate"]
    both = measured[keys + list(ADDED_METRICS)].merge(
        modelled[keys + list(ADDED_METRICS)], on=keys, suffixes=("_measured", "_modelled"))
    out = both[keys].copy()
    for m in ADDED_METRICS:
        name = m.removesuffix("_s")
        out[f"{name}_measured_s"] = both[f"{m}_measured"]
        out[f"{name}_modelled_s"] = both[f"{m}_modelled"]
        out[f"added_{name}_s"] = both[f"{m}_measured"] - both[f"{m}_modelled"]
        out[f"added_{name}_pct"] = 100 * out[f"added_{name}_s"] / both[f"{m}_modelled"]
    return out


# A request's stages as ``engine.metrics`` stamps them: (name, from stamp, to stamp).
STAGES = (("arrival to prefill start", metrics.ARRIVED, metrics.PREFILL_STARTED),
          ("prefill", metrics.PREFILL_STARTED, metrics.PREFILL_FINISHED),
          ("KV put", metrics.PREFILL_FINISHED, metrics.KV_PUT),
          ("hand-over to KV fetched", metrics.KV_PUT, metrics.KV_GOT),
          ("KV fetched to first decode", metrics.KV_GOT, metrics.DECODE_ADMITTED))


def _stage_medians(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Median seconds per stage (NaN without both stamps), plus ``first token to router``,
    ``first decode gap`` and ``later decode gaps`` (ITL)."""
    out = {}
    for name, a, b in STAGES:
        v = [r.timeline[b] - r.timeline[a] for r in records if a in r.timeline and b in r.timeline]
        out[name] = float(np.median(v)) if v else math.nan
    first = [r.token_times_s[0] - r.timeline[metrics.PREFILL_FINISHED] for r in records
             if r.token_times_s and metrics.PREFILL_FINISHED in r.timeline]
    gaps = [np.diff(r.token_times_s) for r in records if len(r.token_times_s) > 2]
    out["first token to router"] = float(np.median(first)) if first else math.nan
    out["first decode gap"] = float(np.median([g[0] for g in gaps])) if gaps else math.nan
    out["later decode gaps"] = (float(np.median(np.concatenate([g[1:] for g in gaps])))
                                if gaps else math.nan)
    return out


def stage_latency(measured: Sequence[RunResult], modelled: Sequence[RunResult]) -> pd.DataFrame:
    """Where pdlab's added latency goes: rows ``placement, rate, stage, measured_s, modelled_s,
    added_s`` (median seconds per stage, pooled over seeds, real vs simulated twin). On emulated
    devices the difference is pdlab's own overhead per stage."""
    def pooled(results) -> dict:
        by_point: dict[tuple, list] = {}
        for r in results:
            by_point.setdefault((r.placement, r.rate), []).extend(r.records)
        return by_point
    real, twin = pooled(measured), pooled(modelled)
    rows = []
    for key, records in real.items():
        got, want = _stage_medians(records), _stage_medians(twin.get(key, []))
        for stage, value in got.items():
            rows.append({"placement": key[0], "rate": key[1], "stage": stage,
                         "measured_s": value, "modelled_s": want[stage],
                         "added_s": value - want[stage]})
    return pd.DataFrame(rows, columns=["placement", "rate", "stage", "measured_s",
                                       "modelled_s", "added_s"])


def largest_stage_text(stages: pd.DataFrame, time_scale: float = 1.0) -> str:
    """Per placement the stage adding most at the median over rates, in ms (empty: nothing
    measured); a dilated run (``time_scale`` S > 1) says its figures are the host's time / S."""
    lines = []
    for placement, rows in stages.dropna(subset=["added_s"]).groupby("placement", sort=False):
        per_stage = rows.groupby("stage", sort=False)["added_s"].median()
        per_stage = per_stage[[s for s in per_stage.index if s != "later decode gaps"]]
        if per_stage.empty:
            continue
        worst = per_stage.idxmax()
        itl = rows.loc[rows["stage"] == "later decode gaps", "added_s"].median()
        lines.append(f"{placement}: pdlab's largest added stage is {worst} "
                     f"({1e3 * per_stage[worst]:+.2f} ms, median over rates); each later "
                     f"decode step {1e3 * itl:+.2f} ms")
    if lines and time_scale != 1:
        lines.append(f"(time dilated x {time_scale:g}: each figure is this host's added time "
                     f"/ {time_scale:g}; the undilated cost is {time_scale:g} x)")
    return "\n".join(lines)


def write_with_twin(out_dir: Path, results: Sequence[RunResult], config: dict, slo: SLO,
                    items: dict, spec: WorkloadSpec, engine: EngineConfig, transport: str,
                    profile: DeviceProfile | ProfileSet, policy: str) -> tuple[pd.DataFrame, str]:
    """``pdlab compare --simulate``: every real run simulated too, drawn dashed over the measured
    curve, validation.csv written; returns (summary, verdict text with the simulator's error)."""
    base = profile.base if isinstance(profile, ProfileSet) else profile
    twins = simulate_like(results, items, spec, engine, transport, profile,
                          base.transfers.get(transport), policy)
    simulated = analysis.summary_table(twins, slo, num_boot=100)
    summary, verdict_text = write_results(out_dir, results, config, slo,
                                          simulated=analysis.attainment_curve(simulated))
    factors, by_worker, factor, _ = step_factors(results, profile)
    errors = with_outcomes(error_table(summary, simulated), results, twins, slo,
                           lambda key: factors.get(key, math.nan))
    errors.to_csv(out_dir / "validation.csv", index=False)
    stages_text = ""
    if config.get("emulated"):  # the twin is the device itself: the gap is pdlab's own
        added_latency(summary, simulated).to_csv(out_dir / "added_latency.csv", index=False)
        stages = stage_latency(results, twins)
        stages.to_csv(out_dir / "added_latency_stages.csv", index=False)
        stages_text = largest_stage_text(stages, engine.emu_time_scale)
    check = validation_summary(errors, _goodput(summary), _goodput(simulated))
    check.update(step_correction=factor, step_correction_by_worker=by_worker)
    return summary, (verdict_text + "\nSimulated twin (pdlab plan's simulator): "
                     + summary_text(check) + (f"\n{stages_text}" if stages_text else ""))
