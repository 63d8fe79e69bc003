"""The hand-over's hops: a prefilled request reaching its decode worker through the router
(two hops, as pdlab does it) against straight from the prefill worker (one hop), in one run.

A prefill worker's message after its put carries the ``prefilled`` event (KV handles; the first
token left before the put) to the router, which sends the decode worker an ``admit`` (request, token, handles). In the
middle the router keeps two things: it alone assigns the decode worker (moving a request off
a dead one before its hand-over), and it owns the KV handles between the workers (giving them
back to their producer when no decode worker can take them, freeing them when a request ends
early). A direct notification would save one process hop and the router's turn per
prefilled request, and give up both; this measures what it would save.

Three processes on ``--cores`` (prefill A, router R, decode B), ``channel.sockets`` (ipc),
the paths alternating, one message in flight, ``--gap-ms`` apart:

- **two hops**: A's port sends ``prefilled``; R's hub receives it and sends B the ``admit``
  (a bare relay: the router's own bookkeeping per event comes on top, see
  ``benchmarks.router_cost``); B's loop, waiting on its ports' sockets as ``EngineLoop`` does,
  takes it.
- **one hop**: A sends B the same ``admit`` through a hub of its own, down to B's loop.

One-way: A's ``time.monotonic_ns()`` before the send to B's loop taking it; p50 / p99 / mean
(µs) per path, the difference, its % of a 5 and an 8 ms decode step, in ``handover_hops.csv``
under ``--out`` (default ``results/handover-hops-<time>``).
Usage: ``python -m benchmarks.handover_hops [--n 3000] [--gap-ms 1] [--cores 0,0,1]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import statistics
import time
from typing import NamedTuple

from benchmarks import cpu_line, print_table, write_rows
from channel.contract import ADMIT, Command, Endpoint, Message
from channel.sockets import SocketHub, SocketPort
from engine.events import PREFILLED, WorkerEvent
from engine.request import Request, SamplingParams

PATHS = ("one_hop", "two_hops")
STEPS_MS = (5.0, 8.0)  # a GPU decode step, for scale
COLUMNS = ["path", "sent", "received", "p50_us", "p99_us", "mean_us",
           "p50_pct_of_5ms", "p50_pct_of_8ms", "p99_pct_of_5ms", "p99_pct_of_8ms"]


class Handle(NamedTuple):
    """A stand-in KV handle of the shape the transports hand out (a locator and sizes)."""

    transport: str
    request_id: str
    path: str
    owner_pid: int
    offset: int
    num_bytes: int


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})


def _request(request_id: str, prompt_len: int) -> Request:
    return Request(request_id, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=256))


def _handles(request_id: str) -> tuple[Handle, ...]:
    return (Handle("shm", request_id, "/dev/shm/pdlab-kv-0", os.getpid(), 1 << 20, 1 << 27),)


def router_relay(core: int | None, control, prompt_len: int) -> None:
    """R: attaches A and B, answers their endpoints on ``control``, then turns every
    ``prefilled`` event of A into an ``admit`` to B until ``control`` says stop."""
    _pin(core)
    hub = SocketHub("ipc", dead_after_s=3600.0)
    control.send((hub.attach("prefill-0", 0), hub.attach("decode-0", 0)))
    request = _request("template", prompt_len)
    while not control.poll():
        for item in hub.receive(0.05):
            if isinstance(item, Message):
                for event in item.body:
                    hub.send("decode-0", Command(ADMIT, event.request_id, (
                        request, event.token_id, event.kv_handles, 0)))
    control.recv()
    hub.close()


def decode_loop(core: int | None, control, via_router: Endpoint, direct: Endpoint) -> None:
    """B: two ports (from R, from A) read by one loop, which waits on both sockets at once as
    ``SocketPort.take`` waits on one; records when the loop took each ``admit``; on
    ``("report", n)`` answers {request_id: monotonic ns} once n arrived (or 10 s later: a
    lost one is missing from the answer)."""
    _pin(core)
    ports = [SocketPort(via_router), SocketPort(direct)]
    # libzmq's descriptors say "look again"; each take(0) below looks, so a wait after it is sound
    descriptors = [port._commands_fd for port in ports]
    control.send("ready")
    taken: dict[str, int] = {}
    expected, deadline = 0, None
    while deadline is None or (len(taken) < expected and time.monotonic() < deadline):
        select.select(descriptors, [], [], 0.05)
        for port in ports:
            for command in port.take(0).commands:
                taken[command.request_id] = time.monotonic_ns()
        if deadline is None and control.poll():
            expected, deadline = control.recv()[1], time.monotonic() + 10.0
    control.send(taken)
    for port in ports:
        port.close()


def measure(n: int, warmup: int, gap_s: float, cores: list[int | None],
            prompt_len: int) -> dict[str, list[float]]:
    """One-way µs per path, the ``n`` after ``warmup`` untimed ones each, alternating."""
    a_core, r_core, b_core = cores
    _pin(a_core)
    context = multiprocessing.get_context("spawn")
    r_control, r_theirs = context.Pipe()
    relay = context.Process(target=router_relay, args=(r_core, r_theirs, prompt_len),
                            daemon=True)
    relay.start()
    to_a, to_b = r_control.recv()
    hub = SocketHub("ipc", dead_after_s=3600.0)
    direct = hub.attach("decode-0", 0)
    b_control, b_theirs = context.Pipe()
    decode = context.Process(target=decode_loop, args=(b_core, b_theirs, to_b, direct),
                             daemon=True)
    decode.start()
    port = SocketPort(to_a)
    request = _request("template", prompt_len)
    if not b_control.poll(60) or b_control.recv() != "ready":
        raise RuntimeError("the decode process did not start")
    time.sleep(0.2)  # its ports connect
    sent: dict[str, tuple[str, int]] = {}
    try:
        for i in range(warmup + n):
            for path in PATHS if i % 2 else reversed(PATHS):  # each goes first half the time
                rid = f"{path}-{i}"
                start = time.monotonic_ns()
                if path == "one_hop":
                    hub.send("decode-0", Command(ADMIT, rid, (request, 7, _handles(rid), 0)))
                else:
                    port.send((WorkerEvent(PREFILLED, rid, "prefill-0", time.time(),
                                           token_id=7, index=0, kv_handles=_handles(rid),
                                           kv_bytes=1 << 27),))
                if i >= warmup:
                    sent[rid] = (path, start)
                hub.receive(0)  # an admit the hub kept (B's port not connected yet) leaves
                time.sleep(gap_s)
        b_control.send(("report", len(PATHS) * (warmup + n)))
        deadline = time.monotonic() + 60
        while not b_control.poll(0.01):
            hub.receive(0)
            if time.monotonic() > deadline:
                raise RuntimeError("the decode process never reported")
        taken = b_control.recv()
    finally:
        port.close()
        r_control.send("stop")
        relay.join(timeout=10)
        decode.join(timeout=10)
        hub.close()
    out: dict[str, list[float]] = {path: [] for path in PATHS}
    for rid, (path, start) in sent.items():
        if rid in taken:
            out[path].append((taken[rid] - start) / 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(times: dict[str, list[float]], n: int) -> list[dict]:
    """The CSV's rows (``COLUMNS``): each path, then two hops minus one hop."""
    rows = []
    for path in PATHS:
        values = times[path]
        rows.append({"path": path, "sent": n, "received": len(values),
                     "p50_us": percentile(values, 0.5), "p99_us": percentile(values, 0.99),
                     "mean_us": statistics.fmean(values) if values else float("nan")})
    one, two = rows
    rows.append({"path": "difference", "sent": n, "received": min(one["received"],
                                                                  two["received"]),
                 **{k: two[k] - one[k] for k in ("p50_us", "p99_us", "mean_us")}})
    for row in rows:
        for q in ("p50", "p99"):
            for step_ms in STEPS_MS:
                row[f"{q}_pct_of_{step_ms:g}ms"] = row[f"{q}_us"] / (10 * step_ms)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n", type=int, default=3000, help="timed hand-overs per path")
    parser.add_argument("--warmup", type=int, default=300, help="untimed ones first")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="between two sends")
    parser.add_argument("--cores", default="0,0,1",
                        help="cores of prefill A, router R, decode B ('any': not pinned)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="the request's prompt")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args(argv)
    cores = [None if c == "any" else int(c) for c in args.cores.split(",")]
    print(f"CPU: {cpu_line()}")
    print(f"cores: prefill A {cores[0]}, router R {cores[1]}, decode B {cores[2]}; "
          f"{args.n} hand-overs per path after {args.warmup}, {args.gap_ms:g} ms apart, "
          f"alternating; prompts of {args.prompt_len} tokens")
    rows = summarize(measure(args.n, args.warmup, args.gap_ms / 1000, cores, args.prompt_len),
                     args.n)
    print_table(["path", "received", "p50 us", "p99 us", "mean us", "p50 % of 5 ms",
                 "p50 % of 8 ms", "p99 % of 5 ms", "p99 % of 8 ms"],
                [[r["path"], r["received"], r["p50_us"], r["p99_us"], r["mean_us"],
                  r["p50_pct_of_5ms"], r["p50_pct_of_8ms"], r["p99_pct_of_5ms"],
                  r["p99_pct_of_8ms"]] for r in rows])
    one, two = rows[0], rows[1]
    print(f"two hops / one hop: p50 {two['p50_us'] / one['p50_us']:.2f}x, "
          f"p99 {two['p99_us'] / one['p99_us']:.2f}x")
    write_rows(rows, COLUMNS, args.out, "handover-hops", "handover_hops.csv")
    return rows


if __name__ == "__main__":
    main()
