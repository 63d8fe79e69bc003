"""The channel contract: what crosses it, the rules both implementations keep (checked against
each by tests/unit/test_channel.py), and their bookkeeping (``Inbox``, ``Liveness``), owned here.

- **Ordering.** Commands reach a port in the order the hub sent them; a port's messages reach
  the hub in the order sent, numbered ``seq`` = 0, 1, 2, ... per incarnation. Commands sent
  before the port connected wait in the hub and leave, in order, while its owner's loop turns
  (``receive``).
- **Abort overtaking.** The moment an ``abort`` reaches the port's inbox, a command for the same
  request still queued there (its ``submit`` or ``admit``) is cancelled: never applied, and
  handed back under ``Taken.cancelled`` so the worker frees what it carries (an ``admit``'s KV
  handles). The abort itself is still delivered, in its place, to free what the worker holds.
- **Death.** A port sends a heartbeat every ``HEARTBEAT_S`` seconds from its own thread; the
  hub reports an incarnation silent for ``DEAD_AFTER_S`` seconds as a ``Died`` notice from
  ``receive``, once. Silence counts from the incarnation's first message: a worker still
  loading its model is watched by its deployment (start-up timeout, Ray's actor death). A
  port whose own thread fails says so before it stops: a ``Died`` with its ``cause``.
- **Incarnation.** Every message carries its worker's name and incarnation. The hub delivers
  only the messages of the incarnation attached last; those of an earlier or a dead one are
  dropped (``Hub.stale`` counts them), never make its worker look alive, and the first of
  each such incarnation is reported (``Stale``): it should not run.
- **Bad input.** A message that cannot be decoded is logged and dropped, nothing else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

HEARTBEAT_S = 0.1  # a port's heartbeat period (seconds)
# silence after which the hub reports an incarnation dead (seconds): a backstop for a hung
# worker; a crash is heard at once (last words, Ray's actor watch), and a CPU-starved one
# on a loaded host can miss a second of heartbeats while alive
DEAD_AFTER_S = 3.0

# command kinds that change what a worker holds; ABORT cancels a queued SUBMIT / ADMIT
SUBMIT, ADMIT, ABORT, RELEASE = "submit", "admit", "abort", "release"
CANCELLABLE = (SUBMIT, ADMIT)


@dataclass(frozen=True)
class Command:
    """One command to a worker.

    Attributes:
        kind: ``submit``, ``admit``, ``abort``, ``release`` or another name the worker knows.
        request_id: the request it concerns (None for ``release`` and the like).
        args: its arguments, values the wire can carry (``channel.wire``).
    """

    kind: str
    request_id: str | None = None
    args: tuple = ()


@dataclass(frozen=True)
class Message:
    """One message of a worker (normally one per engine step), as the hub delivers it.

    Attributes:
        worker, incarnation: who sent it (the incarnation attached last, always).
        seq: 0, 1, 2, ... per incarnation, in the order sent.
        body: what the worker sent.
    """

    worker: str
    incarnation: int
    seq: int
    body: Any


@dataclass(frozen=True)
class Died:
    """A worker incarnation fell silent for ``silent_s`` >= ``DEAD_AFTER_S`` seconds, or its
    port reported its own failure (``cause``; ``silent_s`` 0)."""

    worker: str
    incarnation: int
    silent_s: float
    cause: str = ""


@dataclass(frozen=True)
class Stale:
    """An incarnation that is not (or no longer) its worker's spoke (module docstring:
    incarnation); reported once per incarnation."""

    worker: str
    incarnation: int


@dataclass(frozen=True)
class Endpoint:
    """What a worker opens its ``Port`` with (``Hub.attach``); plain values, so it crosses
    processes. ``commands``, ``messages``: the two addresses (the sockets implementation's
    ``ipc://`` or ``tcp://`` URLs; the local one's keys)."""

    worker: str
    incarnation: int
    commands: str
    messages: str
    heartbeat_s: float = HEARTBEAT_S


@dataclass
class Taken:
    """What ``Port.take`` returns: the commands to apply, in order, and the cancelled ones
    (module docstring, abort overtaking), whose resources the worker frees."""

    commands: list[Command] = field(default_factory=list)
    cancelled: list[Command] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.commands or self.cancelled)


class Inbox:
    """A port's queue of commands that arrived and are not yet taken (thread-safe): the
    port's receiving side puts, the worker's loop takes. Owns the abort rule."""

    def __init__(self) -> None:
        self._commands: list[Command | None] = []  # None: a cancelled slot
        self._cancelled: list[Command] = []
        self._queued: dict[str, int] = {}  # request id -> index of its cancellable command
        self._ready = threading.Condition()
        self._closed = self._woken = False
        self.arrived = 0  # commands put so far (cancelled ones and aborts included)

    def put(self, command: Command) -> None:
        with self._ready:
            if command.kind == ABORT and command.request_id in self._queued:
                index = self._queued.pop(command.request_id)
                self._cancelled.append(self._commands[index])
                self._commands[index] = None
            elif command.kind in CANCELLABLE and command.request_id is not None:
                self._queued[command.request_id] = len(self._commands)
            self._commands.append(command)
            self.arrived += 1
            self._ready.notify()

    def __len__(self) -> int:
        """Commands waiting to be taken (cancelled ones included)."""
        return len(self._commands) + len(self._cancelled)

    def take(self, timeout_s: float) -> Taken:
        """Everything queued; waits up to ``timeout_s`` seconds for the first command (0:
        never waits); empty-handed at the deadline, after a ``wake``, or once closed."""
        with self._ready:
            if not (self._commands or self._cancelled or self._closed or self._woken) \
                    and timeout_s > 0:
                self._ready.wait(timeout_s)
            self._woken = False
            taken = Taken([c for c in self._commands if c is not None], self._cancelled)
            self._commands, self._cancelled, self._queued = [], [], {}
        return taken

    def wake(self) -> None:
        """End a waiting ``take`` (or the next one) at once (any thread)."""
        with self._ready:
            self._woken = True
            self._ready.notify_all()

    def close(self) -> None:
        """Wake a waiting ``take`` for good (the port closed)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class Liveness:
    """The hub's record of which incarnation of each worker counts, and when each was last
    heard (module docstring: death and incarnation rules). ``clock``: seconds, monotonic."""

    def __init__(self, dead_after_s: float = DEAD_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dead_after_s = dead_after_s
        self.clock = clock
        self.current: dict[str, int] = {}  # worker -> incarnation attached last
        self._last_seen: dict[str, float] = {}  # worker -> when its current one last spoke
        self._dead: set[tuple[str, int]] = set()
        self.stale: dict[tuple[str, int], int] = {}  # (worker, incarnation) -> dropped messages
        self._strays: list[Stale] = []  # stale incarnations not yet reported
        self.next_seq: dict[str, int] = {}  # worker -> seq its current incarnation sends next

    def attach(self, worker: str, incarnation: int) -> None:
        """From now on ``incarnation`` is ``worker``'s; earlier ones are stale.

        Raises:
            ValueError: ``incarnation`` is not newer than the one attached.
        """
        if incarnation <= self.current.get(worker, -1):
            raise ValueError(f"worker {worker}: incarnation {incarnation} is not newer than "
                             f"{self.current[worker]}")
        self.current[worker] = incarnation
        self._last_seen.pop(worker, None)
        self.next_seq[worker] = 0

    def detach(self, worker: str) -> None:
        """Forget ``worker`` (its messages are stale from now on, no death is reported)."""
        if worker in self.current:
            self._dead.add((worker, self.current[worker]))
            self._last_seen.pop(worker, None)

    def heard(self, worker: str, incarnation: int) -> bool:
        """``worker``'s ``incarnation`` spoke now; False (counted in ``stale``) when that
        message must be dropped: another incarnation's, or a dead one's."""
        if self.current.get(worker) != incarnation or (worker, incarnation) in self._dead:
            if (worker, incarnation) not in self.stale:
                self._strays.append(Stale(worker, incarnation))
            self.stale[(worker, incarnation)] = self.stale.get((worker, incarnation), 0) + 1
            return False
        self._last_seen[worker] = self.clock()
        return True

    def strays(self) -> list[Stale]:
        """Stale incarnations that spoke since the last call, each reported once."""
        strays, self._strays = self._strays, []
        return strays

    def failed(self, worker: str, incarnation: int, cause: str) -> Died | None:
        """``worker``'s ``incarnation`` reported its own failure: dead from now on; its
        ``Died`` (None for a stale or already dead incarnation, whose news is dropped)."""
        if self.current.get(worker) != incarnation or (worker, incarnation) in self._dead:
            return None
        self._dead.add((worker, incarnation))
        self._last_seen.pop(worker, None)
        return Died(worker, incarnation, 0.0, cause)

    def deaths(self) -> list[Died]:
        """Incarnations silent for ``dead_after_s`` since they last spoke, each reported
        once (they are dead from now on)."""
        now = self.clock()
        died = []
        for worker, seen in list(self._last_seen.items()):
            if now - seen >= self.dead_after_s:
                incarnation = self.current[worker]
                self._dead.add((worker, incarnation))
                del self._last_seen[worker]
                died.append(Died(worker, incarnation, now - seen))
        return died

    def next_death_in(self) -> float | None:
        """Seconds until the next incarnation would be reported dead, if it stays silent
        (None: none is watched); a hub waits no longer than this."""
        if not self._last_seen:
            return None
        return max(0.0, min(self._last_seen.values()) + self.dead_after_s - self.clock())


class Hub(Protocol):
    """The router's end (module docstring of ``channel``). Every method but ``wake`` is
    called from one thread."""

    def attach(self, worker: str, incarnation: int) -> Endpoint: ...

    def detach(self, worker: str) -> None: ...

    def send(self, worker: str, command: Command) -> None: ...

    def receive(self, timeout_s: float) -> list[Message | Died | Stale]:
        """What arrived, in order per worker, deaths and stale incarnations heard; waits up
        to ``timeout_s`` seconds for the first item, or until ``wake``."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class Port(Protocol):
    """A worker's end: ``take`` and ``send`` run on the worker loop's thread, no hand-off on a
    request's path; the port's own thread beats the heartbeat."""

    def take(self, timeout_s: float) -> Taken:
        """What arrived (the abort rule applied); waits up to ``timeout_s`` seconds for the
        first command, or until ``wake``; at once, empty-handed, once closed."""
        ...

    @property
    def arrived(self) -> int:
        """Commands received so far (taken or not)."""
        ...

    def send(self, body: Any) -> None:
        """One message, numbered in the order sent; dropped after ``close``."""
        ...

    @property
    def open(self) -> bool:
        """False once closed or failed: ``take`` no longer waits."""
        ...

    def wake(self) -> None:
        """End a waiting ``take`` (or the next one) at once; any thread."""
        ...

    def close(self) -> None: ...
