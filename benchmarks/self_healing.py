"""``make self-healing``: ``pdlab serve`` healing a killed worker, measured.

1. **disagg:1p1d, Ray actors** (``pdlab serve``'s own deployment and app, built from its
   command line: ``experiments.commands.serve.build``; SmolLM2, transport shm, one core per
   worker): 4 streams open (200 tokens each, EOS ignored); once each has 2 tokens, decode-0's
   actor is killed. Measured: when each stream ended after the kill (its error event), how
   long a request sent right after the kill took (it waits for the new actor), and when
   decode-0 was live again (its restart time: a new process loading the model).
2. **disagg:1p2d, in-process workers** (``--local``; three workers need three devices, the
   two cores hold two, so decode-0 and decode-1 share core 1): a steady ``--rate`` (4 req/s;
   the rate must be one the machine sustains without a kill for the count to mean anything: 64 prompt
   tokens, 16 output, EOS ignored) for ``--duration-s``; decode-1 is killed at a third of
   it. Counted: failed requests among those that arrived before and after the kill; then
   whether decode-1 is live and its new engine serves requests again (the pool is whole).

Prints one block per scenario. Timings on a shared machine are noisy; the counts are not.

Usage: ``python -m benchmarks.self_healing [--scenarios 1p1d,1p2d] [--duration-s 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.model import SMOLLM2_NAME, load_tokenizer
from experiments import cli
from experiments.commands import serve
from deployment.placement import Deployment
from server.app import OpenAIServer, ServerThread, text_of

PROMPT_LEN, OUTPUT_LEN = 64, 16


def prompt_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event,
                  out: dict) -> None:
    out.update(chunks=0, error=None)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
            else:
                out["chunks"] += 1
                if out["chunks"] >= 2:
                    started.set()
    out["end_s"] = time.time()


def wait_live(dep: Deployment, name: str, timeout_s: float = 600.0) -> float:
    """``time.time()`` when worker ``name`` is live again."""
    end_s = time.monotonic() + timeout_s
    while not dep.router.workers[name].alive:
        if time.monotonic() > end_s or dep.router.workers[name].state == "dead":
            raise RuntimeError(f"{name} did not come back: {dep.router.workers[name].cause}")
        time.sleep(0.05)
    return time.time()


def scenario_1p1d() -> None:
    args = cli.build_parser().parse_args([
        "serve", "--placement", "disagg:1p1d", "--devices", "cpu:0,cpu:1", "--model",
        SMOLLM2_NAME, "--transport", "shm", "--max-model-len", "1024", "--port", "0"])
    dep, app = serve.build(args, serve.check(args))
    rng = random.Random(0)
    with dep:
        thread = ServerThread(app.app).start()
        try:
            async def run():
                async with httpx.AsyncClient(timeout=600) as client:
                    outs = [{} for _ in range(4)]
                    started = [asyncio.Event() for _ in range(4)]
                    tasks = [asyncio.ensure_future(_stream(client, thread.url, {
                        "prompt": prompt_ids(rng), "max_tokens": 200, "ignore_eos": True,
                        "stream": True}, started[i], outs[i])) for i in range(4)]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
                    kill_s = time.time()
                    dep.kill("decode-0")
                    new = asyncio.ensure_future(client.post(f"{thread.url}/v1/completions", json={
                        "prompt": prompt_ids(rng), "max_tokens": OUTPUT_LEN, "ignore_eos": True}))
                    await asyncio.gather(*tasks)
                    reply = await new
                    return kill_s, outs, reply, time.time()

            kill_s, outs, reply, new_end_s = asyncio.run(run())
            live_s = wait_live(dep, "decode-0")
        finally:
            thread.stop()
    ends = [out["end_s"] - kill_s for out in outs]
    print("== disagg:1p1d (Ray actors, SmolLM2): decode-0 killed with 4 streams open")
    print(f"   streams ended after the kill: {', '.join(f'{e:.3f}' for e in ends)} s "
          f"(max {max(ends):.3f} s; tokens before: {[o['chunks'] for o in outs]}; "
          f"error event on each: {all(o['error'] for o in outs)})")
    print(f"   first error: {outs[0]['error']}")
    print(f"   a request sent right after the kill: HTTP {reply.status_code}, "
          f"{reply.json().get('usage', {}).get('completion_tokens')} tokens, done "
          f"{new_end_s - kill_s:.1f} s after the kill")
    print(f"   decode-0 live again {live_s - kill_s:.1f} s after the kill (its restart time)")


def scenario_1p2d(duration_s: float, rate: float) -> None:
    model = ModelConfig(SMOLLM2_NAME)
    rng = random.Random(1)
    num = int(duration_s * rate)
    kill_at_s = duration_s / 3
    with Deployment(PlacementConfig("disagg:1p2d", "cpu:0,cpu:1"), model,
                    EngineConfig(max_model_len=1024), TransferConfig(transport="inprocess"),
                    local=True, worker_devices=("cpu:0", "cpu:1", "cpu:1"),
                    max_worker_restarts=3) as dep:
        thread = ServerThread(OpenAIServer(dep.router, text_of(load_tokenizer(model)),
                                           SMOLLM2_NAME).app).start()
        try:
            async def run():
                async with httpx.AsyncClient(timeout=600) as client:
                    async def one(i: int):
                        await asyncio.sleep(i / rate)
                        arrived = time.time()
                        reply = await client.post(f"{thread.url}/v1/completions", json={
                            "prompt": prompt_ids(rng), "max_tokens": OUTPUT_LEN,
                            "ignore_eos": True})
                        return arrived, reply.status_code, reply.text[:160]

                    async def kill():
                        await asyncio.sleep(kill_at_s)
                        dep.kill("decode-1")
                        return time.time()

                    kill_task = asyncio.ensure_future(kill())
                    results = await asyncio.gather(*(one(i) for i in range(num)))
                    return await kill_task, results

            kill_s, results = asyncio.run(run())
            live_s = wait_live(dep, "decode-1")
            after = [httpx.post(f"{thread.url}/v1/completions", timeout=600, json={
                "prompt": prompt_ids(rng), "max_tokens": OUTPUT_LEN, "ignore_eos": True})
                for _ in range(4)]
            served_by_new = sum(1 for r in dep.step_records() if r["worker"] == "decode-1")
            health = httpx.get(f"{thread.url}/health").json()
        finally:
            thread.stop()
    before = [r for r in results if r[0] < kill_s]
    later = [r for r in results if r[0] >= kill_s]
    failed_before = [r for r in before if r[1] != 200]
    failed_later = [r for r in later if r[1] != 200]
    print(f"== disagg:1p2d (in-process, SmolLM2): {num} requests at {rate:g} req/s, decode-1 "
          f"killed at {kill_at_s:.0f} s")
    print(f"   arrived before the kill: {len(before)}, failed {len(failed_before)}"
          + (f" (e.g. {failed_before[0][2]})" if failed_before else ""))
    print(f"   arrived after the kill: {len(later)}, failed {len(failed_later)}"
          + (f" (e.g. {failed_later[0][2]})" if failed_later else ""))
    print(f"   decode-1 live again {live_s - kill_s:.1f} s after the kill; health "
          f"{health['status']}, states {[w['state'] for w in health['workers'].values()]}; "
          f"4 requests after: HTTP {[r.status_code for r in after]}; the new decode-1 ran "
          f"{served_by_new} steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.self_healing")
    parser.add_argument("--scenarios", default="1p1d,1p2d")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=4.0, help="1p2d: requests per second")
    args = parser.parse_args(argv)
    for name in args.scenarios.split(","):
        if name == "1p1d":
            scenario_1p1d()
        elif name == "1p2d":
            scenario_1p2d(args.duration_s, args.rate)
        else:
            parser.error(f"unknown scenario {name!r} (1p1d, 1p2d)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
