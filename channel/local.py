"""The in-process channel (tests and the local mode): the contract of ``channel.contract``
over Python queues, nothing serialized. A port's heartbeat runs on its own thread, as in
the sockets implementation, so death is seen the same way (a closed port falls silent).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from channel.contract import (DEAD_AFTER_S, HEARTBEAT_S, Command, Died, Endpoint, Inbox,
                              Liveness, Message, Stale, Taken)

_HEARTBEAT = object()  # body of a heartbeat (never delivered)
_HUBS: weakref.WeakValueDictionary[str, LocalHub] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


class LocalHub:
    """``channel.contract.Hub`` in one process; ports come from ``open_port``.

    Args:
        dead_after_s: silence after which an incarnation is reported dead (seconds).
        heartbeat_s: the heartbeat period its ports get (seconds).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, dead_after_s: float = DEAD_AFTER_S, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.liveness = Liveness(dead_after_s, clock)
        self.heartbeat_s = heartbeat_s
        self._inboxes: dict[str, Inbox] = {}  # Endpoint.commands -> its port's inbox
        self._current: dict[str, str] = {}  # worker -> its current Endpoint.commands
        self._arrived: collections.deque[tuple[str, int, int, Any]] = collections.deque()
        self._ready = threading.Condition()
        self._woken = False
        self.address = f"local:{next(_NUMBERS)}"  # Endpoint.messages: ``open_port`` finds it
        _HUBS[self.address] = self

    @property
    def stale(self) -> dict[tuple[str, int], int]:
        return self.liveness.stale

    def attach(self, worker: str, incarnation: int) -> Endpoint:
        self.liveness.attach(worker, incarnation)
        key = f"{worker}#{incarnation}"
        self._inboxes.pop(self._current.get(worker, ""), None)
        self._inboxes[key] = Inbox()
        self._current[worker] = key
        return Endpoint(worker, incarnation, key, self.address, self.heartbeat_s)

    def detach(self, worker: str) -> None:
        self.liveness.detach(worker)
        self._inboxes.pop(self._current.pop(worker, ""), None)

    def open_port(self, endpoint: Endpoint) -> LocalPort:
        """The worker's end of ``endpoint`` (the incarnation attached last).

        Raises:
            KeyError: ``endpoint`` is not (or no longer) attached.
        """
        return LocalPort(self, endpoint, self._inboxes[endpoint.commands])

    def send(self, worker: str, command: Command) -> None:
        inbox = self._inboxes.get(self._current.get(worker, ""))
        if inbox is not None:  # a detached worker hears nothing more
            inbox.put(command)

    def arrive(self, worker: str, incarnation: int, seq: int, body: Any) -> None:
        """A port's message (any thread)."""
        with self._ready:
            self._arrived.append((worker, incarnation, seq, body))
            self._ready.notify()

    def receive(self, timeout_s: float) -> list[Message | Died | Stale]:
        with self._ready:
            if not self._arrived and not self._woken and timeout_s > 0:
                next_death = self.liveness.next_death_in()
                self._ready.wait(timeout_s if next_death is None else min(timeout_s, next_death))
            self._woken = False
            arrived, self._arrived = self._arrived, collections.deque()
        out: list[Message | Died] = []
        for worker, incarnation, seq, body in arrived:
            if self.liveness.heard(worker, incarnation) and body is not _HEARTBEAT:
                out.append(Message(worker, incarnation, seq, body))
        out.extend(self.liveness.deaths())
        out.extend(self.liveness.strays())
        return out

    def wake(self) -> None:
        with self._ready:
            self._woken = True
            self._ready.notify()

    def close(self) -> None:
        for inbox in self._inboxes.values():
            inbox.close()
        self._inboxes.clear()
        _HUBS.pop(self.address, None)


def open_local_port(endpoint: Endpoint) -> LocalPort:
    """``LocalHub.open_port`` of the hub in this process that attached ``endpoint``.

    Raises:
        KeyError: no such hub here (closed, or in another process).
    """
    return _HUBS[endpoint.messages].open_port(endpoint)


class LocalPort:
    """``channel.contract.Port`` of a ``LocalHub`` (``LocalHub.open_port``): the hub puts
    commands straight into its ``Inbox``."""

    def __init__(self, hub: LocalHub, endpoint: Endpoint, inbox: Inbox) -> None:
        self.endpoint = endpoint
        self._hub = hub
        self._inbox = inbox
        self._seq = 0
        self._lock = threading.Lock()  # send and the heartbeat thread number messages
        self._closed = threading.Event()
        self._arrive(_HEARTBEAT)  # heard from now on
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"{endpoint.worker}-heartbeat")
        self._thread.start()

    def send(self, body: Any) -> None:
        if not self._closed.is_set():
            self._arrive(body)

    def take(self, timeout_s: float) -> Taken:
        return self._inbox.take(timeout_s)

    @property
    def arrived(self) -> int:
        return self._inbox.arrived

    @property
    def open(self) -> bool:
        return not self._closed.is_set()

    def wake(self) -> None:
        self._inbox.wake()

    def _arrive(self, body: Any) -> None:
        with self._lock:
            seq = -1 if body is _HEARTBEAT else self._seq
            self._seq += body is not _HEARTBEAT
            self._hub.arrive(self.endpoint.worker, self.endpoint.incarnation, seq, body)

    def _beat(self) -> None:
        while not self._closed.wait(self.endpoint.heartbeat_s):
            self._arrive(_HEARTBEAT)

    def close(self) -> None:
        """Stop: nothing more is sent (the hub reports this incarnation dead once silent)."""
        self._closed.set()
        self._inbox.close()
        self._thread.join(timeout=5)
