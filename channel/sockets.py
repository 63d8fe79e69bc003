"""The channel over pyzmq: ``ipc`` within a node, ``tcp`` across nodes, ``channel.wire``
(msgpack) on the wire.

- The hub binds one PULL socket that every port's PUSH connects to: two frames each, the
  header ``[worker, incarnation, seq]`` and the body, decoded apart (a bad body is logged
  with its sender); ``seq`` ``HEARTBEAT`` or ``PORT_FAILED`` (body: the port's failure).
- Per attached incarnation the hub binds a PUSH socket for its port's PULL (commands, each
  ``[kind, request_id, args]``); commands sent before the port connects wait in the hub, in
  order, and leave when the poller says the socket can take them.

A port has one thread of its own (beside libzmq's I/O thread): it decodes commands into the
worker's ``Inbox``, encodes and sends the worker's messages and beats the heartbeat, so neither
it nor the engine step waits for the other. A command it cannot decode, or a message it cannot
encode, is logged and dropped; any other error ends the thread, which reports it to the hub
(``PORT_FAILED``, best effort) and sets ``SocketPort.error``. The hub has no thread:
``receive`` waits on a ``zmq.Poller`` over its sockets and a wake-up pipe (``wake``), never on
a time slice.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from channel import wire
from channel.contract import (DEAD_AFTER_S, HEARTBEAT_S, Command, Died, Endpoint, Inbox,
                              InboxPort, Liveness, Message, Stale)

TRANSPORTS = ("ipc", "tcp")
HEARTBEAT, PORT_FAILED = -1, -2  # header seq of a heartbeat, of a port's failure report
_LOG = logging.getLogger(__name__)


class _WakePipe:
    """A pipe that a ``zmq.Poller`` watches: ``poke`` from any thread wakes it."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._closed = False

    def poke(self) -> None:
        if self._closed:  # a closed descriptor's number may already belong to another file
            return
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: moot
            pass

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class SocketHub:
    """``channel.contract.Hub`` over pyzmq (module docstring).

    Args:
        transport: ``ipc`` (every worker on this node) or ``tcp`` (any node).
        host: the address ``tcp`` ports connect to (this node's, reachable from the others).
        dead_after_s: silence after which an incarnation is reported dead (seconds).
        heartbeat_s: the heartbeat period its ports get (seconds).
        clock: monotonic seconds.

    Raises:
        ValueError: an unknown transport.
    """

    def __init__(self, transport: str = "ipc", host: str = "127.0.0.1",
                 dead_after_s: float = DEAD_AFTER_S, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"channel transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport, self.host = transport, host
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(dead_after_s, clock)
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="pdlab-ch-") if transport == "ipc" else None
        self._in = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self.address = self._bind(self._in, "in")
        self._out: dict[str, zmq.Socket] = {}  # worker -> PUSH of its current incarnation
        self._waiting: dict[str, collections.deque[bytes]] = {}  # commands its port cannot take yet
        self._wake = _WakePipe()
        self._poller = zmq.Poller()
        self._poller.register(self._in, zmq.POLLIN)
        self._poller.register(self._wake.read_fd, zmq.POLLIN)
        self._closed = False
        # (worker, incarnation) -> messages dropped as undecodable (("?", -1): no header)
        self.undecodable: dict[tuple[str, int], int] = {}

    @property
    def stale(self) -> dict[tuple[str, int], int]:
        return self.liveness.stale

    def _bind(self, socket: zmq.Socket, name: str) -> str:
        if self._dir is not None:
            address = f"ipc://{self._dir}/{name}"
            socket.bind(address)
            return address
        port = socket.bind_to_random_port("tcp://*")
        return f"tcp://{self.host}:{port}"

    def attach(self, worker: str, incarnation: int) -> Endpoint:
        self.liveness.attach(worker, incarnation)
        self._drop(worker)
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        address = self._bind(out, f"{len(self._out)}-{worker}-{incarnation}")
        self._out[worker] = out
        return Endpoint(worker, incarnation, address, self.address, self.heartbeat_s)

    def detach(self, worker: str) -> None:
        self.liveness.detach(worker)
        self._drop(worker)

    def _drop(self, worker: str) -> None:
        out = self._out.pop(worker, None)
        if out is not None:
            if worker in self._waiting:
                self._poller.unregister(out)
                del self._waiting[worker]
            out.close()

    def send(self, worker: str, command: Command) -> None:
        out = self._out.get(worker)
        if out is None:  # a detached worker hears nothing more
            return
        data = wire.encode((command.kind, command.request_id, command.args))
        waiting = self._waiting.get(worker)
        if waiting is None:
            try:
                out.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # its port has not connected yet: keep it, in order
                waiting = self._waiting[worker] = collections.deque()
                self._poller.register(out, zmq.POLLOUT)
        waiting.append(data)
        self._flush(worker)

    def _flush(self, worker: str) -> None:
        out, waiting = self._out[worker], self._waiting[worker]
        try:
            while waiting:
                out.send(waiting[0], zmq.NOBLOCK)
                waiting.popleft()
        except zmq.Again:
            return
        self._poller.unregister(out)
        del self._waiting[worker]

    def receive(self, timeout_s: float) -> list[Message | Died]:
        next_death = self.liveness.next_death_in()
        wait_s = timeout_s if next_death is None else min(timeout_s, next_death)
        ready = dict(self._poller.poll(max(0, int(wait_s * 1000 + 0.999))))
        if self._wake.read_fd in ready:
            self._wake.drain()
        for worker in [w for w, out in list(self._out.items()) if w in self._waiting
                       and ready.get(out, 0) & zmq.POLLOUT]:
            self._flush(worker)
        out: list[Message | Died | Stale] = []
        # everything queued, so that no queued heartbeat is mistaken for silence
        while self._in.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            item = self._decode(self._in.recv_multipart())
            if item is not None:
                out.append(item)
        out.extend(self.liveness.deaths())
        out.extend(self.liveness.strays())
        return out

    def _decode(self, frames: list[bytes]) -> Message | Died | None:
        """A ``Message``, a port's ``Died`` report, or None (a heartbeat, stale news, or
        undecodable: logged, dropped, counted in ``undecodable``)."""
        try:
            worker, incarnation, seq = wire.decode(frames[0])
            if not (isinstance(worker, str) and isinstance(incarnation, int)
                    and isinstance(seq, int) and len(frames) == 2):
                raise ValueError(f"a header of {len(frames)} frames ({worker!r}, "
                                 f"{incarnation!r}, {seq!r}) is not [worker, incarnation, seq]")
        except Exception as err:
            self._drop_message(("?", -1), f"a message from an unknown sender: {err!r}")
            return None
        if not self.liveness.heard(worker, incarnation):
            return None
        if seq == HEARTBEAT:
            return None
        try:
            body = wire.decode(frames[1])
        except Exception as err:
            self._drop_message((worker, incarnation), f"message {seq} of {worker} incarnation "
                                                       f"{incarnation}: {err!r}")
            return None
        if seq == PORT_FAILED:
            return self.liveness.failed(worker, incarnation, str(body))
        return Message(worker, incarnation, seq, body)

    def _drop_message(self, sender: tuple[str, int], what: str) -> None:
        self.undecodable[sender] = self.undecodable.get(sender, 0) + 1
        _LOG.error("channel hub: dropped %s", what)

    def wake(self) -> None:
        self._wake.poke()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for worker in list(self._out):
            self._drop(worker)
        self._in.close()
        self._ctx.term()
        self._wake.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class SocketPort(InboxPort):
    """``channel.contract.Port`` over pyzmq: opened in the worker's process with the
    ``Endpoint`` its hub's ``attach`` returned; ``on_arrival()`` runs after each command
    reaches the inbox (it wakes the worker's loop). Its thread (module docstring) starts at
    once; the first heartbeat leaves before the constructor returns.

    Attributes:
        error: why the port's thread stopped on an error (None while it runs, and after a
            plain ``close``); its hub has been told, its inbox is closed.
        dropped: commands that could not be decoded and messages that could not be encoded.
    """

    def __init__(self, endpoint: Endpoint, on_arrival: Callable[[], None] | None = None) -> None:
        self.endpoint = endpoint
        self._inbox = Inbox(on_arrival)  # on_arrival: called on the port's thread
        self._outbox: collections.deque[Any] = collections.deque()
        self._handed = threading.Condition()  # counts below: what flush waits on
        self._num_sent = self._num_handed = 0  # bodies given to send, handed to the socket
        self._wake = _WakePipe()
        self._stopping = threading.Event()
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PULL)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(endpoint.commands)
        self._messages = self._ctx.socket(zmq.PUSH)
        self._messages.setsockopt(zmq.LINGER, 1000)  # close: what was sent still leaves
        self._messages.connect(endpoint.messages)
        self._seq = 0
        self.error: str | None = None
        self.dropped = 0
        self._beat()  # heard from now on (a connecting PUSH queues it)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{endpoint.worker}-port")
        self._thread.start()

    def send(self, body: Any) -> None:
        """Hand ``body`` to the port's thread (encoded and sent there, in order); after
        ``close``, or once that thread stopped on an error (``error``: its hub was told the
        port died), ``body`` is dropped."""
        if not self._stopping.is_set():
            with self._handed:
                self._num_sent += 1
                self._outbox.append(body)
            self._wake.poke()

    def flush(self, timeout_s: float) -> bool:
        with self._handed:
            target = self._num_sent
            self._handed.wait_for(
                lambda: self._num_handed >= target or self._stopping.is_set(), timeout_s)
            return self._num_handed >= target  # a stopped port may have dropped it

    def _send(self, seq: int, body: bytes) -> None:
        header = wire.encode((self.endpoint.worker, self.endpoint.incarnation, seq))
        self._messages.send_multipart((header, body))

    def _beat(self) -> None:
        self._send(HEARTBEAT, b"")

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as err:  # the socket (or this thread) is broken: the port is dead
            self.error = f"{type(err).__name__}: {err}"
            _LOG.exception("channel port of %s incarnation %d failed", self.endpoint.worker,
                           self.endpoint.incarnation)
            try:  # best effort: the hub hears the cause now, not after the silence
                self._send(PORT_FAILED, wire.encode(f"its channel port failed: {self.error}"))
            except Exception:
                pass
        finally:
            self._stopping.set()  # nothing sends from here on: send() drops
            self._outbox.clear()
            with self._handed:  # a flush waiting on this thread returns
                self._handed.notify_all()
            self._inbox.close()
            self._commands.close()
            self._messages.close()  # lingers until what was sent has left
            self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._commands, zmq.POLLIN)
        poller.register(self._wake.read_fd, zmq.POLLIN)
        next_beat = time.monotonic() + self.endpoint.heartbeat_s
        while True:
            wait_ms = max(0, int((next_beat - time.monotonic()) * 1000 + 0.999))
            ready = dict(poller.poll(wait_ms))
            if self._commands in ready:
                while self._commands.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    command = self._decode(self._commands.recv())
                    if command is not None:
                        self._inbox.put(command)
            if self._wake.read_fd in ready:
                self._wake.drain()
            # read before draining: whatever was sent before close() leaves (a loop's last
            # words sent just before close included), nothing after it
            stopping = self._stopping.is_set()
            while self._outbox:
                body = self._outbox.popleft()
                try:
                    data = wire.encode(body)
                except Exception as err:
                    self._drop(f"message {self._seq} (not sent, its number reused): {err!r}")
                    data = None
                if data is not None:
                    self._send(self._seq, data)
                    self._seq += 1
                with self._handed:
                    self._num_handed += 1
                    self._handed.notify_all()
            if stopping:
                return
            if time.monotonic() >= next_beat:
                self._beat()
                next_beat = time.monotonic() + self.endpoint.heartbeat_s

    def _decode(self, data: bytes) -> Command | None:
        """A command off the wire, or None: logged and dropped as undecodable."""
        try:
            kind, request_id, args = wire.decode(data)
            if not (isinstance(kind, str) and isinstance(args, tuple)):
                raise ValueError(f"({kind!r}, {request_id!r}, {args!r}) is not "
                                 "[kind, request_id, args]")
        except Exception as err:
            self._drop(f"a command of {len(data)} bytes: {err!r}")
            return None
        return Command(kind, request_id, args)

    def _drop(self, what: str) -> None:
        self.dropped += 1
        _LOG.error("channel port of %s incarnation %d: dropped %s", self.endpoint.worker,
                   self.endpoint.incarnation, what)

    def close(self) -> None:
        """Stop: what was sent leaves (bounded), then nothing more, heartbeats included."""
        self._stopping.set()
        self._wake.poke()
        with self._handed:
            self._handed.notify_all()
        self._thread.join(timeout=5)
        self._inbox.close()
        if not self._thread.is_alive():
            self._wake.close()
