"""One placement deployed once and a workload replayed on it at each rate and seed, with the
calibration that picks the rates: the runs of ``pdlab run``, ``compare`` and ``plan --validate``.

1. Deploy the placement (``deployment.placement.Deployment``), warm it up with two discarded
   requests.
2. With no rates given, calibrate: two requests each served alone (their TTFT and TPOT), then
   the first seed's requests as one burst, whose throughput is the capacity; the rates are
   ``CALIBRATION_FACTORS`` x the capacity (``calibrated_rates``).
3. For each rate and seed, replay that seed's workload open-loop through the router and keep
   that run's request, step and KV transfer records (``RunResult``)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from engine import metrics
from engine.config import ConditionalConfig, EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.metrics import SLO, RequestRecord
from experiments import dilation as dilate
from deployment.placement import Deployment
from experiments.workload_spec import MultiTurn, Timed, WorkloadSpec, router_workload


def default_placements(num_devices: int) -> list[str]:
    """``colocated:N`` and every ``disagg:xPyD`` with x + y = N."""
    return [f"colocated:{num_devices}"] + [f"disagg:{x}p{num_devices - x}d"
                                           for x in range(1, num_devices)]


@dataclass
class RunResult:
    """One (placement, rate, seed) run: its records, and the step and transfer records of
    that run only."""

    placement: str
    rate: float
    records: list[RequestRecord]
    steps: list[dict]
    transfers: list[dict]
    duration_s: float
    seed: int = 0


CALIBRATION_FACTORS = (0.5, 1.5, 4.0)  # x the measured capacity: under, near, past saturation


def calibrated_rates(capacity_req_s: float, factors=CALIBRATION_FACTORS) -> list[float]:
    """The rate ladder ``factor * capacity`` (req/s), each rounded to 2 significant digits.

    The capacity is the completed-request throughput of a burst (every request at t = 0) on the
    deployed placement: the rate it can sustain. Below it queues stay short, above it they grow with
    every request, so SLO attainment bends inside the ladder on any machine.

    Raises:
        ValueError: capacity not > 0."""
    if not capacity_req_s > 0:
        raise ValueError(f"calibration measured no capacity ({capacity_req_s!r} req/s)")
    return [float(f"{f * capacity_req_s:.2g}") for f in factors]


SLO_TTFT_SCALE, SLO_TPOT_SCALE = 4.0, 2.0  # x a lone request's latency: the tightest SLO used


def calibrated_slo(slo: SLO, lone_ttft_s: float, lone_tpot_s: float | None) -> SLO:
    """The SLO a calibrated run judges by: each target no tighter than ``SLO_TTFT_SCALE`` x
    (``SLO_TPOT_SCALE`` x) what a lone request achieved on this machine, else as given. As
    DistServe's "SLO scale": a target a lone request misses makes attainment 0 at every rate."""
    def loosen(given: float, measured: float) -> float:  # 3 significant digits when loosened
        return given if measured <= given else float(f"{measured:.3g}")

    tpot = slo.tpot_s if lone_tpot_s is None else loosen(slo.tpot_s, SLO_TPOT_SCALE * lone_tpot_s)
    return SLO(loosen(slo.ttft_s, SLO_TTFT_SCALE * lone_ttft_s), tpot)


def _lone_latency(dep, items, spec: WorkloadSpec, placement: str) -> tuple[float, float | None]:
    """Mean TTFT and TPOT of two requests each served alone (seconds)."""
    ttfts, tpots = [], []
    for i, item in enumerate(items[:2]):
        (record,) = dep.run(router_workload([item], math.inf, spec, tag=f"{placement}-lone{i}"))
        if metrics.ttft_s(record) is not None:
            ttfts.append(metrics.ttft_s(record))
        if metrics.tpot_s(record) is not None:
            tpots.append(metrics.tpot_s(record))
    if not ttfts:
        raise RuntimeError("calibration: a lone request produced no token")
    return sum(ttfts) / len(ttfts), (sum(tpots) / len(tpots) if tpots else None)


def run_placement(placement: str, rates: list[float] | None, items, spec: WorkloadSpec,
                  model: ModelConfig, engine: EngineConfig, transfer: TransferConfig,
                  devices: str | None, address: str | None,
                  policy: str = "least_loaded", worker_info: list | None = None,
                  local: bool = False, calibration: dict | None = None,
                  conditional: ConditionalConfig | None = None,
                  max_worker_restarts: int = 0,
                  num_requests: Callable[[float], int] | None = None) -> list[RunResult]:
    """Deploy one placement once and replay the workload at each rate and seed.

    ``items``: seed -> workload (or one for every seed); ``num_requests(rate)``: a run replays
    that many of each seed's first requests (None: all). ``worker_info`` (a list) receives each
    worker's ``info()``. ``rates=None``: calibrate first; ``calibration`` (a dict) receives
    ``capacity_req_s``, ``rates``, ``lone_ttft_s`` and ``lone_tpot_s``. ``engine.emu_time_scale``
    S > 1: arrivals and the transfer timeout x S, measured times / S (``experiments.dilation``).

    Raises:
        ValueError: a request does not fit the deployed workers' context; a dilated
            multi-turn workload; ``num_requests`` with a trace or multi-turn workload."""
    by_seed = items if isinstance(items, dict) else {s: items for s in spec.seed_list}
    if num_requests is not None and any(isinstance(its, (Timed, MultiTurn))
                                        for its in by_seed.values()):
        raise ValueError("num_requests cuts a workload whose arrivals each rate draws; a trace "
                         "or a multi-turn workload keeps its own arrivals: replay it whole")
    dilation = engine.emu_time_scale  # 1 but on dilated emulated devices (experiments.dilation)
    for its in by_seed.values():
        dilate.check_dilatable(its, dilation)
    results = []
    with Deployment(PlacementConfig(placement, devices, address), model, engine,
                    dilate.dilated_transfer(transfer, dilation), policy=policy, local=local,
                    conditional=conditional, max_worker_restarts=max_worker_restarts) as dep:
        longest = max(it.num_prompt_tokens + it.output_len for its in by_seed.values() for it in its)
        if longest > dep.router.max_model_len:
            raise ValueError(f"a request of {longest} tokens (prompt + output) does not fit the "
                             f"workers' context of {dep.router.max_model_len} tokens")
        if worker_info is not None:
            worker_info += [{"placement": placement, **i} for i in dep.gather("info")]
        first = next(iter(by_seed.values()))[:2]
        dep.run(router_workload(first, math.inf, spec, tag=f"{placement}-warmup"))
        if rates is None:
            seed, its = next(iter(by_seed.items()))
            lone_ttft_s, lone_tpot_s = _lone_latency(dep, its, spec, placement)
            lone_ttft_s /= dilation
            lone_tpot_s = None if lone_tpot_s is None else lone_tpot_s / dilation
            dep.reset_prefix_cache()
            start_s = time.time()
            burst = dep.run(router_workload(its, math.inf, spec, tag=f"{placement}-calibration"))
            capacity = sum(not r.error for r in burst) / ((time.time() - start_s) / dilation)
            rates = calibrated_rates(capacity)
            print(f"pdlab: calibration on {placement}: capacity {capacity:.3g} req/s -> rates "
                  f"{rates} req/s", file=sys.stderr)
            if calibration is not None:
                calibration.update(capacity_req_s=capacity, factors=list(CALIBRATION_FACTORS),
                                   rates=rates, placement=placement, lone_ttft_s=lone_ttft_s,
                                   lone_tpot_s=lone_tpot_s)
        for rate in rates:
            for seed, every in by_seed.items():
                its = every if num_requests is None else every[:num_requests(rate)]
                workload = dilate.dilated_workload(router_workload(
                    its, rate, spec, tag=f"{placement}@{rate:g}/s{seed}", seed=seed), dilation)
                dep.reset_prefix_cache()  # each run starts cold (no hits inherited)
                bar = tqdm(total=len(its), desc=f"{placement} @ {rate:g} req/s seed {seed}",
                           unit="req")
                start_s = time.time()
                records = dep.run(workload, on_finish=lambda _record: bar.update())
                end_s = time.time()
                bar.close()
                ids = {r.request_id for r in records}
                steps = [s for s in dep.step_records() if start_s <= s["start_s"] <= end_s]
                transfers = [t for t in dep.transfer_records() if t["request_id"] in ids]
                if dilation != 1:  # every time read from here on is the emulated device's
                    records = [dilate.undilate_record(r, dilation, start_s) for r in records]
                    steps = [dilate.undilate_step(s, dilation, start_s) for s in steps]
                    transfers = [dilate.undilate_transfer(t, dilation, start_s) for t in transfers]
                results.append(RunResult(placement, rate, records, steps, transfers,
                                         (end_s - start_s) / dilation, seed))
    return results
