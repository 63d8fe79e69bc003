"""Placement search on the simulator: which placement of N devices gives the most goodput per
device for these SLOs and this workload (DistServe's question, with the KV transfer in; no torch).

1. ``candidates``: ``colocated:N`` at each chunk budget, ``colocated-nochunk:N``, and every
   ``disagg:xPyD`` with x + y <= N.
2. ``auto_rates`` (unless given): a geometric ladder around a crude capacity estimate.
3. ``sweep``: every (candidate, rate, seed) simulated on the requests and arrival times the real
   runs use (``compare.build_workload``, ``engine.arrivals``); ``refine_rates`` adds rates inside
   each candidate's 90%-attainment bracket, as DistServe's binary search narrows it.
4. ``rank``: goodput per device (``engine.metrics.goodput_rate``) of the mean-over-seeds curve,
   and per seed for its spread, best first. 5. ``plot_best``: attainment vs rate per device."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from engine import metrics as m
from engine.config import ConditionalConfig, EngineConfig, PlacementConfig
from engine.placement import Placement
from engine.metrics import SLO, RequestRecord
from engine.request import Request
from engine.arrivals import arrival_times
from planner.latency import DeviceProfile, StepFeatures, TransferModel
from engine.kv_heads import kv_heads_of
from planner.simulate import InstanceModel, SimResult, Simulator
from planner.sizes import ProfileSet


@dataclass(frozen=True)
class Candidate:
    """A placement and, for chunked colocated ones, the chunk budget (tokens per step; None = the
    engine config's ``max_num_batched_tokens``)."""

    placement: str
    chunk_budget: int | None = None

    @property
    def label(self) -> str:
        return self.placement + (f" (budget {self.chunk_budget})" if self.chunk_budget else "")

    @property
    def num_devices(self) -> int:
        return PlacementConfig(self.placement).num_devices_needed

    def engine(self, base: EngineConfig) -> EngineConfig:
        if self.chunk_budget is None:
            return base
        return dataclasses.replace(base, max_num_batched_tokens=self.chunk_budget)


def sized(head: str, prefill: tuple[int, int], decode: tuple[int, int] | None = None) -> str:
    """The canonical spelling (``str(Placement)``) of ``head`` (``colocated:2``, ``disagg:2p1d``)
    with its prefill (or every) instance at ``(tp, pp)`` ``prefill``, its decode instances at
    ``decode`` (default: ``prefill``), e.g. ``disagg:2p1d+ptp2+dtp4``."""
    d = decode or prefill
    if head.startswith("colocated"):
        return str(Placement.parse(f"{head}+tp{prefill[0]}+pp{prefill[1]}"))
    return str(Placement.parse(f"{head}+ptp{prefill[0]}+ppp{prefill[1]}+dtp{d[0]}+dpp{d[1]}"))


def candidates(num_devices: int, chunk_budgets: Sequence[int] = (),
               sizes: Sequence[tuple[int, int]] = ((1, 1),)) -> list[Candidate]:
    """Step 1, per instance size ``(tp, pp)`` of ``sizes`` (ascending by devices): the colocated
    placements of as many instances of one size as fit ``num_devices`` (budgets ascending), then
    every ``disagg:xPyD`` whose x prefill instances of one size and y decode instances of one
    size (each phase its own) fit in ``num_devices`` devices, by devices used. With ``sizes``
    ``((1, 1),)``: ``colocated:N``, its budgets, ``colocated-nochunk:N``, every x + y <= N.

    Raises:
        ValueError: ``num_devices < 1`` or no size."""
    if num_devices < 1:
        raise ValueError(f"devices must be >= 1, got {num_devices}")
    if not sizes:
        raise ValueError("no instance size to place")
    out = []
    for size in sizes:
        count = num_devices // (size[0] * size[1])
        if count < 1:
            continue
        out.append(Candidate(sized(f"colocated:{count}", size)))
        out += [Candidate(sized(f"colocated:{count}", size), b) for b in sorted(set(chunk_budgets))]
        out.append(Candidate(sized(f"colocated-nochunk:{count}", size)))
    disagg = []
    for p in sizes:
        for d in sizes:
            dp, dd = p[0] * p[1], d[0] * d[1]
            for x in range(1, num_devices // dp + 1):
                for y in range(1, (num_devices - x * dp) // dd + 1):
                    disagg.append((x * dp + y * dd, x + y, x, p, d, y))
    disagg.sort(key=lambda c: c[:3])
    out += [Candidate(sized(f"disagg:{x}p{y}d", p, d)) for _, _, x, p, d, y in disagg]
    return out


def auto_rates(profile: DeviceProfile, mean_prompt: float, mean_output: float, num_devices: int,
               num_rates: int = 8, max_num_seqs: int = 16) -> list[float]:
    """``num_rates`` total arrival rates (req/s), geometric from 0.25x to ``2 * max_num_seqs`` x
    (within 8x-32x) of ``num_devices`` over one lone request's time (prefill + decode steps at
    batch 1), two significant digits.

    Raises:
        ValueError: ``num_rates < 2`` or a lone request that takes no time."""
    if num_rates < 2:
        raise ValueError(f"num_rates must be >= 2, got {num_rates}")
    p = max(1, round(mean_prompt))
    prefill_s = profile.step_s(StepFeatures(p, p * p))
    decode_s = profile.step_s(StepFeatures(batch_size=1, sum_context=round(p + mean_output / 2)))
    lone_s = prefill_s + max(mean_output - 1, 0) * decode_s
    if not lone_s > 0:
        raise ValueError("the profile predicts a request takes no time")
    base = num_devices / lone_s
    top = min(max(8.0, 2.0 * max_num_seqs), 32.0)  # 256 seqs fit, but the budget caps the batch
    return sorted({float(f"{base * f:.2g}") for f in np.geomspace(0.25, top, num_rates)})


def arrivals(requests: Sequence[Request], rate: float, seed: int, process: str = "poisson",
             burstiness: float = 1.0) -> list[tuple[Request, float]]:
    """``(request, arrival offset s)`` at ``rate`` req/s, as a real run's ``router_workload``
    draws them for the seed; requests with their own ``open(rate, seed, process, burstiness)``
    (traces, closed loops) are opened as the real run does."""
    if hasattr(requests, "open"):
        return requests.open(rate, seed, process, burstiness)
    times = arrival_times(len(requests), rate, seed, process, burstiness)
    return list(zip(requests, (float(t) for t in times)))


def simulator(candidate: Candidate, engine: EngineConfig, profile: DeviceProfile | ProfileSet,
              transfer: TransferModel | None, policy: str = "least_loaded",
              conditional: ConditionalConfig | None = None, transport: str = "simulated",
              step_scale: float = 1.0,
              speed_trace: Callable[[str, float], float] | None = None) -> Simulator:
    """The ``Simulator`` of one candidate on the step model of each role's profile (one
    ``DeviceProfile``, or a ``ProfileSet``'s of each role's ``(tp, pp)``), times ``step_scale``
    (``latency.step_correction``) and ``speed_trace(worker, start s)``; KV caches sized by
    ``DeviceProfile.kv_budget_bytes`` and the KV bytes per token on each instance's fullest
    device; a decode instance of TP ``d`` fetches each rank's share of the KV heads at once
    (per-rank links, as vLLM's NIXL connector; pdlab's transports relay through rank 0).

    Raises:
        ValueError: a CUDA profile without the memory facts the budget needs, or a size the
            profile set does not offer."""
    placement = Placement.parse(candidate.placement)
    config = candidate.engine(engine)
    models, whole = {}, profile
    for role in placement.roles:
        p = profile.of_role(placement, role) if isinstance(profile, ProfileSet) else profile
        if isinstance(profile, DeviceProfile) and placement.size_of(role) != p.size:
            raise ValueError(f"placement {candidate.placement}'s {role} instances are TP/PP "
                             f"{placement.size_of(role)}, the profile's {p.size}: give a "
                             "profile of each size")
        step_s = p.step_time()
        if step_scale != 1.0:
            step_s = _scaled(step_s, step_scale)
        models[role] = InstanceModel(step_s, p.kv_bytes_per_device_token, p.kv_budget_bytes(config))
        whole = p
    share = 1.0
    if placement.needs_transfer and isinstance(profile, ProfileSet) and profile.geometry:
        heads = profile.geometry.num_kv_heads
        share = len(kv_heads_of(0, placement.size_of("decode")[0], heads)) / heads
    return Simulator(candidate.placement, config, models[placement.roles[0]].step_s,
                     transfer if placement.needs_transfer else None, whole.kv_bytes_per_token,
                     policy, conditional, transport, speed_trace=speed_trace,
                     instance_models=models, transfer_share=share)


def _scaled(step_s: Callable[..., float], factor: float) -> Callable[..., float]:
    return lambda *f: factor * step_s(*f)


RUN_COLUMNS = ["candidate", "placement", "chunk_budget", "num_devices", "rate", "seed",
               "num_requests", "num_failed", "slo_attainment", "ttft_p50_s", "ttft_p99_s",
               "tpot_p50_s", "tpot_p99_s", "prefix_hit_rate", "sim_s"]


LATENCY_COLUMNS = ["ttft_s_all", "tpot_s_all"]


def request_latencies(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Each request's TTFT and TPOT (s), shape (len(records),) each, so that ``ttft <= T and tpot
    <= P`` is ``meets_slo``: a failed request has TTFT +inf, a one-token request TPOT 0."""
    ttft = np.full(len(records), math.inf)
    tpot = np.zeros(len(records))
    for i, r in enumerate(records):
        if m.failed(r):
            continue
        t, p = m.ttft_s(r), m.tpot_s(r)
        ttft[i] = math.inf if t is None else t
        tpot[i] = 0.0 if p is None else p
    return ttft, tpot


def run_metrics(records: Sequence[RequestRecord], slo: SLO) -> dict[str, float]:
    """SLO attainment (all requests), TTFT/TPOT p50/p99 over completed requests (numpy linear)
    and the prefix hit rate."""
    done = [r for r in records if not m.failed(r)]
    ttft = np.array([m.ttft_s(r) for r in done], dtype=float)
    tpot = np.array([v for v in map(m.tpot_s, done) if v is not None], dtype=float)

    def pct(v: np.ndarray, q: float) -> float:
        return float(np.percentile(v, q)) if v.size else math.nan

    return {"num_requests": len(records), "num_failed": len(records) - len(done),
            "slo_attainment": m.slo_attainment(records, slo),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "prefix_hit_rate": m.prefix_hit_rate(records)}


def sweep(cands: Sequence[Candidate], rates: Sequence[float] | dict[str, Sequence[float]],
          requests_by_seed: dict[int, list[Request]], engine: EngineConfig,
          profile: DeviceProfile, transfer: TransferModel | None, slo: SLO,
          process: str = "poisson", burstiness: float = 1.0, policy: str = "least_loaded",
          progress: Callable[[], None] | None = None, jobs: int = 1,
          latencies: bool = False) -> pd.DataFrame:
    """Step 3: one row per (candidate, rate, seed) (``RUN_COLUMNS``; ``sim_s``: wall seconds), in
    that order. ``rates``: one ladder, or one per candidate label. ``latencies``: rows also hold
    every request's TTFT and TPOT (``LATENCY_COLUMNS``), to score other SLOs unsimulated. ``jobs``
    > 1: spawned processes; the rows are the same (every run is deterministic)."""
    def ladder(cand: Candidate) -> Sequence[float]:
        return rates[cand.label] if isinstance(rates, dict) else rates

    tasks = [(cand, float(rate), seed) for cand in cands for rate in ladder(cand)
             for seed in requests_by_seed]
    fixed = (engine, profile, transfer, slo, process, burstiness, policy, latencies)
    columns = RUN_COLUMNS + (LATENCY_COLUMNS if latencies else [])
    if jobs <= 1 or len(tasks) <= 1:
        _init_worker(requests_by_seed, fixed)
        rows = []
        for task in tasks:
            rows.append(_run_task(task))
            if progress is not None:
                progress()
        return pd.DataFrame(rows, columns=columns)
    rows = [None] * len(tasks)
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(requests_by_seed, fixed)) as pool:
        with _children_skip_main():  # the workers start on these submits
            futures = {pool.submit(_run_task, task): i for i, task in enumerate(tasks)}
        for future in concurrent.futures.as_completed(futures):
            rows[futures[future]] = future.result()
            if progress is not None:
                progress()
    return pd.DataFrame(rows, columns=columns)


_WORKER: dict = {}  # what every run of a sweep shares, set once per (worker) process


@contextlib.contextmanager
def _children_skip_main():
    """Processes spawned inside this block do not re-import the parent's ``__main__``: ``pdlab``'s
    (``experiments.cli``) imports torch, seconds per worker. Hiding its ``__spec__`` and
    ``__file__`` makes multiprocessing's ``spawn.get_preparation_data`` pass neither."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main and k in main.__dict__}
    if main is not None:
        main.__dict__["__spec__"] = None
        main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _init_worker(requests_by_seed: dict[int, list[Request]], fixed: tuple) -> None:
    _WORKER.update(requests=requests_by_seed, fixed=fixed)


def _run_task(task: tuple[Candidate, float, int]) -> dict:
    cand, rate, seed = task
    engine, profile, transfer, slo, process, burstiness, policy, latencies = _WORKER["fixed"]
    sim = simulator(cand, engine, profile, transfer, policy)
    start = time.perf_counter()
    result = sim.run(arrivals(_WORKER["requests"][seed], rate, seed, process, burstiness))
    sim_s = time.perf_counter() - start
    row = {"candidate": cand.label, "placement": cand.placement,
           "chunk_budget": cand.chunk_budget, "num_devices": cand.num_devices,
           "rate": rate, "seed": seed, **run_metrics(result.records, slo), "sim_s": sim_s}
    if latencies:
        row["ttft_s_all"], row["tpot_s_all"] = request_latencies(result.records)
    return row


def refine_rates(runs: pd.DataFrame, num_points: int = 3,
                 target: float = m.ATTAINMENT_TARGET) -> dict[str, list[float]]:
    """Per candidate, ``num_points`` rates geometrically between the last swept rate meeting
    ``target`` (mean over seeds, and every lower rate too) and the next (DistServe's bracket); none
    for candidates meeting it everywhere or nowhere."""
    out = {}
    for label, g in runs.groupby("candidate", sort=False):
        curve = g.groupby("rate")["slo_attainment"].mean().sort_index()
        rates, att = list(curve.index), list(curve.values)
        passing = 0
        while passing < len(rates) and att[passing] >= target:
            passing += 1
        if 0 < passing < len(rates):
            lo, hi = rates[passing - 1], rates[passing]
            inner = np.geomspace(lo, hi, num_points + 2)[1:-1]
            out[label] = sorted({float(f"{r:.3g}") for r in inner} - set(rates))
    return out


RANK_COLUMNS = ["rank", "candidate", "placement", "chunk_budget", "num_devices",
                "goodput_per_device_req_s", "goodput_seed_min", "goodput_seed_max",
                "goodput_rate", "at_sweep_top", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
                "tpot_p99_s", "prefix_hit_rate"]


def rank(runs: pd.DataFrame) -> pd.DataFrame:
    """Step 4: one row per candidate, best goodput per device first (``RANK_COLUMNS``; ties keep
    order). ``goodput_per_device_req_s`` reads the mean-over-seeds curve; ``goodput_seed_min/max``
    its spread per seed; latencies and hit rate are seed means at that rate (the lowest when even
    it misses; NaN for a column ``runs`` lacks). ``at_sweep_top``: it still met the target at its
    highest rate, so its goodput is a lower bound."""
    rows = []
    for label, g in runs.groupby("candidate", sort=False):
        n_dev = int(g["num_devices"].iloc[0])
        curve = g.groupby("rate", as_index=False)["slo_attainment"].mean()
        goodput = m.goodput_rate(list(curve["rate"]), list(curve["slo_attainment"]), n_dev)
        per_seed = [m.goodput_rate(list(s["rate"]), list(s["slo_attainment"]), n_dev)
                    for _, s in g.groupby("seed")]
        at_rate = goodput * n_dev if goodput > 0 else float(g["rate"].min())
        at = g[np.isclose(g["rate"], at_rate)]
        rows.append({"candidate": label, "placement": g["placement"].iloc[0],
                     "chunk_budget": g["chunk_budget"].iloc[0], "num_devices": n_dev,
                     "goodput_per_device_req_s": goodput, "goodput_seed_min": min(per_seed),
                     "goodput_seed_max": max(per_seed), "goodput_rate": at_rate,
                     "at_sweep_top": bool(goodput > 0 and np.isclose(at_rate, g["rate"].max())),
                     **{c: float(at[c].mean()) if c in at else math.nan
                        for c in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                                  "prefix_hit_rate")}})
    df = pd.DataFrame(rows)
    df = df.sort_values("goodput_per_device_req_s", ascending=False, kind="stable")
    df.insert(0, "rank", range(1, len(df) + 1))
    return df.reset_index(drop=True)[RANK_COLUMNS]


def curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean-over-seeds attainment and latencies per (candidate, rate), with rate per device."""
    cols = ["slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"]
    df = runs.groupby(["candidate", "num_devices", "rate"], sort=False, as_index=False)[cols].mean()
    df.insert(3, "rate_per_device", df["rate"] / df["num_devices"])
    return df


def simulate_runs(placement: str, engine: EngineConfig, profile: DeviceProfile,
                  transfer: TransferModel | None, rates: Sequence[float],
                  requests_by_seed: dict[int, list[Request]], process: str = "poisson",
                  burstiness: float = 1.0, policy: str = "least_loaded",
                  transport: str = "simulated", step_scale: float = 1.0,
                  speed_trace: Callable[[str, float], float] | None = None
                  ) -> list[tuple[float, int, SimResult]]:
    """``(rate, seed, result)`` for every (rate, seed) of one placement, with step records."""
    sim = simulator(Candidate(placement), engine, profile, transfer, policy, transport=transport,
                    step_scale=step_scale, speed_trace=speed_trace)
    return [(rate, seed, sim.run(arrivals(reqs, rate, seed, process, burstiness), collect_steps=True))
            for rate in rates for seed, reqs in requests_by_seed.items()]
