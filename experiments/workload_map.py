"""The small SLO map a ``pdlab run`` / ``pdlab compare`` report carries for its own workload
(``planner.slo_map``'s, fed the run):

1. The profile (``profile_for``): ``--simulate``'s, else the newest ``results/profile-*/`` of the
   model, else the one pdlab ships (``SHIPPED``). None: no map, and the report says why.
2. Its step times scaled by this run's own steps (``validate.step_factors``).
3. The run's own requests, ``slo_map.map_candidates`` on the run's devices with instances of
   each size a ``ProfileSet`` offers (the run's TP/PP sizes among them), else one device each,
   ``NUM_RATES`` rates,
   a ``STEPS`` x ``STEPS`` SLO grid from 1/4 x to 4 x the run's SLO (at the centre), the speed
   band +/- ``SPREAD``.
4. ``map.csv`` and ``map.png``, and the report's lines: the regions, and the centre cell beside
   what the run measured there."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig, ModelConfig, PlacementConfig
from engine.metrics import SLO
from experiments import analysis, plots, validate
from experiments.options import find_profile, what_if_transfer
from experiments.replay import RunResult
from experiments.workload_spec import WorkloadSpec, requests_of
from planner import search, slo_map
from planner.latency import DeviceProfile
from planner.sizes import ProfileSet

# (model, dtype) -> the profile pdlab ships for it (package data, planner/profiles/).
SHIPPED = {("smollm2-135m", "float32"):
           Path(__file__).resolve().parent.parent / "planner" / "profiles" / "smollm2-135m-float32-cpu.json"}
NUM_RATES = 12
STEPS = 5  # 1/4, 1/2, 1, 2, 4 x the run's SLO
SPREAD = 0.15  # pdlab map's default speed band
TITLE = "Where does disaggregation win? (the planner's map of this workload)"


def profile_for(model: ModelConfig, simulate: DeviceProfile | ProfileSet | None = None,
                root: Path = Path("results")) -> tuple[DeviceProfile | ProfileSet | None, str]:
    """Step 1: (profile, where it came from), or (None, why there is none). A measured
    profile under ``root`` that cannot be read is skipped (``find_profile``)."""
    if simulate is not None:
        return simulate, "the --simulate profile"
    path = find_profile(model, root)
    if path is not None:
        return DeviceProfile.load(path), str(path)
    shipped = SHIPPED.get((model.model, model.dtype))
    if shipped is not None and shipped.exists():
        profile = DeviceProfile.load(shipped)
        return profile, f"the one pdlab ships ({shipped.name}, {profile.device_name})"
    return None, (f"no device profile of {model.model} ({model.dtype}): run `pdlab profile` "
                  "to get this map")


def slo_grids(slo: SLO, steps: int = STEPS) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Step 3's SLO grid: ``steps`` TTFT and TPOT targets (s) from 1/4 x to 4 x ``slo``'s,
    geometric, 4 significant digits (``slo_map.parse_range``); with an odd ``steps`` the
    middle ones are ``slo``'s own (to 4 digits)."""
    def grid(v: float) -> tuple[float, ...]:
        return slo_map.parse_range(f"{v / 4!r}:{v * 4!r}:{steps}")
    return grid(slo.ttft_s), grid(slo.tpot_s)


def measured_goodput(results: Sequence[RunResult], slo: SLO) -> dict[str, float]:
    """placement -> the run's measured goodput per device (req/s) at ``slo``, the figure of
    its goodput.csv and verdict (``analysis.goodput_points``: the mean over seeds of each
    sweep's goodput); placements with no complete sweep are left out."""
    devices = {r.placement: PlacementConfig(r.placement).num_devices_needed for r in results}
    goodput = analysis.goodput_points(results, slo, devices)
    return {p: g for p, g in goodput.items() if not math.isnan(g)}


def report_map(out_dir: Path, results: Sequence[RunResult], items: dict, spec: WorkloadSpec,
               model: ModelConfig, engine: EngineConfig, transport: str, num_devices: int,
               slo: SLO, policy: str = "least_loaded",
               simulate: DeviceProfile | ProfileSet | None = None
               ) -> tuple[list[str], Path | None]:
    """Steps 1-4 (module docstring) for one finished run.

    ``slo``: the SLO the run was judged by (the calibrated one under ``--calibrate``);
    ``simulate``: one profile, or a ``ProfileSet`` whose sizes the map's placements take.

    Returns:
        (the report's lines, the heatmap's path or None). No map (one line saying why): fewer
        than 2 devices, a trace or multi-turn workload (its timing is not a rate), or no
        profile, or one that cannot model the run's transport; never raises for those."""
    if num_devices < 2:
        return [f"No map: {num_devices} device (placements need 2 to differ)."], None
    requests = {s: requests_of(its, f"s{s}") for s, its in items.items()}
    if any(type(r) is not list for r in requests.values()):
        return ["No map: a trace or multi-turn workload sets its own timing, not a rate."], None
    profile, source = profile_for(model, simulate)
    if profile is None:
        return [f"No map: {source}."], None
    start = time.perf_counter()
    factor = validate.step_factors(results, profile)[2]
    scaled = profile.scaled(factor) if math.isfinite(factor) and factor > 0 else profile
    sized = isinstance(scaled, ProfileSet)
    base = scaled.base if sized else scaled
    try:
        transfer = what_if_transfer(base, transport, None, None, True)
    except ValueError as err:
        return [f"No map: {err}"], None
    sizes = scaled.sizes if sized else ((1, 1),)
    cands = slo_map.map_candidates(num_devices, sizes=sizes)
    flat = [it for its in items.values() for it in its]
    mean_p = sum(it.num_prompt_tokens for it in flat) / len(flat)
    mean_o = sum(it.output_len for it in flat) / len(flat)
    rates = search.auto_rates(base, mean_p, mean_o, num_devices, NUM_RATES, engine.max_num_seqs)
    ttft, tpot = slo_grids(slo)
    ratio = mean_p / mean_o
    table, _, _ = slo_map.map_ratio(cands, rates, requests, engine, scaled, transfer, ttft, tpot,
                                    ratio, SPREAD, spec.arrival, spec.burstiness, policy, jobs=1)
    wall_s = time.perf_counter() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(out_dir / "map.csv", index=False)
    png = plots.plot_slo_map(table, ttft, tpot, out_dir / "map.png",
                             f"{model.model}, {num_devices} devices, this run's workload "
                             f"(prompt:output {ratio:.3g})")
    centre = table[(table["ttft_index"] == STEPS // 2) & (table["tpot_index"] == STEPS // 2)].iloc[0]
    measured = measured_goodput(results, slo)
    best = max(measured.values(), default=0.0)
    firsts = [p for p, g in measured.items() if g == best]
    lines = [f"The planner's map of this workload on {num_devices} devices ({len(table)} cells "
             f"in {wall_s:.1f} s; profile: {source}, its steps x {factor:.3g} to match this "
             f"run's own; {len(cands)} placements"
             + (f" of instance sizes (TP, PP) {', '.join(map(str, sizes))}" if sized else "")
             + f" x rates {rates} req/s, "
             f"speed band +/-{SPREAD:g}):"]
    lines += ["  " + line for line in slo_map.regions(table, ttft, tpot)]
    pick = (centre["verdict"] if centre["verdict"] in (slo_map.NO_CLEAR, slo_map.NONE)
            else f"{centre['winner']} ({centre['goodput_per_device_req_s']:.3g} req/s per device, "
                 f"{100 * centre['margin']:.0f}% over {centre['runner_up'] or 'nothing'})")
    if centre["verdict"] == slo_map.NO_CLEAR:
        pick += (f" ({centre['winner']} {centre['goodput_per_device_req_s']:.3g} vs "
                 f"{centre['runner_up']} {centre['runner_up_goodput_per_device_req_s']:.3g} req/s "
                 "per device)")
    lines.append(f"  At this run's SLO (TTFT <= {slo.ttft_s:.3g} s, TPOT <= {slo.tpot_s:.3g} s) "
                 f"the map says {pick}; this run measured "
                 + (" = ".join(firsts) + f" first ({best:.3g} req/s per device over its "
                    f"{len({r.rate for r in results})} rates)" if best > 0 else "no goodput at its rates")
                 + ".")
    return lines, png
