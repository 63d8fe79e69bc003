"""How the router and the deployment call workers' lifecycle methods (``info``,
``open_channel``, reads such as ``status``): an interface with a thread-based
implementation. What happens per request or per step goes over the channel instead.

The router never imports Ray. It calls ``calls.call(worker, method, *args)`` and gets a
pending call; ``ready(pending, timeout_s)`` returns those that finished and
``result(pending)`` their value, raising ``WorkerDied`` when the worker is gone.
``deployment/placement.py`` provides the Ray implementation; ``LocalCalls`` runs plain
worker objects in this process (tests, the in-process transport). What changes what a
worker holds (``submit``, ``admit``, ``abort``, ``release``) is a channel command, never a
call: the channel keeps their order.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Protocol


KILLED = "_killed_by_local_calls"  # attribute LocalCalls.kill sets on a worker object


class WorkerDied(RuntimeError):
    """The worker process is gone; every request it held has failed."""


class Calls(Protocol):
    """How lifecycle calls are made (module docstring)."""

    def call(self, worker: Any, method: str, *args: Any) -> Any: ...

    def ready(self, pending: list[Any], timeout_s: float) -> list[Any]: ...

    def result(self, pending: Any) -> Any: ...


class LocalCalls:
    """Calls plain worker objects on a thread pool."""

    def __init__(self, max_threads: int = 32) -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="call")

    def call(self, worker: Any, method: str, *args: Any) -> cf.Future:
        if getattr(worker, KILLED, False):
            future: cf.Future = cf.Future()
            future.set_exception(WorkerDied(f"worker {getattr(worker, 'name', worker)} is dead"))
            return future
        return self._pool.submit(getattr(worker, method), *args)

    def ready(self, pending: list[cf.Future], timeout_s: float) -> list[cf.Future]:
        done, _ = cf.wait(pending, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        return list(done)

    def result(self, pending: cf.Future) -> Any:
        return pending.result()

    def kill(self, worker: Any) -> None:
        """Simulate a worker death: its calls now raise WorkerDied and its loop stops."""
        setattr(worker, KILLED, True)  # on the object: a replacement is a new object
        worker.shutdown()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
