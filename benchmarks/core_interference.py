"""Does work on one core slow a decode step on the other? (``pdlab plan``'s accuracy)

    python -m benchmarks.core_interference

SmolLM2-135M decode steps (B = 1, context kept near 256 tokens: the request is restarted
every 100 steps) run on core 0 in 6 s phases while core 1 is idle, spins a Python loop, or
copies 64 MiB arrays (memory bandwidth), alternating with idle phases. Printed: each
phase's median step, and each kind's median over its phases relative to idle. ``pdlab
profile`` measures with the other core idle, while a served run keeps the router busy on
it: a ratio above 1 here is a slowdown the profile cannot see. Needs 2 cores and a quiet
machine (anything else running confounds it).
"""
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model import load_model
from engine.request import Request, SamplingParams


def spin(kind, stop):
    os.sched_setaffinity(0, {1})
    a = np.ones(64 * 2**20 // 8) if kind == "memory" else None
    b = np.empty_like(a) if a is not None else None
    x = 0
    while not stop.is_set():
        if a is None:
            for i in range(10000):
                x += i
        else:
            np.copyto(b, a)


def main():
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig("smollm2-135m"))
    eng = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=2048, max_num_batched_tokens=512,
                                      enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(0)
    n = 0

    def fresh():
        nonlocal n
        n += 1
        eng.add_request(Request(f"p{n}", tuple(torch.randint(3, 40000, (255,), generator=gen).tolist()),
                                SamplingParams(max_tokens=1700, ignore_eos=True)))
        eng.step()  # prefill

    fresh()
    results = {}
    for phase in ["idle", "python", "idle", "memory", "idle", "python", "idle", "memory", "idle"]:
        stop = mp.Event()
        p = None if phase == "idle" else mp.Process(target=spin, args=(phase, stop))
        if p:
            p.start()
            time.sleep(0.5)
        ts = []
        end = time.time() + 6
        while time.time() < end:
            if not eng.has_unfinished() or len(ts) % 100 == 99:
                for rid in list(eng.states):
                    eng.abort(rid)
                fresh()  # keep the context near 256
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        if p:
            stop.set()
            p.join()
        results.setdefault(phase, []).append(statistics.median(ts))
        print(f"{phase:7s} median decode step {1e3 * statistics.median(ts):.2f} ms over {len(ts)} steps", flush=True)
    idle = statistics.median(results["idle"])
    for k, v in results.items():
        print(f"{k}: {statistics.median(v) / idle:.3f}x idle")


if __name__ == "__main__":
    main()
