"""Restarting dead workers under a budget: the deployment's half of self-healing (the router's
half, ``router.router``, fails or parks a dead worker's requests and routes to the replacement
once it rejoins).

1. The router asks ``Restarts.on_died(name, cause)`` on its loop thread. With attempts left
   (``max_restarts`` per worker, over the deployment's life, rejoined workers included) it
   answers None at once and a thread of this worker starts the replacement; else it answers
   why not and the worker stays dead.
2. On that thread: ``spawn(name)`` builds the worker again as it was, ``ready(name, handle,
   should_stop)`` waits for its first ``info()`` (bounded by ``startup_timeout_s``), then
   ``router.rejoin``'s answer (it may refuse the replacement).
3. A failed attempt (one that raised, or a refused replacement) stops what it started
   (``stop(handle)``), counts against the budget and is retried after ``backoff_s``; once the
   budget is spent the router hears ``worker_lost`` with the last error, and requests that
   need the worker fail at once. A replacement the router does not need (``NothingToReplace``:
   the worker is live, or another replacement joins) is stopped once and costs no attempt.

``close()`` ends the threads (an attempt in progress is abandoned and its worker stopped).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any

from engine.errors import describe_error
from router.router import NothingToReplace


class Restarts:
    """The restart budget of one deployment's workers (module docstring).

    Args:
        max_restarts: attempts per worker (0: never restart).
        spawn: ``spawn(name) -> handle`` builds a replacement of worker ``name``.
        ready: ``ready(name, handle, should_stop) -> info`` waits for its ``info()``,
            raising when it fails to start; ``should_stop()`` turns true on ``close``.
        stop: ``stop(handle)`` stops a replacement that failed to start or was refused
            (best effort).
        disabled: why this deployment cannot restart workers (e.g. its transport's group
            cannot take a new member), or None; then every death is final, with this reason.
        backoff_s: seconds between two attempts of one worker.
    """

    def __init__(self, max_restarts: int, spawn: Callable[[str], Any],
                 ready: Callable[[str, Any, Callable[[], bool]], dict],
                 stop: Callable[[Any], None], disabled: str | None = None,
                 backoff_s: float = 1.0) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        self.spawn, self.ready, self.stop = spawn, ready, stop
        self.disabled = disabled
        self.backoff_s = backoff_s
        self.router: Any = None  # set once the router exists (it calls on_died)
        self.attempts: dict[str, int] = {}  # worker -> attempts made
        self.errors: dict[str, str] = {}  # worker -> why its last attempt failed
        self._threads: dict[str, threading.Thread] = {}
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def on_died(self, name: str, cause: str) -> str | None:
        """Worker ``name`` died (``cause``): None when a replacement is on its way, else why
        it will not be restarted (``why_not``). Never blocks (the router's loop calls it)."""
        with self._lock:
            if self.disabled is not None or self._closing.is_set() or self.router is None:
                return self.why_not(name)
            if self.attempts.get(name, 0) >= self.max_restarts:
                return self.why_not(name)
            thread = self._threads.get(name)
            if thread is not None and thread.is_alive():
                return None  # a replacement is already being started
            thread = threading.Thread(target=self._restart, args=(name,),
                                      name=f"restart-{name}", daemon=True)
            self._threads[name] = thread
        thread.start()
        return None

    def why_not(self, name: str) -> str:
        """Why worker ``name`` will not be restarted (for error messages)."""
        if self.disabled is not None:
            return f"restarts are off: {self.disabled}"
        if self._closing.is_set() or self.router is None:
            return "the deployment is closing"
        last = f"; last attempt: {self.errors[name]}" if name in self.errors else ""
        return (f"its restart budget of {self.max_restarts} "
                f"(--max-worker-restarts) is spent{last}")

    def _restart(self, name: str) -> None:
        while not self._closing.is_set():
            with self._lock:
                if self.attempts.get(name, 0) >= self.max_restarts:
                    break
                self.attempts[name] = self.attempts.get(name, 0) + 1
            handle = None
            try:
                handle = self.spawn(name)
                info = self.ready(name, handle, self._closing.is_set)
                refused = self._join(name, handle, info)
            except Exception as err:  # counts against the budget; tried again after a pause
                refused = f"{type(err).__name__}: {describe_error(err)}"
            if refused is None:
                return
            if handle is not None:
                self._stop(handle)
            if isinstance(refused, NothingToReplace):  # spare, not a failed restart
                with self._lock:
                    self.attempts[name] -= 1
                return
            if self._closing.is_set():
                return
            self.errors[name] = refused
            self._closing.wait(self.backoff_s)
        if not self._closing.is_set():
            self.router.worker_lost(name, f"died; not restarted: {self.why_not(name)}")

    def _join(self, name: str, handle: Any, info: dict) -> str | None:
        """``router.rejoin`` and wait for its answer: None (it serves) or why it was refused.

        Raises:
            RuntimeError: the deployment closed first.
        """
        joined = self.router.rejoin(name, handle, info)
        while True:
            if self._closing.is_set():
                raise RuntimeError(f"{name}: the deployment closed while it joined")
            try:
                return joined.result(timeout=0.2)  # slices: close never waits for it
            except cf.TimeoutError:
                continue

    def _stop(self, handle: Any) -> None:
        try:
            self.stop(handle)
        except Exception:  # it is being abandoned either way
            pass

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop restarting; wait (bounded) for the threads, which stop what they started."""
        self._closing.set()
        for thread in list(self._threads.values()):
            thread.join(timeout_s)
