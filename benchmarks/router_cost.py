"""What the router costs: the real ``Router`` fed a synthetic token stream, in one run at
``--workers`` loads (default 8 and 2 fake colocated workers, a row each).

Each fake (a process on ``channel.unix``, the node's channel; ``--channel sockets``: pyzmq
``ipc``; ``--channel local``: a thread on ``channel.local``) sends a step message every
``--step-ms`` with a token for each request it runs, first and last tokens as
``WorkerEvent``s, the rest as one ``TokenBatch`` (as ``EngineLoop.emit_tokens``); a request
ends (``length``) after its ``max_tokens``, drawn from ``--output-lens``. A front end keeps ``--running`` requests per worker in flight (one
new per finished one) and takes every ``StreamEvent`` on its own thread through a queue, as
the HTTP server does: the router does its real work per request and per token.

Over ``--seconds`` after ``--warmup-s``: the router loop thread's CPU (its own clock) per
wall second in % of a core (target < 50 % at 8 workers), and per step message and token
(µs); the relay latency from a fake's stamp (``time.time()``) to the front end's thread,
p50 / p99 (target p99 <= 1 ms), split at the router's relay stamp (``token_times_s``) into
worker -> router and router -> front end; the rates achieved and the CPU of the front end
and the fakes (on a host with fewer cores than threads they compete with the router). Every
row checks tokens relayed == sent == requested. Prints the table (ratios against the
lightest row), writes ``router_cost.csv`` under ``--out`` (default
``results/router-cost-<time>``), names the CPU; ``--cprofile`` reruns the heaviest load with
the router thread under cProfile (CPU clock) and prints the top by own time.

Usage: ``python -m benchmarks.router_cost [--workers 8,2] [--seconds 10] [--channel
unix|sockets|local] [--cprofile]``.
"""

from __future__ import annotations

import argparse
import array
import cProfile
import io
import multiprocessing
import os
import pstats
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import cpu_line, print_table, write_rows
from channel.contract import ABORT, SUBMIT, Endpoint
from channel.local import LocalHub
from channel.ports import open_port
from channel.sockets import SocketHub
from channel.unix import UnixHub
from engine.clock import freeze_heap
from engine.events import TOKEN, TokenBatch, WorkerEvent
from engine.metrics import PREFILL_FINISHED, PREFILL_STARTED
from engine.request import Request, SamplingParams
from router.router import FINISH, Router, StreamEvent, WorkerRef

SPEC = {"model_fingerprint": "router-cost-fake", "num_layers": 32, "num_kv_heads": 8,
        "head_dim": 128, "dtype": "bfloat16"}
COLUMNS = ["channel", "workers", "running", "seconds", "msgs_per_s", "tokens_per_s",
           "router_cpu_pct", "us_per_msg", "us_per_token", "relay_p50_us", "relay_p99_us",
           "to_router_p50_us", "to_router_p99_us", "to_front_p99_us", "front_cpu_pct",
           "fakes_cpu_pct", "requests_finished", "tokens_requested", "tokens_sent",
           "tokens_relayed"]
CPU_TARGET_PCT, P99_TARGET_US = 50.0, 1000.0


# ---- a fake worker ------------------------------------------------------------------
def fake_worker(name: str, port_or_endpoint: Any, control: Any, step_s: float) -> None:
    """A colocated worker's message stream without an engine: every ``step_s`` seconds one
    message with the next token of every request submitted to it, until ``control`` says
    ``stop``; then it answers ``(messages, tokens)`` it sent. ``port_or_endpoint``: an open
    port, or an ``Endpoint`` to open its port on (in a child process). Says
    ``ready`` on ``control`` once its port is open."""
    port = (open_port(port_or_endpoint) if isinstance(port_or_endpoint, Endpoint)
            else port_or_endpoint)
    control.send("ready")
    running: dict[str, list[int]] = {}  # request id -> [next output index, max_tokens]
    messages = tokens = 0
    next_s = time.monotonic()
    while not control.poll():
        for command in port.take(0).commands:
            if command.kind == SUBMIT:
                running[command.request_id] = [0, command.args[0].sampling.max_tokens]
            elif command.kind == ABORT:
                running.pop(command.request_id, None)
        if running:
            now = time.time()
            events: list[Any] = []
            plain_ids, plain_tokens, plain_indices = [], [], []
            for rid, state in list(running.items()):
                index, max_tokens = state
                token_id = 1000 + index
                last = index == max_tokens - 1
                if index == 0:
                    events.append(WorkerEvent(
                        TOKEN, rid, name, now, token_id=token_id, index=0,
                        finish_reason="length" if last else None, num_cached_prompt_tokens=0,
                        stamps={PREFILL_STARTED: now - step_s, PREFILL_FINISHED: now}))
                elif last:
                    events.append(WorkerEvent(TOKEN, rid, name, now, token_id=token_id,
                                              index=index, finish_reason="length"))
                else:
                    plain_ids.append(rid)
                    plain_tokens.append(token_id)
                    plain_indices.append(index)
                if last:
                    del running[rid]
                else:
                    state[0] = index + 1
            if plain_ids:
                events.append(TokenBatch(name, now, tuple(plain_ids), tuple(plain_tokens),
                                         tuple(plain_indices)))
            port.send(tuple(events))
            messages += 1
            tokens += len(plain_ids) + len(events) - bool(plain_ids)
        next_s += step_s
        # late by more than a step (a loaded host): start again from now, no burst
        next_s = max(next_s, time.monotonic() - step_s)
        time.sleep(max(0.0, next_s - time.monotonic()))
    control.recv()
    port.close()
    control.send((messages, tokens))


class _Fake:
    """What the router calls (``info``, ``open_channel``); ``open_channel`` starts the fake
    worker's stream, in a child process (``channel.sockets``) or a thread (local)."""

    def __init__(self, name: str, hub: Any, step_s: float) -> None:
        self.name, self.hub, self.step_s = name, hub, step_s
        self.runner: Any = None
        self.control: Any = None

    def info(self) -> dict:
        return {"kv_spec": SPEC, "max_model_len": 1 << 16, "vocab_size": 1 << 17}

    def open_channel(self, endpoint: Endpoint) -> None:
        if endpoint.messages.startswith("local:"):
            self.control, theirs = multiprocessing.Pipe()
            port = self.hub.open_port(endpoint)
            self.runner = threading.Thread(target=fake_worker, daemon=True,
                                           args=(self.name, port, theirs, self.step_s))
        else:
            context = multiprocessing.get_context("spawn")
            self.control, theirs = context.Pipe()
            self.runner = context.Process(target=fake_worker, daemon=True,
                                          args=(self.name, endpoint, theirs, self.step_s))
        self.runner.start()

    def cpu_s(self) -> float:
        """CPU seconds its stream has used so far (its process's, or its thread's)."""
        if isinstance(self.runner, threading.Thread):
            return _thread_cpu_s(self.runner)
        fields = Path(f"/proc/{self.runner.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def end(self) -> None:
        """End its child process if it still streams (after an error; ``stop`` ends it
        otherwise)."""
        if isinstance(self.runner, multiprocessing.process.BaseProcess) and self.runner.is_alive():
            self.runner.terminate()

    def stop(self) -> tuple[int, int]:
        """Stop its stream; (messages, tokens) it sent."""
        self.control.send("stop")
        counts = self.control.recv()
        self.runner.join(timeout=10)
        return counts


class _Now:
    """``Calls`` whose calls run at once on the caller's thread (the fakes answer at once)."""

    def call(self, worker, method, *args):
        try:
            return True, getattr(worker, method)(*args)
        except Exception as err:
            return False, err

    def ready(self, pending, timeout_s):
        return list(pending)

    def result(self, pending):
        ok, value = pending
        if not ok:
            raise value
        return value


# ---- the front end ------------------------------------------------------------------
@dataclass
class _Window:
    """What the front end saw inside the measured window."""

    start_s: float = float("inf")
    end_s: float = float("inf")


class FrontEnd:
    """Keeps ``in_flight`` requests submitted (one new per finished one until ``stop_
    submitting``) and takes every ``StreamEvent`` on its own thread: counts tokens, and
    pairs each token's arrival with its worker's stamp (the finished record's
    ``token_worker_times_s``) into relay latencies (µs) of the tokens that arrived inside
    ``window``."""

    def __init__(self, router: Router, in_flight: int, output_lens: tuple[int, int],
                 prompt_len: int, window: _Window, seed: int = 0) -> None:
        self.router, self.in_flight, self.output_lens = router, in_flight, output_lens
        self.prompt = tuple(range(1, prompt_len + 1))
        self.window = window
        self.rng = random.Random(seed)
        self.events: queue.SimpleQueue[StreamEvent | None] = queue.SimpleQueue()
        self.arrivals: dict[str, list[float]] = {}
        self.latencies_us = array.array("d")
        self.to_router_us = array.array("d")  # worker's stamp -> the router relayed it
        self.to_front_us = array.array("d")  # the router relayed it -> the front end took it
        self.tokens = self.tokens_in_window = 0
        self.submitted = self.finished = self.failed = 0
        self.tokens_requested = 0  # max_tokens summed over the requests submitted
        self.submitting = True
        self.all_done = threading.Event()
        self.thread = threading.Thread(target=self._take, name="front-end", daemon=True)

    def start(self) -> None:
        self.thread.start()
        for _ in range(self.in_flight):
            self._submit()

    def _submit(self) -> None:
        rid = f"req-{self.submitted:07d}"
        self.submitted += 1
        self.arrivals[rid] = []
        max_tokens = self.rng.randint(*self.output_lens)
        self.tokens_requested += max_tokens
        request = Request(rid, self.prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.router.submit(request, self.events.put)

    def stop_submitting(self) -> None:
        self.submitting = False
        self.events.put(None)  # wakes the thread to check whether all is done

    def close(self) -> None:
        self.events.put(None)
        self.all_done.set()
        if self.thread.ident is not None:
            self.thread.join(timeout=10)

    def _take(self) -> None:
        window, clock = self.window, time.time
        while True:
            event = self.events.get()
            if event is None:
                if self.all_done.is_set():
                    return
                if not self.submitting and self.finished == self.submitted:
                    self.all_done.set()
                continue
            now = clock()
            if event.kind != FINISH:
                self.arrivals[event.request_id].append(now)
                self.tokens += 1
                continue
            self.finished += 1
            record = event.record
            self.failed += record.error is not None
            for arrived, stamped, relayed in zip(self.arrivals.pop(event.request_id),
                                                 record.token_worker_times_s,
                                                 record.token_times_s):
                if window.start_s <= arrived < window.end_s:
                    self.tokens_in_window += 1
                    self.latencies_us.append((arrived - stamped) * 1e6)
                    self.to_router_us.append((relayed - stamped) * 1e6)
                    self.to_front_us.append((arrived - relayed) * 1e6)
            if self.submitting:
                self._submit()
            elif self.finished == self.submitted:
                self.all_done.set()


# ---- one row ------------------------------------------------------------------------
def _thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _count_messages(hub: Any) -> list[int]:
    """Wrap ``hub.receive`` to count the step messages it delivers (one list cell, read by
    the main thread)."""
    count = [0]
    receive = hub.receive

    def counted(timeout_s: float):
        items = receive(timeout_s)
        count[0] += len(items)
        return items

    hub.receive = counted
    return count


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def measure(workers: int, running: int, seconds: float, warmup_s: float, step_ms: float,
            output_lens: tuple[int, int], prompt_len: int, channel: str,
            profile: cProfile.Profile | None = None) -> dict:
    """One row (``COLUMNS``): ``workers`` fakes with ``running`` requests each.

    Raises:
        RuntimeError: tokens relayed differ from tokens sent, or a request failed.
    """
    hub = {"unix": lambda: UnixHub(dead_after_s=60.0),
           "sockets": lambda: SocketHub("ipc", dead_after_s=60.0),
           "local": lambda: LocalHub(dead_after_s=60.0)}[channel]()
    fakes = [_Fake(f"colocated-{i}", hub, step_ms / 1000) for i in range(workers)]
    refs = [WorkerRef(f.name, "colocated", f) for f in fakes]
    router = Router(refs, _Now(), f"colocated:{workers}", hub=hub, deadline_s=60.0)
    freeze_heap()  # as a deployment does once its router is up
    messages = _count_messages(hub)
    window = _Window()
    front = FrontEnd(router, workers * running, output_lens, prompt_len, window)
    if profile is not None:
        serve = router._serve_forever

        def profiled() -> None:
            profile.enable()
            try:
                serve()
            finally:
                profile.disable()
        router._serve_forever = profiled
    router.start()
    try:
        for fake in fakes:  # a child process takes a while to import its modules
            if not fake.control.poll(120) or fake.control.recv() != "ready":
                raise RuntimeError(f"fake worker {fake.name} did not start")
        front.start()
        time.sleep(warmup_s)
        window.start_s = time.time()
        cpu0, msgs0, wall0 = _thread_cpu_s(router._thread), messages[0], time.monotonic()
        front0, fakes0 = _thread_cpu_s(front.thread), sum(f.cpu_s() for f in fakes)
        time.sleep(seconds)
        cpu1, msgs1, wall1 = _thread_cpu_s(router._thread), messages[0], time.monotonic()
        front1, fakes1 = _thread_cpu_s(front.thread), sum(f.cpu_s() for f in fakes)
        window.end_s = time.time()
        front.stop_submitting()
        if not front.all_done.wait(timeout=60 + 10 * output_lens[1] * step_ms / 1000):
            raise RuntimeError(f"{front.submitted - front.finished} requests never finished")
        sent = [fake.stop() for fake in fakes]
    finally:
        router.stop()
        front.close()
        for fake in fakes:
            fake.end()
        hub.close()
    tokens_sent = sum(tokens for _, tokens in sent)
    if front.tokens != tokens_sent or front.failed:
        raise RuntimeError(f"tokens relayed {front.tokens} != sent {tokens_sent}, or "
                           f"{front.failed} requests failed")
    wall, cpu = wall1 - wall0, cpu1 - cpu0
    msgs, tokens = msgs1 - msgs0, front.tokens_in_window
    return {"channel": channel, "workers": workers, "running": running, "seconds": wall,
            "msgs_per_s": msgs / wall, "tokens_per_s": tokens / wall,
            "router_cpu_pct": 100 * cpu / wall,
            "us_per_msg": 1e6 * cpu / msgs if msgs else float("nan"),
            "us_per_token": 1e6 * cpu / tokens if tokens else float("nan"),
            "relay_p50_us": percentile(front.latencies_us, 0.5),
            "relay_p99_us": percentile(front.latencies_us, 0.99),
            "to_router_p50_us": percentile(front.to_router_us, 0.5),
            "to_router_p99_us": percentile(front.to_router_us, 0.99),
            "to_front_p99_us": percentile(front.to_front_us, 0.99),
            "front_cpu_pct": 100 * (front1 - front0) / wall,
            "fakes_cpu_pct": 100 * (fakes1 - fakes0) / wall,
            "requests_finished": front.finished, "tokens_requested": front.tokens_requested,
            "tokens_sent": tokens_sent,
            "tokens_relayed": front.tokens}


def top_of(profile: cProfile.Profile, n: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", default="8,2", help="fake workers per row")
    parser.add_argument("--running", type=int, default=64, help="requests in flight per worker")
    parser.add_argument("--step-ms", type=float, default=6.0, help="a fake's step period")
    parser.add_argument("--output-lens", default="100,300",
                        help="output tokens per request, drawn uniformly from lo,hi")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="before the window")
    parser.add_argument("--channel", choices=("unix", "sockets", "local"), default="unix")
    parser.add_argument("--cprofile", action="store_true",
                        help="cProfile the router loop thread at the heaviest load")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args(argv)
    lo, hi = (int(n) for n in args.output_lens.split(","))
    counts = [int(n) for n in args.workers.split(",")]
    print(f"CPU: {cpu_line()}")
    print(f"channel {args.channel}; a step every {args.step_ms:g} ms per worker, "
          f"{args.running} requests each, outputs {lo}-{hi} tokens, prompts "
          f"{args.prompt_len}; {args.seconds:g} s measured after {args.warmup_s:g} s")
    rows = [measure(n, args.running, args.seconds, args.warmup_s, args.step_ms, (lo, hi),
                    args.prompt_len, args.channel) for n in counts]
    light = min(rows, key=lambda r: r["workers"])
    headers = ["workers", "msgs/s", "tokens/s", "router CPU %", "x light", "us/msg",
               "us/token", "relay p50 us", "relay p99 us", "p99 x light", "to router p50",
               "to router p99", "to front p99", "front CPU %",
               "fakes CPU %", "tokens sent", "relayed"]
    print_table(headers, [[r["workers"], r["msgs_per_s"], r["tokens_per_s"],
                           r["router_cpu_pct"], r["router_cpu_pct"] / light["router_cpu_pct"],
                           r["us_per_msg"], r["us_per_token"], r["relay_p50_us"],
                           r["relay_p99_us"], r["relay_p99_us"] / light["relay_p99_us"],
                           r["to_router_p50_us"], r["to_router_p99_us"], r["to_front_p99_us"],
                           r["front_cpu_pct"], r["fakes_cpu_pct"], r["tokens_sent"],
                           r["tokens_relayed"]] for r in rows])
    heavy = max(rows, key=lambda r: r["workers"])
    for text, ok in [(f"router CPU < {CPU_TARGET_PCT:g} % of a core at {heavy['workers']} "
                      f"workers ({heavy['router_cpu_pct']:.0f} %)",
                      heavy["router_cpu_pct"] < CPU_TARGET_PCT),
                     (f"relay p99 <= {P99_TARGET_US:g} us at {heavy['workers']} workers "
                      f"({heavy['relay_p99_us']:.0f} us)", heavy["relay_p99_us"] <= P99_TARGET_US)]:
        print(f"  {'met ' if ok else 'MISS'}  {text}")
    write_rows(rows, COLUMNS, args.out, "router-cost", "router_cost.csv")
    if args.cprofile:
        profile = cProfile.Profile(time.thread_time)
        measure(max(counts), args.running, args.seconds, args.warmup_s, args.step_ms, (lo, hi),
                args.prompt_len, args.channel, profile)
        print(f"\ncProfile of the router loop thread at {max(counts)} workers, a run of its "
              f"own (CPU seconds; top by own time):")
        print(top_of(profile))
    return rows


if __name__ == "__main__":
    main()
