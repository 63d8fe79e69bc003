"""How fast ``pdlab plan`` simulates: 10,000 requests x 6 placements x 8 rates, on this machine.

The default workload (ShareGPT, SmolLM2 tokenizer, prompts 128-1024 tokens, outputs <= 48:
2,479 conversations pass those filters, so the 10,000 requests cycle through 2,400 of them)
is built once (timed apart: tokenizing is not simulating); then every (placement, rate) is
simulated on one seed with the SmolLM2 device profile (``--profile``, default the newest
``results/profile-*/device_profile.json`` of smollm2-135m) and the CPU engine defaults
(``experiments.cli.CPU_ENGINE_DEFAULTS``), over ``--jobs`` processes (default: one per CPU).
Prints wall seconds per run, simulated requests and steps per wall second, and the total
against the one-minute target.

    python -m benchmarks.plan_speed [--profile FILE] [--num-requests 10000] [--devices 3] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from engine.config import EngineConfig, ModelConfig
from engine.metrics import SLO
from experiments import compare
from experiments.cli import CPU_ENGINE_DEFAULTS
from experiments.plan import command, search
from experiments.plan.latency import DeviceProfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=0,
                        help="simulation processes (0: one per CPU this process may use)")
    args = parser.parse_args(argv)
    model = ModelConfig("smollm2-135m")
    path = args.profile or command.find_profile(model)
    if path is None:
        print("no SmolLM2 device profile: run `pdlab profile --transports inprocess,ray` first",
              file=sys.stderr)
        return 2
    profile = DeviceProfile.load(path)
    engine = EngineConfig(**CPU_ENGINE_DEFAULTS)
    spec = compare.WorkloadSpec(num_requests=min(args.num_requests, 2400), seeds=1)
    start = time.perf_counter()
    pool = compare.build_workload(spec, model, 0, 2048)
    items = [pool[i % len(pool)] for i in range(args.num_requests)]
    requests = {0: search.timed_requests(items, "bench")}
    build_s = time.perf_counter() - start
    cands = search.candidates(args.devices, [256])[:6]
    rates = search.auto_rates(profile, sum(i.num_prompt_tokens for i in items) / len(items),
                              sum(i.output_len for i in items) / len(items), args.devices, 8,
                              engine.max_num_seqs)
    transfer = profile.transfers.get("ray") or next(iter(profile.transfers.values()))
    slo = SLO(2.0, 0.1)
    steps = 0
    start = time.perf_counter()
    jobs = args.jobs or len(os.sched_getaffinity(0))
    runs = search.sweep(cands, rates, requests, engine, profile, transfer, slo, jobs=jobs)
    total_s = time.perf_counter() - start
    for cand in cands:  # steps, on one rate each (counting them costs a second pass)
        sim = search.simulator(cand, engine, profile, transfer)
        steps += len(sim.run(search.arrivals(requests[0], rates[len(rates) // 2], 0),
                             collect_steps=True).steps)
    n = int(runs["num_requests"].sum())
    print(f"profile {path}; workload built in {build_s:.1f} s ({len(items)} ShareGPT requests)")
    print(f"{len(cands)} placements x {len(rates)} rates {rates} req/s x {len(items)} requests = "
          f"{n} simulated requests")
    print(runs.groupby("candidate", sort=False)["sim_s"].agg(["mean", "max"])
          .rename(columns={"mean": "mean s/run", "max": "max s/run"}).to_string())
    print(f"total {total_s:.1f} s wall over {jobs} process(es) (simulator time summed over "
          f"runs {runs['sim_s'].sum():.1f} s): "
          f"{n / total_s:,.0f} requests/s; ~{steps / len(cands):,.0f} steps per run at "
          f"{rates[len(rates) // 2]} req/s; target 60 s -> {total_s / 60:.2f}x of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
