"""Workloads and checks shared by the placement tests (local and Ray)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from pathlib import Path

from conftest import random_prompts, reference_generate

from channel.contract import Message
from channel.local import LocalHub
from engine.config import EngineConfig
from engine.events import expand
from engine.request import Request, SamplingParams

ENGINE = EngineConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=24)
LENGTHS = [1, 5, 17, 40, 3, 33, 8, 12, 26, 2, 19, 7, 11, 38, 4, 21, 9, 15]


def mixed_workload(tiny, num_requests: int = 8, max_tokens: int = 10, spacing_s: float = 0.01):
    """Requests of mixed prompt lengths arriving ``spacing_s`` apart (so some arrive while
    others decode), with their generate() references."""
    prompts = random_prompts(LENGTHS[:num_requests], seed=3)
    workload = [(Request(f"r{i}", tuple(p), SamplingParams(max_tokens=max_tokens)), spacing_s * i)
                for i, p in enumerate(prompts)]
    expected = {f"r{i}": reference_generate(tiny.model, p, max_tokens) for i, p in enumerate(prompts)}
    return workload, expected


# Lengths around the KV block boundaries at the default block size 16.
BOUNDARY_LENGTHS = (15, 16, 17, 31, 32, 33)


def boundary_workload(tiny, spacing_s: float = 0.005, start_s: float = 0.0):
    """Requests whose prompt is 15, 16, 17, 31, 32, 33 tokens (3 output tokens: the exported
    prompt KV ends in a partial, full or just-started block), then requests whose prompt +
    max_tokens is each of those (the reservation ends there), with their generate()
    references."""
    prompts = random_prompts(list(BOUNDARY_LENGTHS) + [n - 4 for n in BOUNDARY_LENGTHS], seed=17)
    max_tokens = [3] * len(BOUNDARY_LENGTHS) + [4] * len(BOUNDARY_LENGTHS)
    workload = [(Request(f"b{i}", tuple(p), SamplingParams(max_tokens=m)), start_s + spacing_s * i)
                for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    expected = {f"b{i}": reference_generate(tiny.model, p, m)
                for i, (p, m) in enumerate(zip(prompts, max_tokens))}
    return workload, expected


def soak_workload(tiny, num_requests: int = 500, num_prompts: int = 16, max_tokens: int = 4,
                  prefix_len: int = 0):
    """The soak tests' workload: ``num_requests`` requests ``q000``, ``q001``, ... cycling
    over ``num_prompts`` random prompts of 3-15 tokens, 2 ms apart, EOS ignored; returns
    (workload, request id -> generate() tokens). ``prefix_len`` > 0: each prompt starts
    with one of two random system prompts of that many tokens (prefix cache hits)."""
    prompts = random_prompts([3 + i % 13 for i in range(num_prompts)], seed=31)
    if prefix_len:
        systems = random_prompts([prefix_len] * 2, seed=32)
        prompts = [systems[i % 2] + p for i, p in enumerate(prompts)]
    references = [reference_generate(tiny.model, p, max_tokens) for p in prompts]
    workload = [(Request(f"q{i:03d}", tuple(prompts[i % num_prompts]),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True)), 0.002 * i)
                for i in range(num_requests)]
    return workload, {f"q{i:03d}": references[i % num_prompts] for i in range(num_requests)}


_HUBS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # worker -> its listening hub


def listen(worker) -> LocalHub:
    """The hub of ``worker``'s channel, as a router's would be: attached and opened on the
    first call (the events it emitted before leave then), the same hub after."""
    hub = _HUBS.get(worker)
    if hub is None:
        hub = _HUBS[worker] = LocalHub(dead_after_s=3600.0)
        worker.open_channel(hub.attach(worker.name, 0))
    return hub


def watch_sends(worker, seen) -> None:
    """Open ``worker``'s channel (``listen``) and call ``seen(events)`` (one event per token)
    with every message its port sends, just before it leaves."""
    listen(worker)
    send = worker._port.send

    def watched(body) -> None:
        seen(expand(body))
        send(body)
    worker._port.send = watched


def events_within(worker, wait_s: float) -> list:
    """What ``worker`` sends within ``wait_s`` seconds (one event per token)."""
    items = listen(worker).receive(wait_s)
    return [e for item in items if isinstance(item, Message) for e in expand(item.body)]


def collect_events(worker, done, timeout_s: float = 20.0, poll_s: float = 0.2) -> list:
    """``worker``'s events through its channel (``listen``; a step's ``TokenBatch`` as its
    ``token`` events) until ``done(events)``; fails at the deadline naming the worker and
    what it got."""
    events: list = []
    deadline_s = time.monotonic() + timeout_s
    while not done(events):
        left_s = deadline_s - time.monotonic()
        assert left_s > 0, f"{worker.name}: timed out, got {events}"
        events += events_within(worker, min(left_s, poll_s))
    return events


def assert_outputs(records, expected) -> None:
    for record in records:
        assert record.error is None, (record.request_id, record.error)
        assert record.output_token_ids == expected[record.request_id], record.request_id
        assert len(record.token_times_s) == len(record.output_token_ids)


def was_decoding_on(record, worker: str) -> bool:
    """A failed request was ``worker``'s when that decode worker died: decoding there, or moved
    to another after ``worker`` had fetched (and freed) its KV, so fetching it again failed
    (the router's error says so, naming the death)."""
    return record.decode_worker == worker or (
        f"decode worker {worker} died" in record.error
        and "(after its KV was handed over); fetching it again failed" in record.error)


def assert_clean(deployment, settle_s: float = 10.0) -> None:
    """Nothing leaked: every live worker's engine is empty and its transport holds nothing,
    within ``settle_s`` seconds (Ray frees an object once its last borrower lets go, and a
    killed actor's borrowed references are released asynchronously, after its death is
    seen: an immediate count can still include them; a real leak never drains, or only when
    Python's cycle collector runs: an ObjectRef in a garbage reference cycle, which fails
    here now and then, ``engine.errors.without_traceback``)."""
    deadline_s = time.monotonic() + settle_s
    while True:
        statuses = deployment.statuses()
        clean = all(s["engine_empty"] and s.get("transport_held", 0) == 0 for s in statuses)
        if clean or time.monotonic() >= deadline_s:
            break
        time.sleep(0.1)
    for status in statuses:
        assert status["engine_empty"], status
        assert status.get("transport_held", 0) == 0, status


@contextlib.contextmanager
def local_ray(num_cpus: int = 4):
    """A private local Ray instance whose workers can import pdlab, these test helpers and
    the modules of tests/ray (actor classes defined there). Logical CPUs: 4 leaves room for
    a 3-worker placement on 2 cores. Tests share one through the ``shared_ray`` fixture
    (tests/conftest.py)."""
    import ray

    from deployment.ray_actors import ray_init_kwargs

    kwargs = ray_init_kwargs()
    env = kwargs["runtime_env"]["env_vars"]
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(here), str(here / "ray")])
    ray.init(num_cpus=num_cpus, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def ray_leftovers(settle_s: float = 30.0) -> list[str]:
    """What the running Ray cluster still holds that a finished test must not leave: actors
    not dead, named actors, placement groups not removed, logical CPUs in use; [] once
    clean, within ``settle_s`` seconds (``ray.kill`` and ``remove_placement_group`` only
    ask: the actor dies, and the resources come back, a moment later)."""
    import ray
    from ray._private import state  # the GCS tables: the state API needs the dashboard

    deadline_s = time.monotonic() + settle_s
    while True:
        left = [f"actor {a['ActorClassName']} {a['State']}" for a in state.actors().values()
                if a["State"] != "DEAD"]
        left += [f"named actor {a['name']!r}"
                 for a in ray.util.list_named_actors(all_namespaces=True)]
        left += [f"placement group {g['bundles']} {g['state']}"
                 for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources()["CPU"]
        if free != total:
            left.append(f"{total - free:g} of {total:g} CPUs in use")
        if not left or time.monotonic() >= deadline_s:
            return left
        time.sleep(0.05)


class Probe:
    """A stand-in worker (no model) for ``RayCalls`` tests: ``fail`` raises like a worker
    whose engine loop died, ``hang`` ends only with the actor."""

    def fail(self) -> None:
        from engine.serving import EngineLoopDied

        raise EngineLoopDied("probe: engine loop died: RuntimeError: boom")

    def hang(self) -> None:
        """Never returns: only the actor's death ends this call."""
        import threading

        threading.Event().wait()


def kill_once_decoding(deployment, worker: str, bound_s: float = 60.0) -> threading.Thread:
    """Kill ``worker`` once a request decodes there (a token past its first): a kill by timer
    can land before any request reached it, or after all left, and then nothing fails and a
    test of how its death is named checks nothing. Gives up (no kill) after ``bound_s``."""

    def watch() -> None:
        end_s = time.monotonic() + bound_s
        while time.monotonic() < end_s:
            flights = list(deployment.router._flights.values())
            if any(f.worker == worker and f.stage == "decode"
                   and len(f.record.output_token_ids) >= 2 for f in flights):
                deployment.kill(worker)
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, name=f"kill {worker} once decoding", daemon=True)
    thread.start()
    return thread
