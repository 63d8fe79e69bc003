"""One hop of pdlab's message plane against its floor and against Ray, in one run.

Three round trips between two processes, the router's on one core and a worker's on
another (``--cores``), each measured ``--n`` times after ``--warmup`` untimed ones:

- **pipe**: one byte down an OS pipe and back; this host's floor for waking another
  process and being woken.
- **channel**: a ``Command`` down the channel and a one-message reply back, over
  ``channel.unix`` (what a deployment's workers on its node use; the targets are checked
  on it) and ``channel.sockets`` (pyzmq ``ipc``; ``--tcp`` adds ``tcp``), as a worker
  handles them: its loop waits in ``take``, decodes the command and sends
  the reply, the router's poller wakes.
- **ray**: a Ray actor call and its ``ray.get``, the actor threaded as pdlab's workers are
  (``max_concurrency=16``, ``deployment.ray_actors.RayWorkers.start``).

Prints p50, p99 and mean (microseconds) per row, the ratios against the pipe's p50 and the
Ray call's, and the targets: the channel's p50 within 2.5x the pipe's, at least 3x faster
than the Ray call, its p99 <= 500 us. Name the CPU and how idle the host was beside a figure.

``--gap-ms``: each timed round trip after that long asleep, both processes idle, as a
worker between sparse requests is (on a VM, waking an idle virtual CPU costs more).

Usage: ``python -m benchmarks.hop_latency [--n 5000] [--warmup 500] [--cores 0,1] [--tcp]
[--kinds pipe,channel,ray] [--gap-ms 0]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ray

from channel.contract import SUBMIT, Command, Endpoint, Message
from channel.ports import open_port
from channel.sockets import SocketHub
from channel.unix import UnixHub
from deployment.ray_actors import ray_init_kwargs

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("pipe", "channel", "ray")
# a command and a step message of the size the router and a worker exchange per request
COMMAND = Command(SUBMIT, "request-000001", (7, 16))
REPLY = {"tokens": (("request-000001", 1234, 5),), "finished": (), "failed": ()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def _child(args: list[str], core: int, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.hop_latency", "--echo", *args,
                             "--cores", f"{core},{core}"], cwd=ROOT, env=env, **popen)


def time_round_trips(one, n: int, warmup: int, gap_s: float = 0.0,
                     clock=time.perf_counter_ns, sleep=time.sleep) -> list[float]:
    """Microseconds of each of ``n`` calls of ``one()`` after ``warmup`` untimed ones, each
    after ``sleep(gap_s)`` (untimed); ``clock``: nanoseconds."""
    for _ in range(warmup):
        one()
    times = []
    for _ in range(n):
        if gap_s:
            sleep(gap_s)
        start = clock()
        one()
        times.append((clock() - start) / 1000)
    return times


# ---- pipe ----------------------------------------------------------------------------------
def pipe_round_trips(n: int, warmup: int, worker_core: int, gap_s: float = 0.0) -> list[float]:
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    child = _child(["pipe", str(down_r), str(up_w)], worker_core, pass_fds=(down_r, up_w))
    os.close(down_r)
    os.close(up_w)
    try:
        def one() -> None:
            os.write(down_w, b"x")
            os.read(up_r, 1)
        return time_round_trips(one, n, warmup, gap_s)
    finally:
        os.close(down_w)
        os.close(up_r)
        child.wait(timeout=30)


def echo_pipe(read_fd: int, write_fd: int) -> None:
    while os.read(read_fd, 1):
        os.write(write_fd, b"x")


# ---- channel -------------------------------------------------------------------------------
def channel_round_trips(n: int, warmup: int, worker_core: int, transport: str,
                        gap_s: float = 0.0) -> list[float]:
    hub = (UnixHub(dead_after_s=3600.0) if transport == "unix"
           else SocketHub(transport, dead_after_s=3600.0))
    endpoint = hub.attach("worker-0", 0)
    child = _child(["channel", json.dumps(list(vars(endpoint).values()))], worker_core)
    try:
        def one() -> None:
            hub.send("worker-0", COMMAND)
            while not any(isinstance(item, Message) for item in hub.receive(10.0)):
                pass
        return time_round_trips(one, n, warmup, gap_s)
    finally:
        hub.send("worker-0", Command("stop"))
        hub.receive(0.2)  # let the stop leave
        child.wait(timeout=30)
        hub.close()


def echo_channel(endpoint: Endpoint) -> None:
    """A worker's loop that answers every command with one message."""
    port = open_port(endpoint)
    while True:
        for command in port.take(3600.0).commands:
            if command.kind == "stop":
                port.close()
                return
            port.send(REPLY)


# ---- ray -----------------------------------------------------------------------------------
class Echo:
    def __init__(self, core: int) -> None:
        pin(core)

    def echo(self, command: Command) -> dict:
        return REPLY


def ray_round_trips(n: int, warmup: int, worker_core: int, gap_s: float = 0.0) -> list[float]:
    ray.init(**{**ray_init_kwargs(), "num_cpus": 2})
    try:
        actor = ray.remote(Echo).options(max_concurrency=16, num_cpus=0).remote(worker_core)
        ray.get(actor.echo.remote(COMMAND))
        return time_round_trips(lambda: ray.get(actor.echo.remote(COMMAND)), n, warmup, gap_s)
    finally:
        ray.shutdown()


# ---- the table -----------------------------------------------------------------------------
def percentile(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(rows: dict[str, list[float]]) -> None:
    pipe_p50 = percentile(rows["pipe"], 0.5) if "pipe" in rows else None
    ray_p50 = percentile(rows["ray"], 0.5) if "ray" in rows else None
    print(f"{'round trip':<14} {'p50 us':>9} {'p99 us':>9} {'mean us':>9} "
          f"{'p50 / pipe':>11} {'ray / p50':>10}")
    for name, times in rows.items():
        p50 = percentile(times, 0.5)
        print(f"{name:<14} {p50:9.1f} {percentile(times, 0.99):9.1f} "
              f"{statistics.fmean(times):9.1f} "
              f"{p50 / pipe_p50 if pipe_p50 else float('nan'):11.2f} "
              f"{ray_p50 / p50 if ray_p50 else float('nan'):10.2f}")
    if "channel-unix" in rows and pipe_p50 and ray_p50:  # the channel a node's workers use
        channel = rows["channel-unix"]
        p50, p99 = percentile(channel, 0.5), percentile(channel, 0.99)
        checks = [(f"channel p50 within 2.5x the pipe's ({p50 / pipe_p50:.2f}x)",
                   p50 <= 2.5 * pipe_p50),
                  (f"channel >= 3x faster than the Ray call ({ray_p50 / p50:.2f}x)",
                   ray_p50 >= 3 * p50),
                  (f"channel p99 <= 500 us ({p99:.0f} us)", p99 <= 500)]
        for text, ok in checks:
            print(f"  {'met ' if ok else 'MISS'}  {text}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="timed round trips per row")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--cores", default="0,1", help="router's core, worker's core")
    parser.add_argument("--tcp", action="store_true", help="also the channel over tcp")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="sleep before each timed round trip: both sides idle, as a worker "
                             "between sparse requests")
    parser.add_argument("--echo", nargs="+", help=argparse.SUPPRESS)  # a child's side
    args = parser.parse_args(argv)
    router_core, worker_core = (int(c) for c in args.cores.split(","))
    pin(router_core)
    if args.echo:
        if args.echo[0] == "pipe":
            echo_pipe(int(args.echo[1]), int(args.echo[2]))
        else:
            echo_channel(Endpoint(*json.loads(args.echo[1])))
        return
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from {KINDS}")
    print(f"{cpu_model()}; router on core {router_core}, worker on core {worker_core}; "
          f"{args.n} round trips each after {args.warmup} untimed"
          + (f", each after {args.gap_ms:g} ms idle" if args.gap_ms else ""))
    gap_s = args.gap_ms / 1000
    rows: dict[str, list[float]] = {}
    if "pipe" in kinds:
        rows["pipe"] = pipe_round_trips(args.n, args.warmup, worker_core, gap_s)
    if "channel" in kinds:
        for transport in ("unix", "ipc") + (("tcp",) if args.tcp else ()):
            rows[f"channel-{transport}"] = channel_round_trips(args.n, args.warmup, worker_core,
                                                               transport, gap_s)
    if "ray" in kinds:
        rows["ray"] = ray_round_trips(args.n, args.warmup, worker_core, gap_s)
    summarize(rows)


if __name__ == "__main__":
    main()
