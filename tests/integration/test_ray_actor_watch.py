"""``RayWorkers``' actor-death watch survives its own errors (``ray.wait`` and ``ray.get``
replaced by fakes here, no cluster): a failed turn is logged and the watch goes on, and a
listener that raises loses only the death it was told of."""

from __future__ import annotations

import logging
import threading

import deployment.ray_actors as ray_actors


def test_the_actor_watch_logs_its_errors_and_goes_on(monkeypatch, caplog):
    workers = ray_actors.RayWorkers(("cpu:0", "cpu:1"), None, "ray")
    workers._watched = {"ref-a": ("decode-0", "h0"), "ref-b": ("decode-1", "h1")}
    failures = iter([RuntimeError("GCS hiccup")])

    def wait(refs, num_returns=1, timeout=None):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        refs = sorted(refs)
        return refs[:num_returns], refs[num_returns:]

    def get(ref, timeout=None):
        raise RuntimeError(f"the actor of {ref} died")

    monkeypatch.setattr(ray_actors.ray, "wait", wait)
    monkeypatch.setattr(ray_actors.ray, "get", get)
    monkeypatch.setattr(ray_actors, "WATCH_RETRY_S", 0.0, raising=False)
    told: list[tuple[str, str, str]] = []
    both = threading.Event()

    def on_death(name: str, handle: str, cause: str) -> None:
        told.append((name, handle, cause))
        if name == "decode-0":
            raise ValueError("a listener's bug")
        both.set()

    with caplog.at_level(logging.ERROR, logger="deployment.ray_actors"):
        workers.watch(on_death)
        assert both.wait(30), f"the watch stopped; told {told}"
        workers.close()  # no actors, no group, no Ray started: only the watch ends
    assert [(name, handle) for name, handle, _ in told] == [("decode-0", "h0"), ("decode-1", "h1")]
    assert "the actor of ref-a died" in told[0][2] and "the actor of ref-b died" in told[1][2]
    assert workers.watch_errors == 2
    logged = [r.getMessage() for r in caplog.records]
    assert logged[0] == "Ray actor watch: a turn failed; watching again"
    assert logged[1].startswith("Ray actor watch: telling of decode-0's death (")
    assert "GCS hiccup" in caplog.records[0].exc_text
