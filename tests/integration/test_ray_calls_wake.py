"""``RayCalls.ready`` with the online router's wake-up future among the pending calls:
``ray.wait`` (replaced by a fake here, no cluster) sees only the ObjectRefs, the future
ends the wait as soon as it is set, and a timeout still returns empty-handed."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import deployment.ray_actors as ray_actors


class FakeRay:
    """``ray.wait`` over strings: those in ``done`` are ready."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.seen: list[list] = []

    def wait(self, refs, num_returns=1, timeout=None):
        self.seen.append(list(refs))
        ready = [r for r in refs if r in self.done][:num_returns]
        if not ready and timeout:
            time.sleep(timeout)
        return ready, [r for r in refs if r not in ready]


def test_wake_future_ends_the_wait_and_only_refs_reach_ray_wait(monkeypatch):
    fake = FakeRay()
    monkeypatch.setattr(ray_actors.ray, "wait", fake.wait)
    calls = ray_actors.RayCalls()
    wake: cf.Future = cf.Future()
    threading.Timer(0.05, wake.set_result, (None,)).start()
    # an hour's timeout: only the future ends the wait (pytest's timeout guards a hang)
    assert calls.ready(["a", wake], timeout_s=3600.0) == [wake]
    assert all(all(isinstance(r, str) for r in refs) for refs in fake.seen)
    fake.done.add("a")
    assert calls.ready(["a", cf.Future()], timeout_s=5.0) == ["a"]
    start_s = time.monotonic()
    assert calls.ready(["b", cf.Future()], timeout_s=0.05) == []
    assert time.monotonic() - start_s > 0.04  # empty-handed at the timeout, not before
    idle: cf.Future = cf.Future()  # no refs at all: waits on the future alone
    threading.Timer(0.02, idle.set_result, (None,)).start()
    assert calls.ready([idle], timeout_s=5.0) == [idle]
