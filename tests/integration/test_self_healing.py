"""Self-healing placements on local placements of the tiny model: a worker that
dies is restarted under its budget and rejoins its pool.

- disagg:1p1d over HTTP: 4 open streams end with an error event naming decode-0 as soon as
  it is killed; a request sent right after the kill waits for the replacement and gets the
  exact greedy output; /health and /metrics report the restart; nothing leaks.
- disagg:1p2d under a steady stream of requests: one decode worker killed mid-run; no
  request arriving after the kill fails (those assigned to it but not decoding there yet
  move to the survivor), every output exact, the pool whole again, the replacement routed
  to again.
- The budget running out: the second death is final, requests get 503 with the reason
  and /health 503; a replacement that fails to start uses up the budget, attempt by
  attempt, then gives up (no loop); a request waiting for an empty pool past its deadline
  gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import threading
import time

import httpx
import pytest
from conftest import random_prompts, reference_generate
from placement_helpers import assert_clean

from engine.config import EngineConfig, ModelConfig, PlacementConfig, TransferConfig
from engine.request import Request, SamplingParams
from deployment.placement import Deployment
from deployment.restarts import Restarts
from router.calls import KILLED
from router.router import NothingToReplace
from server.app import OpenAIServer, ServerThread
from server.text import ByteText

pytestmark = pytest.mark.workers
TINY = ModelConfig("tiny-random-llama")
ENGINE = EngineConfig(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=64)
BYTES = ByteText()


@contextlib.contextmanager
def served(placement: str, restarts: int, faults: dict | None = None,
           deadline_s: float | None = None, devices: tuple[str, ...] | None = None):
    with Deployment(PlacementConfig(placement, "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                    faults=faults, deadline_s=deadline_s, worker_devices=devices,
                    max_worker_restarts=restarts) as dep:
        server = ServerThread(OpenAIServer(dep.router, BYTES, "tiny").app).start()
        try:
            yield server.url, dep
        finally:
            server.stop()


def wait_for(predicate, timeout_s: float = 30.0, what: str = "") -> float:
    """Seconds until ``predicate()``; fails after ``timeout_s``."""
    start_s = time.monotonic()
    while not predicate():
        assert time.monotonic() - start_s < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.monotonic() - start_s


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event,
                  out: dict) -> None:
    """One streamed completion: its text chunks and error events."""
    out.update(chunks=0, errors=[], done=False)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event["error"]["message"])
            else:
                out["chunks"] += 1
                if out["chunks"] >= 2:
                    started.set()


def test_killed_decode_worker_ends_its_streams_restarts_and_serves_again(tiny):
    """decode-0 steps take 20 ms, so 100-token streams last ~2 s: kill it when all 4 have
    tokens; each ends with one error event naming decode-0's death (not the 60 s deadline),
    before its 100 tokens; a request sent right after the kill is exact (it waited for the
    replacement)."""
    prompt = random_prompts([9], seed=11)[0]
    with served("disagg:1p1d", restarts=1, faults={"decode-0": {"step_delay_s": 0.02}}) as (url, dep):
        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                outs = [{} for _ in range(4)]
                events = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.ensure_future(_stream(client, url, {
                    "prompt": [5 + i, 6, 7], "max_tokens": 100, "ignore_eos": True,
                    "stream": True, "temperature": 0}, events[i], outs[i])) for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
                dep.kill("decode-0")
                reply = await client.post(f"{url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 6, "temperature": 0})
                await asyncio.gather(*tasks)
                return outs, reply

        outs, reply = asyncio.run(scenario())
        for out in outs:
            assert out["done"] and len(out["errors"]) == 1, out
            assert "decode worker decode-0 died: killed" in out["errors"][0], out["errors"]
            assert 2 <= out["chunks"] < 100
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == BYTES.decode(reference_generate(
            tiny.model, prompt, 6))
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["workers"]["decode-0"] == {"role": "decode", "state": "live",
                                                        "restarts": 1}
        assert metric(url, 'pdlab:worker_restarts_total{role="decode",worker="decode-0"}') == 1
        assert metric(url, 'pdlab:worker_restarts_total{role="prefill",worker="prefill-0"}') == 0
        assert dep.restarts.attempts == {"decode-0": 1}
        wait_for(lambda: dep.router.num_running + dep.router.num_waiting == 0, what="idle router")
        assert_clean(dep)
        assert dep.transport.num_held() == 0 and set(dep.router.loads.values()) == {0}


def test_one_decode_worker_of_1p2d_killed_mid_run_loses_no_later_request(tiny):
    """40 requests 25 ms apart (round robin over decode-0 and decode-1, whose steps take
    10 ms); decode-1 is killed at 0.4 s. Requests that arrive after the kill all succeed with
    generate()'s tokens; those decoding on decode-1 at the kill fail naming it; decode-1
    comes back and the last requests are routed to it again."""
    prompts = random_prompts([4 + i % 9 for i in range(40)], seed=5)
    workload = [(Request(f"s{i:02d}", tuple(p), SamplingParams(max_tokens=8, ignore_eos=True)),
                 0.025 * i) for i, p in enumerate(prompts)]
    expected = {f"s{i:02d}": reference_generate(tiny.model, p, 8) for i, p in enumerate(prompts)}
    with Deployment(PlacementConfig("disagg:1p2d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True,
                    policy="round_robin", worker_devices=("cpu:0", "cpu:1", "cpu:1"),
                    faults={"decode-1": {"step_delay_s": 0.01}},
                    max_worker_restarts=1) as dep:
        kills: list[float] = []
        timer = threading.Timer(0.4, lambda: (kills.append(time.time()), dep.kill("decode-1")))
        timer.start()
        records = dep.run(workload)
        timer.join()
        ref = dep.router.workers["decode-1"]
        assert (ref.state, ref.restarts) == ("live", 1)
        failed = [r for r in records if r.error]
        assert failed  # decode-1 had requests decoding at the kill
        assert all(r.timeline["arrived"] < kills[0] for r in failed), [r.request_id for r in failed]
        assert all("decode worker decode-1 died" in r.error for r in failed)
        done = [r for r in records if not r.error]
        assert len(done) >= 30
        for record in done:
            assert record.output_token_ids == expected[record.request_id], record.request_id
        after = dep.run([(Request(f"t{i}", tuple(prompts[i]), SamplingParams(max_tokens=8,
                                                                              ignore_eos=True)), 0.0)
                         for i in range(4)])
        assert [r.error for r in after] == [None] * 4
        assert {r.decode_worker for r in after} == {"decode-0", "decode-1"}  # the pool is whole
        assert_clean(dep)
        assert dep.transport.num_held() == 0 and set(dep.router.loads.values()) == {0}


def test_the_restart_budget_running_out_is_a_clear_503_and_no_loop(tiny):
    """Budget 1: the first death of decode-0 is healed, the second is final: a request gets
    503 naming the spent budget (no Retry-After: nothing is coming), /health is 503 with the
    cause, and no further attempt is made."""
    with served("disagg:1p1d", restarts=1) as (url, dep):
        dep.kill("decode-0")
        wait_for(lambda: dep.router.workers["decode-0"].restarts == 1, what="the restart")
        dep.kill("decode-0")
        wait_for(lambda: dep.router.workers["decode-0"].state == "dead", what="the final death")
        for body, endpoint in (({"prompt": [5, 6], "max_tokens": 3}, "completions"),
                               ({"prompt": [5, 6], "max_tokens": 3, "stream": True}, "completions"),
                               ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                                "chat/completions")):
            reply = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=30)
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert "no live decode worker" in message and "restart budget of 1" in message
            assert "retry-after" not in reply.headers
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert health.json()["dead_workers"] == ["decode-0"]
        decode = health.json()["workers"]["decode-0"]
        assert decode["state"] == "dead" and decode["restarts"] == 1
        assert "--max-worker-restarts" in decode["cause"]
        time.sleep(0.3)
        assert dep.restarts.attempts == {"decode-0": 1}


def test_a_replacement_that_cannot_start_spends_the_budget_then_gives_up(tiny, monkeypatch):
    """Every restart of prefill-0 raises: 3 attempts (the budget), then the worker is lost
    with the last error; requests get 503 naming it."""
    with served("disagg:1p1d", restarts=3) as (url, dep):
        calls = []

        def broken(name):
            calls.append(name)
            raise RuntimeError("device busy")

        monkeypatch.setattr(dep.restarts, "spawn", broken)
        dep.restarts.backoff_s = 0.01
        dep.kill("prefill-0")
        wait_for(lambda: dep.router.workers["prefill-0"].state == "dead", what="giving up")
        time.sleep(0.2)
        assert calls == ["prefill-0"] * 3 and dep.restarts.attempts == {"prefill-0": 3}
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2},
                           timeout=30)
        assert reply.status_code == 503
        message = reply.json()["error"]["message"]
        assert "restart budget of 3" in message and "RuntimeError: device busy" in message


def test_a_request_waits_for_an_empty_pool_up_to_its_deadline_then_gets_503(tiny, monkeypatch):
    """The replacement starts only once the test lets it, the deadline is 0.5 s: a request
    sent while the decode pool is empty waits its deadline, then gets 503 with Retry-After
    naming the empty pool; once the replacement is back, requests are served again."""
    with served("disagg:1p1d", restarts=1, deadline_s=0.5) as (url, dep):
        spawn, go = dep.restarts.spawn, threading.Event()

        def slow(name):
            go.wait(60)  # a hang guard: the test sets it
            return spawn(name)

        monkeypatch.setattr(dep.restarts, "spawn", slow)
        dep.kill("decode-0")
        wait_for(lambda: dep.router.workers["decode-0"].state == "restarting", what="restarting")
        start_s = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3},
                           timeout=30)
        waited_s = time.monotonic() - start_s
        assert reply.status_code == 503 and reply.headers["retry-after"] == "2", reply.text
        assert "no live worker in the decode pool within 0.5 s (decode-0 restarting)" in \
            reply.json()["error"]["message"]
        assert waited_s >= 0.5  # it waited its deadline
        health = httpx.get(f"{url}/health").json()
        assert health["workers"]["decode-0"]["state"] == "restarting"
        go.set()
        wait_for(lambda: dep.router.workers["decode-0"].alive, what="the replacement")
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3},
                           timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
        assert_clean(dep)


# ---- the budget alone (no workers) --------------------------------------------------------

class _Router:
    """``Router.rejoin``'s answer at once: None, or the refusal ``refuse`` maps a handle to."""

    def __init__(self, refuse: dict | None = None):
        self.joined, self.lost, self.refuse = [], [], refuse or {}

    def rejoin(self, name, handle, info):
        self.joined.append((name, handle, info))
        answer: cf.Future = cf.Future()
        answer.set_result(self.refuse.get(handle))
        return answer

    def worker_lost(self, name, reason):
        self.lost.append((name, reason))


def test_restarts_count_attempts_per_worker_and_stop_at_the_budget():
    outcomes = iter([RuntimeError("first fails"), "h1", "h2"])
    stopped = []

    def spawn(name):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    restarts = Restarts(2, spawn, lambda name, handle, stop: {"ok": handle},
                        stopped.append, backoff_s=0.0)
    router = restarts.router = _Router()
    assert restarts.on_died("decode-0", "died") is None  # attempt 1 fails, attempt 2 joins
    restarts._threads["decode-0"].join(5)
    assert router.joined == [("decode-0", "h1", {"ok": "h1"})] and stopped == []
    assert restarts.attempts == {"decode-0": 2}
    reason = restarts.on_died("decode-0", "died again")
    assert "restart budget of 2 (--max-worker-restarts) is spent" in reason
    assert "RuntimeError: first fails" in reason and router.lost == []
    assert restarts.on_died("prefill-0", "died") is None  # its own budget
    restarts._threads["prefill-0"].join(5)
    assert router.joined[-1][:2] == ("prefill-0", "h2")
    restarts.close()
    assert "closing" in restarts.on_died("prefill-0", "died")


def test_restarts_off_for_a_transport_that_cannot_take_a_new_member():
    restarts = Restarts(3, lambda n: n, lambda n, h, s: {}, lambda h: None,
                        disabled="torchdist's process group cannot take a new member")
    restarts.router = _Router()
    assert restarts.on_died("decode-0", "died") == (
        "restarts are off: torchdist's process group cannot take a new member")
    assert restarts.attempts == {}


def test_a_refused_replacement_is_stopped_and_the_budget_retried_then_spent():
    """The router refuses h1 (it could not open its channel): h1 is stopped and h2 tried,
    which joins. Later every replacement is refused: each is stopped, and once the budget
    is spent the router hears that none will come, with the last refusal."""
    refusals = {"h1": "its replacement could not open its channel: TimeoutError",
                "h3": "its replacement has a different KV geometry than the placement",
                "h4": "its replacement could not open its channel: connection refused"}
    handles = iter(["h1", "h2", "h3", "h4"])
    stopped = []
    restarts = Restarts(4, lambda name: next(handles), lambda name, handle, stop: {},
                        stopped.append, backoff_s=0.0)
    router = restarts.router = _Router(refusals)
    assert restarts.on_died("decode-0", "died") is None
    restarts._threads["decode-0"].join(5)
    assert [h for _, h, _ in router.joined] == ["h1", "h2"] and stopped == ["h1"]
    assert router.lost == [] and restarts.attempts == {"decode-0": 2}
    assert restarts.on_died("decode-0", "died again") is None
    restarts._threads["decode-0"].join(5)
    assert [h for _, h, _ in router.joined] == ["h1", "h2", "h3", "h4"]
    assert stopped == ["h1", "h3", "h4"] and restarts.attempts == {"decode-0": 4}
    assert router.lost == [("decode-0", "died; not restarted: its restart budget of 4 "
                                        "(--max-worker-restarts) is spent; last attempt: "
                                        + refusals["h4"])]


def test_a_replacement_the_router_does_not_need_is_stopped_once_and_costs_no_attempt():
    """The router refuses h1 as spare (decode-0 is live: ``NothingToReplace``): h1 is
    stopped, nothing is retried, no attempt is counted, and the router hears no
    ``worker_lost``. The full budget is still there for a later death."""
    handles = iter(["h1", "h2"])
    stopped = []
    restarts = Restarts(1, lambda name: next(handles), lambda name, handle, stop: {},
                        stopped.append, backoff_s=0.0)
    router = restarts.router = _Router(
        {"h1": NothingToReplace("worker decode-0 is live: nothing to replace")})
    assert restarts.on_died("decode-0", "died") is None
    restarts._threads["decode-0"].join(5)
    assert [h for _, h, _ in router.joined] == ["h1"] and stopped == ["h1"]
    assert restarts.attempts == {"decode-0": 0} and router.lost == []
    assert restarts.on_died("decode-0", "died again") is None  # the budget of 1 is whole
    restarts._threads["decode-0"].join(5)
    assert [h for _, h, _ in router.joined] == ["h1", "h2"] and stopped == ["h1"]


def test_a_worker_declared_dead_while_alive_is_stopped(tiny):
    """A false death: decode-0's port falls silent while its loop runs on (as a starved
    worker's heartbeat can). The router declares it dead; the deployment stops that
    incarnation (its loop ends, its calls fail), so nothing runs for nobody."""
    with Deployment(PlacementConfig("disagg:1p1d", "cpu:0,cpu:1"), TINY, ENGINE,
                    TransferConfig(transport="inprocess", timeout_s=5.0), local=True) as dep:
        assert dep.run([(Request("r0", (5, 6, 7), SamplingParams(max_tokens=2)), 0.0)]
                       )[0].error is None
        alive = dep.handles["decode-0"]
        dep.router.hub.liveness.dead_after_s = 0.3  # (not before: loading is not silence)
        alive._port.close()  # silent from now on; its engine loop still runs
        assert alive._thread.is_alive()
        dep.router.start()
        try:
            wait_for(lambda: dep.router.workers["decode-0"].state == "dead", what="the death")
            wait_for(lambda: not alive._thread.is_alive(), what="the incarnation to stop")
        finally:
            dep.router.stop()
        assert "its channel fell silent" in dep.router.workers["decode-0"].cause
        assert getattr(alive, KILLED) is True
