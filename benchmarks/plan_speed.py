"""How fast ``pdlab plan`` simulates: 10,000 requests x 6 placements x 8 rates, on this machine.

The default workload (ShareGPT, SmolLM2 tokenizer, prompts 128-1024 tokens, outputs <= 48:
2,479 conversations pass those filters, so the 10,000 requests cycle through 2,400 of them)
is built once (timed apart: tokenizing is not simulating); then every (placement, rate) is
simulated on one seed with a SmolLM2 device profile and the CPU engine defaults
(``experiments.options.CPU_ENGINE_DEFAULTS``), over ``--jobs`` processes (default: one per CPU).
The profile: ``--profile``, else the newest ``results/profile-*/device_profile.json`` of
smollm2-135m, else ``REFERENCE_PROFILE`` (the coefficients ``pdlab profile`` measured for
SmolLM2 fp32 on one core of this machine, so a clean checkout runs it in one command).

Prints wall seconds per run, simulated requests and steps per wall second, the CPU seconds
of the sweep's processes and the load average (a loaded machine stretches the wall, not the
CPU time), and the total against the one-minute target.

    python -m benchmarks.plan_speed [--profile FILE] [--num-requests 10000] [--devices 3] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from engine.config import EngineConfig, ModelConfig
from engine.metrics import SLO
from experiments.options import CPU_ENGINE_DEFAULTS, find_profile
from experiments.workload_spec import WorkloadSpec, build_workload, requests_of
from planner import search
from planner.latency import PROFILE_VERSION, DeviceProfile

TARGET_S = 60.0


def _fit(features: list[str], coef: list[float]) -> dict:
    return {"features": features, "coef": coef, "r2": 1.0, "mean_rel_err": 0.0,
            "max_rel_err": 0.0, "num_points": 0}


# ``pdlab profile --model smollm2-135m --repeats 3 --transports inprocess,ray`` on one AMD EPYC
# core, idle: the fitted coefficients only (fit statistics are not needed to time the
# simulator).
REFERENCE_PROFILE = {
    "version": PROFILE_VERSION, "model": "smollm2-135m", "dtype": "float32", "device_kind": "cpu",
    "device_name": "AMD EPYC", "num_threads": 1, "kv_bytes_per_token": 46080,
    "notes": {"source": "benchmarks.plan_speed.REFERENCE_PROFILE"},
    "prefill": _fit(["1", "prefill_tokens", "prefill_attention"],
                    [0.04908690973207757, 0.0029202632007442175, 4.795455650500116e-07]),
    "decode": _fit(["1", "batch_size", "sum_context"],
                   [0.045976369793162795, 0.004722918813309089, 9.028762355320699e-06]),
    "mixed": _fit(["1", "slopes"], [0.05627793380854966, 1.0]),
    "transfers": {"ray": {"latency_s": 0.002206704910754347,
                          "bandwidth_bytes_s": 3085997484.427105, "put_share": 0.5}},
}


def load_profile(path: str | None, model: ModelConfig) -> tuple[DeviceProfile, str]:
    """The profile to time with and where it came from (module docstring's order)."""
    path = path or find_profile(model)
    if path is not None:
        return DeviceProfile.load(path), str(path)
    return DeviceProfile.from_dict(REFERENCE_PROFILE), "REFERENCE_PROFILE (built in)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=0,
                        help="simulation processes (0: one per CPU this process may use)")
    args = parser.parse_args(argv)
    model = ModelConfig("smollm2-135m")
    profile, source = load_profile(args.profile, model)
    engine = EngineConfig(**CPU_ENGINE_DEFAULTS)
    spec = WorkloadSpec(num_requests=min(args.num_requests, 2400), seeds=1)
    start = time.perf_counter()
    pool = build_workload(spec, model, 0, 2048)
    items = [pool[i % len(pool)] for i in range(args.num_requests)]
    requests = {0: requests_of(items, "bench")}
    build_s = time.perf_counter() - start
    cands = search.candidates(args.devices, [256])[:6]
    rates = search.auto_rates(profile, sum(i.num_prompt_tokens for i in items) / len(items),
                              sum(i.output_len for i in items) / len(items), args.devices, 8,
                              engine.max_num_seqs)
    transfer = profile.transfers.get("ray") or next(iter(profile.transfers.values()))
    slo = SLO(2.0, 0.1)
    jobs = args.jobs or len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    runs = search.sweep(cands, rates, requests, engine, profile, transfer, slo, jobs=jobs)
    total_s = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
                for a, b in zip(cpu_after, cpu_before))  # this process + the reaped workers
    load_after = os.getloadavg()[0]
    steps = 0
    for cand in cands:  # steps, on one rate each (counting them costs a second pass)
        sim = search.simulator(cand, engine, profile, transfer)
        steps += len(sim.run(search.arrivals(requests[0], rates[len(rates) // 2], 0),
                             collect_steps=True).steps)
    n = int(runs["num_requests"].sum())
    print(f"profile {source}; workload built in {build_s:.1f} s ({len(items)} ShareGPT requests)")
    print(f"{len(cands)} placements x {len(rates)} rates {rates} req/s x {len(items)} requests = "
          f"{n} simulated requests")
    print(runs.groupby("candidate", sort=False)["sim_s"].agg(["mean", "max"])
          .rename(columns={"mean": "mean s/run", "max": "max s/run"}).to_string())
    print(f"total {total_s:.1f} s wall over {jobs} process(es) (simulator time summed over "
          f"runs {runs['sim_s'].sum():.1f} s; CPU time of the sweep's processes {cpu_s:.1f} s; "
          f"load average {load_before:.1f} before, {load_after:.1f} after, "
          f"{len(os.sched_getaffinity(0))} CPUs): {n / total_s:,.0f} requests/s; "
          f"~{steps / len(cands):,.0f} steps per run at {rates[len(rates) // 2]} req/s")
    verdict = "met" if total_s < TARGET_S else "NOT met"
    print(f"target: {len(items):,} requests x {len(cands)} placements x {len(rates)} rates "
          f"in under {TARGET_S:.0f} s wall -> {total_s:.1f} s = {total_s / TARGET_S:.2f}x of it: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
