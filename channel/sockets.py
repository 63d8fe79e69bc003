"""The channel over pyzmq: ``ipc`` within a node, ``tcp`` across nodes, ``channel.wire``
(msgpack) on the wire.

- The hub binds one PULL socket that every port's PUSH connects to: two frames each, the
  header ``[worker, incarnation, seq]`` and the body, decoded apart (a bad body is logged
  with its sender); ``seq`` ``HEARTBEAT`` or ``PORT_FAILED`` (body: the port's failure).
- Per attached incarnation the hub binds a PUSH socket for its port's PULL (commands, each
  ``[kind, request_id, args]``); commands sent before the port connects wait in the hub, in
  order, and leave when the poller says the socket can take them.

A port reads and decodes commands and encodes and sends messages on its caller's thread (the
worker's loop), handing each to libzmq, whose I/O thread does the socket work: a hand-off to a
thread of the port's own would cost a wake-up each way (benchmarks/hop_latency.py measures it).
The loop waits for commands in ``take`` (``wait_fds`` over the socket and a wake-up pipe). The
port's own thread only beats the heartbeat, on a socket of its own. A command that cannot be
decoded, or a message that cannot be encoded, is logged and dropped; a socket error fails the
port: the heartbeat thread reports it to the hub (``PORT_FAILED``, best effort) and stops, and
``SocketPort.error`` says why. The hub has no thread: ``receive`` waits on a ``zmq.Poller``
over its sockets and a wake-up pipe (``wake``), never on a time slice.
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import time
from collections.abc import Callable

import zmq

from channel import wire
from channel.wake import WakePipe, wait_fds
from channel.wire import HEARTBEAT, PORT_FAILED
from channel.worker_port import WorkerPort
from channel.contract import (DEAD_AFTER_S, HEARTBEAT_S, Command, Died, Endpoint, Liveness,
                              Message, Stale)

TRANSPORTS = ("ipc", "tcp")
_LOG = logging.getLogger(__name__)


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
        self._wake = WakePipe()
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


class SocketPort(WorkerPort):
    """``channel.contract.Port`` over pyzmq: opened in the worker's process with the
    ``Endpoint`` its hub's ``attach`` returned (module docstring; what it shares with the Unix
    port: ``channel.worker_port``). Its heartbeat thread starts at once; the first heartbeat
    leaves before the constructor returns. ``_io`` guards the command and message sockets."""

    SOCKET_ERRORS = (zmq.ZMQError,)

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint, _LOG)
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PULL)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(endpoint.commands)
        self._commands_fd = self._commands.getsockopt(zmq.FD)
        self._messages = self._connect_out(endpoint.messages)
        self._beats = self._connect_out(endpoint.messages)  # the heartbeat thread's own
        # heard from now on (a connecting PUSH queues it); on the message socket, so that it
        # arrives before the port's first message, as its first heartbeat does on one stream
        self._send(self._messages, HEARTBEAT, b"")
        self._start_heartbeat()

    def _connect_out(self, address: str) -> zmq.Socket:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)  # never full: a send never blocks the loop
        socket.setsockopt(zmq.LINGER, 1000)  # close: what was sent still leaves
        socket.connect(address)
        return socket

    # ---- the caller's thread (the worker's loop) ------------------------------------------
    def _send_message(self, seq: int, body: bytes) -> None:
        self._send(self._messages, seq, body)  # libzmq's I/O thread writes it

    def _wait(self, timeout_s: float) -> None:
        """Until a command can be read, a ``wake``, a failure or ``timeout_s`` seconds:
        ``wait_fds`` (a ``zmq.Poller`` waits whole ms), ``EVENTS`` read
        before each wait (libzmq's descriptor only says "look again")."""
        deadline_s = time.monotonic() + timeout_s
        while not len(self._inbox):
            with self._io:
                if self._stopping.is_set() or self._readable():
                    return
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return
            ready, _ = wait_fds([self._commands_fd, self._wake.read_fd], [], left_s)
            if self._wake.read_fd in ready:
                self._wake.drain()
                return

    def _readable(self) -> bool:
        try:
            return bool(self._commands.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError as err:
            self._fail(err)
            return False

    def _receive(self) -> None:
        with self._io:
            while not self._stopping.is_set() and self._readable():
                try:
                    data = self._commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                except zmq.ZMQError as err:
                    self._fail(err)
                    return
                command = self._decode(data)
                if command is not None:
                    self._inbox.put(command)

    # ---- the heartbeat thread ---------------------------------------------------------------
    def _send(self, socket: zmq.Socket, seq: int, body: bytes) -> None:
        header = wire.encode((self.endpoint.worker, self.endpoint.incarnation, seq))
        socket.send_multipart((header, body))

    def _beat(self) -> None:
        self._send(self._beats, HEARTBEAT, b"")

    def _report_failure(self, body: bytes) -> None:
        self._send(self._beats, PORT_FAILED, body)

    def _run(self) -> None:
        super()._run()
        self._beats.close()  # lingers until what was sent has left

    def _close_transport(self) -> None:
        self._commands.close()
        self._messages.close()
        if not self._thread.is_alive():  # (else its socket is open: term would wait on it)
            self._ctx.term()
            self._wake.close()
