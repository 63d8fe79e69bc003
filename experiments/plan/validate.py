"""``pdlab plan --validate``: the simulator's own error against real runs, every time.

A validation:

1. The same requests (``compare.build_workload``, seeds ``seed ..``) run for real through
   ``compare.run_placement`` (deployed workers, the router, the transport) at each rate, and
   through the simulator (``search.simulate_runs``) with the same arrival times.
2. Both are written as results directories by ``compare.write_results``: ``measured/``
   (its attainment plot overlays the simulated curve, dashed) and ``simulated/`` (its
   config row marked ``simulated: true``), so every report and plot reads both.
3. Per (placement, rate), from the two summary tables (means over seeds):
   ``attainment_err_points`` = 100 x (simulated - measured) SLO attainment, and the
   relative error (simulated - measured) / measured of TTFT p50/p99 and TPOT p50/p99.
   Written to validation.csv; ``validation_summary`` gives the mean absolute attainment
   error (points) and the mean |relative error| per latency, and which placement each side
   ranks first by goodput per device (DistServe's, ``analysis.goodput_per_device``).
4. The step-time correction factor (``latency.step_correction``: median over the real runs' worker
   steps of measured ÷ modelled seconds; NVIDIA Dynamo's SLA planner corrects its profile
   the same way, observed ÷ expected): a machine busier (or quieter) than when it was
   profiled shows here. The simulation is repeated with every step scaled by it and its
   errors written to validation_corrected.csv: what is left is the model's error, not the
   machine's drift.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from engine.config import ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import SLO
from experiments import analysis, compare
from experiments.plan import search
from experiments.plan.latency import DeviceProfile, TransferModel, step_correction

LATENCIES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
COLUMNS = (["placement", "rate", "measured_attainment", "simulated_attainment",
            "attainment_err_points"]
           + [f"{k}_{c}" for c in LATENCIES for k in ("measured", "simulated")]
           + [f"{c.removesuffix('_s')}_rel_err" for c in LATENCIES])


def error_table(measured: pd.DataFrame, simulated: pd.DataFrame) -> pd.DataFrame:
    """Step 3: one row per (placement, rate) both summary tables have (``COLUMNS``).

    Raises:
        ValueError: the tables share no (placement, rate) point.
    """
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


def validation_summary(errors: pd.DataFrame, measured_goodput: dict[str, float],
                       simulated_goodput: dict[str, float]) -> dict:
    """Mean |attainment error| (points), mean |relative error| per latency, and the placement
    each side ranks first (ties: the first listed)."""
    out = {"num_points": len(errors),
           "attainment_mae_points": float(errors["attainment_err_points"].abs().mean())}
    for c in LATENCIES:
        col = f"{c.removesuffix('_s')}_rel_err"
        v = errors[col].abs().replace([np.inf], np.nan).dropna()
        out[f"{col}_mean_abs"] = float(v.mean()) if len(v) else math.nan
    best = lambda g: max(g, key=g.get) if g else None  # noqa: E731
    out["measured_first"], out["simulated_first"] = best(measured_goodput), best(simulated_goodput)
    out["measured_goodput"], out["simulated_goodput"] = measured_goodput, simulated_goodput
    return out


def summary_text(s: dict) -> str:
    """The validation in one paragraph (with the corrected figures when there are any)."""
    text = _summary_line(s)
    if "step_correction" in s:
        text += (f"\nstep-time correction factor (measured ÷ modelled, median over the real "
                 f"steps): {s['step_correction']:.3g}")
        if s.get("step_correction_by_worker"):
            text += " (" + ", ".join(f"{k} {v:.3g}" for k, v in s["step_correction_by_worker"].items()) + ")"
    if "corrected" in s:
        text += "\nwith steps scaled by it: " + _summary_line(s["corrected"])
    return text


def _summary_line(s: dict) -> str:
    lat = ", ".join(f"{c.removesuffix('_s').replace('_', ' ')} {100 * s[c.removesuffix('_s') + '_rel_err_mean_abs']:.1f}%"
                    for c in LATENCIES)
    agree = "agree" if s["measured_first"] == s["simulated_first"] else "DISAGREE"
    return (f"validation over {s['num_points']} points: SLO attainment mean abs error "
            f"{s['attainment_mae_points']:.1f} points; mean |relative error| {lat}; first by "
            f"goodput per device: measured {s['measured_first']}, simulated "
            f"{s['simulated_first']} ({agree})")


def _goodput(summary: pd.DataFrame) -> dict[str, float]:
    devices = {p: PlacementConfig(p).num_devices_needed for p in dict.fromkeys(summary["placement"])}
    return analysis.goodput_per_device(analysis.attainment_curve(summary), devices)


def simulate_like(results: Sequence[compare.RunResult], items: dict, spec: compare.WorkloadSpec,
                  engine: EngineConfig, transport: str, profile: DeviceProfile,
                  transfer_model: TransferModel | None, policy: str = "least_loaded",
                  step_scale: float = 1.0) -> list[compare.RunResult]:
    """The simulated twin of real ``results``: every (placement, rate, seed) they hold, on
    the same requests (``items``: seed -> workload) and arrival times."""
    out = []
    for placement in dict.fromkeys(r.placement for r in results):
        rates = sorted({r.rate for r in results if r.placement == placement})
        seeds = sorted({r.seed for r in results if r.placement == placement})
        requests = {seed: search.timed_requests(items[seed], f"{placement}/s{seed}") for seed in seeds}
        for rate, seed, res in search.simulate_runs(placement, engine, profile, transfer_model, rates,
                                                    requests, spec.arrival, spec.burstiness, policy,
                                                    transport, step_scale):
            out.append(compare.RunResult(placement, rate, res.records, res.steps, res.transfers,
                                         res.duration_s, seed))
    return out


def validate(cands: Sequence[search.Candidate], rates: Sequence[float], spec: compare.WorkloadSpec,
             model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
             profile: DeviceProfile, transfer_model: TransferModel | None, slo: SLO,
             out_dir: Path, devices: str | None = None, address: str | None = None,
             policy: str = "least_loaded", local: bool = False, config: dict | None = None
             ) -> tuple[pd.DataFrame, dict]:
    """Steps 1-3 for ``cands`` (one per placement string: the first wins) at ``rates``;
    writes ``out_dir/measured/``, ``out_dir/simulated/`` and ``out_dir/validation.csv``.
    ``local``: workers in this process (tests; transport ``inprocess``).

    Returns:
        (error table, summary dict of ``validation_summary``).

    Raises:
        ValueError: a placement that does not fit ``devices``, a workload that does not fit.
    """
    by_placement = {}
    for cand in cands:
        by_placement.setdefault(cand.placement, cand)
    max_len = compare.context_len(model, engine)
    items = {seed: compare.build_workload(spec, model, seed, max_len) for seed in spec.seed_list}
    measured: list[compare.RunResult] = []
    for placement, cand in by_placement.items():
        measured += compare.run_placement(placement, list(rates), items, spec, model,
                                          cand.engine(engine), transfer, devices, address, policy,
                                          local=local, conditional=ConditionalConfig())
    factor = step_correction([s for r in measured for s in r.steps], profile)
    by_worker = {}  # where the model is off: one factor per placement and worker
    for r in measured:
        for st in r.steps:
            by_worker.setdefault(f"{r.placement} {st['worker']}", []).append(st)
    by_worker = {k: step_correction(v, profile) for k, v in by_worker.items()}

    def simulate(scale: float) -> list[compare.RunResult]:
        out = []
        for placement, cand in by_placement.items():
            requests = {seed: search.timed_requests(its, f"{placement}/s{seed}")
                        for seed, its in items.items()}
            for rate, seed, res in search.simulate_runs(
                    placement, cand.engine(engine), profile, transfer_model, rates, requests,
                    spec.arrival, spec.burstiness, policy, transfer.transport, scale):
                out.append(compare.RunResult(placement, rate, res.records, res.steps,
                                             res.transfers, res.duration_s, seed))
        return out

    simulated = simulate(1.0)
    config = {**(config or {}), "placements": list(by_placement), "rates": list(rates),
              "workload": spec.options(), "seeds": spec.seed_list,
              "engine": dataclasses.asdict(engine), "transfer": dataclasses.asdict(transfer),
              "slo": dataclasses.asdict(slo), "policy": policy}
    sim_summary, _ = compare.write_results(
        out_dir / "simulated", simulated,
        {**config, "simulated": True, "device_profile": profile.to_dict()}, slo)
    meas_summary, _ = compare.write_results(out_dir / "measured", measured,
                                            {**config, "simulated": False}, slo,
                                            simulated=analysis.attainment_curve(sim_summary))
    errors = error_table(meas_summary, sim_summary)
    errors.to_csv(out_dir / "validation.csv", index=False)
    summary = validation_summary(errors, _goodput(meas_summary), _goodput(sim_summary))
    summary["step_correction"] = factor
    summary["step_correction_by_worker"] = by_worker
    if math.isfinite(factor):
        runs = [analysis.Run(r.placement, r.rate, r.records, r.seed, r.duration_s)
                for r in simulate(factor)]
        corrected = analysis.summary_table(runs, slo, num_boot=10)
        fixed = error_table(meas_summary, corrected)
        fixed.to_csv(out_dir / "validation_corrected.csv", index=False)
        summary["corrected"] = validation_summary(fixed, _goodput(meas_summary), _goodput(corrected))
    return errors, summary
