"""The channel over Unix-domain stream sockets, for workers on the router's node: each side
writes its frames straight into the other's socket from its own thread, so a hop wakes one
thread (pyzmq's ``ipc`` wakes three: the sender's I/O thread, the receiver's, the receiver;
``benchmarks/hop_latency.py`` measures both).

- A frame is a 4-byte little-endian length and that many bytes. The hub listens on one
  socket; a port connects and its first frame says who it is (``channel.wire``:
  ``[worker, incarnation]``); then each of its frames is an 8-byte ``seq`` and the body
  (``HEARTBEAT``, ``PORT_FAILED``: as in ``channel.sockets``), and each of the hub's is a
  command, ``[kind, request_id, args]``.
- Neither side blocks on a full socket: what it cannot take yet waits, in order, and leaves
  at the next write, the hub's next turn, a port's next ``take`` or heartbeat (a heartbeat is
  skipped while bytes wait: they speak for the port). Commands sent before the incarnation
  attached last has connected wait in the hub.
- A connection that breaks the framing (or says hello wrongly) is logged and closed; a body
  that cannot be decoded is logged and dropped, as in ``channel.sockets``.
"""

from __future__ import annotations

import logging
import selectors
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable

from channel import wire
from channel.contract import (DEAD_AFTER_S, HEARTBEAT_S, Command, Died, Endpoint, Liveness,
                              Message, Stale)
from channel.wake import WakePipe, wait_fds
from channel.wire import HEARTBEAT, PORT_FAILED
from channel.worker_port import WorkerPort

SCHEME = "unix://"
MAX_FRAME = 1 << 30  # a longer length means a broken stream, not a message (bytes)
_LENGTH, _SEQ = struct.Struct("<I"), struct.Struct("<q")
_LOG = logging.getLogger(__name__)


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class Frames:
    """Bytes read from a stream, cut into frames (``feed`` -> the whole ones).

    Raises (from ``feed``):
        ValueError: a length over ``MAX_FRAME``: the stream is broken."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames, start, size = [], 0, len(self._buffer)
        while size - start >= 4:
            (length,) = _LENGTH.unpack_from(self._buffer, start)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME})")
            if size - start - 4 < length:
                break
            frames.append(bytes(self._buffer[start + 4:start + 4 + length]))
            start += 4 + length
        del self._buffer[:start]
        return frames


class _Connection:
    """One port's connection, as the hub sees it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = Frames()
        self.sender: tuple[str, int] | None = None  # (worker, incarnation) once it said hello
        self.out = bytearray()  # commands the socket could not take yet
        self.writing = False  # registered for EVENT_WRITE (out was left over)


class UnixHub:
    """``channel.contract.Hub`` over Unix-domain sockets (module docstring).

    Args:
        dead_after_s: silence after which an incarnation is reported dead (seconds).
        heartbeat_s: the heartbeat period its ports get (seconds).
        clock: monotonic seconds.
    """

    def __init__(self, dead_after_s: float = DEAD_AFTER_S, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(dead_after_s, clock)
        self._dir = tempfile.mkdtemp(prefix="pdlab-ch-")
        self.address = f"{SCHEME}{self._dir}/hub"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address[len(SCHEME):])
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake = WakePipe()
        self._selector.register(self._wake.read_fd, selectors.EVENT_READ)
        self._current: dict[str, _Connection] = {}  # worker -> its attached incarnation's
        self._waiting: dict[str, bytearray] = {}  # worker -> commands before it connected
        self._closed = False
        # (worker, incarnation) -> messages dropped as undecodable (("?", -1): no hello)
        self.undecodable: dict[tuple[str, int], int] = {}

    @property
    def stale(self) -> dict[tuple[str, int], int]:
        return self.liveness.stale

    def attach(self, worker: str, incarnation: int) -> Endpoint:
        self.liveness.attach(worker, incarnation)
        self._current.pop(worker, None)
        self._waiting[worker] = bytearray()
        return Endpoint(worker, incarnation, self.address, self.address, self.heartbeat_s)

    def detach(self, worker: str) -> None:
        self.liveness.detach(worker)
        self._waiting.pop(worker, None)
        connection = self._current.pop(worker, None)
        if connection is not None:
            self._close(connection)

    def send(self, worker: str, command: Command) -> None:
        data = frame(wire.encode((command.kind, command.request_id, command.args)))
        connection = self._current.get(worker)
        if connection is None:
            waiting = self._waiting.get(worker)
            if waiting is not None:  # (a detached worker hears nothing more)
                waiting += data
            return
        connection.out += data
        self._write(connection)

    def _write(self, connection: _Connection) -> None:
        """Write what the socket takes now; wait for it to take the rest (or close it)."""
        try:
            sent = connection.sock.send(connection.out)
        except BlockingIOError:
            sent = 0
        except OSError:  # gone: its death is heard as silence, its port's report or Ray's
            self._close(connection)
            return
        del connection.out[:sent]
        writing = bool(connection.out)
        if writing != connection.writing:  # (an epoll_ctl only when the interest changes)
            connection.writing = writing
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            self._selector.modify(connection.sock, events, connection)

    def receive(self, timeout_s: float) -> list[Message | Died | Stale]:
        next_death = self.liveness.next_death_in()
        wait_s = timeout_s if next_death is None else min(timeout_s, next_death)
        out: list[Message | Died | Stale] = []
        for key, events in self._selector.select(max(0.0, wait_s)):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj == self._wake.read_fd:
                self._wake.drain()
            else:
                if events & selectors.EVENT_WRITE:
                    self._write(key.data)
                if events & selectors.EVENT_READ:
                    self._read(key.data, out)
        out.extend(self.liveness.deaths())
        out.extend(self.liveness.strays())
        return out

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _read(self, connection: _Connection, out: list) -> None:
        """Everything the socket holds now, frame by frame (everything: no queued heartbeat
        is mistaken for silence)."""
        while True:
            try:
                data = connection.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the port closed (or its process died)
                self._close(connection)
                return
            try:
                frames = connection.frames.feed(data)
            except ValueError as err:
                self._broken(connection, str(err))
                return
            for payload in frames:
                if connection.sender is None:
                    if not self._hello(connection, payload):
                        return
                    continue
                item = self._decode(connection.sender, payload)
                if item is not None:
                    out.append(item)

    def _hello(self, connection: _Connection, payload: bytes) -> bool:
        try:
            worker, incarnation = wire.decode(payload)
            if not (isinstance(worker, str) and isinstance(incarnation, int)):
                raise ValueError(f"({worker!r}, {incarnation!r}) is not [worker, incarnation]")
        except Exception as err:
            self._broken(connection, f"a hello that says nobody: {err!r}")
            return False
        connection.sender = (worker, incarnation)
        if worker in self._waiting and self.liveness.current.get(worker) == incarnation:
            self._current[worker] = connection
            connection.out += self._waiting.pop(worker)
            self._waiting[worker] = bytearray()  # (unused while it is connected)
            self._write(connection)
        return True

    def _decode(self, sender: tuple[str, int], payload: bytes) -> Message | Died | None:
        """A ``Message``, a port's ``Died`` report, or None (a heartbeat, stale news, or
        undecodable: logged, dropped, counted in ``undecodable``)."""
        worker, incarnation = sender
        if len(payload) < _SEQ.size:
            self._drop_message(sender, f"a frame of {len(payload)} bytes from {worker} "
                                       f"incarnation {incarnation}: no seq")
            return None
        (seq,) = _SEQ.unpack_from(payload)
        if not self.liveness.heard(worker, incarnation) or seq == HEARTBEAT:
            return None
        try:
            body = wire.decode(memoryview(payload)[_SEQ.size:])
        except Exception as err:
            self._drop_message(sender, f"message {seq} of {worker} incarnation {incarnation}: "
                                       f"{err!r}")
            return None
        if seq == PORT_FAILED:
            return self.liveness.failed(worker, incarnation, str(body))
        return Message(worker, incarnation, seq, body)

    def _drop_message(self, sender: tuple[str, int], what: str) -> None:
        self.undecodable[sender] = self.undecodable.get(sender, 0) + 1
        _LOG.error("channel hub: dropped %s", what)

    def _broken(self, connection: _Connection, why: str) -> None:
        self._drop_message(connection.sender or ("?", -1), f"a connection: {why}")
        self._close(connection)

    def _close(self, connection: _Connection) -> None:
        worker = connection.sender and connection.sender[0]
        if worker is not None and self._current.get(worker) is connection:
            del self._current[worker]
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

    def wake(self) -> None:
        self._wake.poke()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Connection):
                self._close(key.data)
        self._selector.close()
        self._listener.close()
        self._wake.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class UnixPort(WorkerPort):
    """``channel.contract.Port`` of a ``UnixHub``: opened in the worker's process with the
    ``Endpoint`` its hub's ``attach`` returned (what it shares with the pyzmq port:
    ``channel.worker_port``); the heartbeat thread starts at once (the hello and the first
    heartbeat leave before the constructor returns). ``_io`` guards the writes.

    Raises:
        OSError: the hub cannot be reached.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(endpoint, _LOG)
        self._frames = Frames()
        self._unsent = bytearray()  # what the socket could not take yet
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(endpoint.messages[len(SCHEME):])
            self._sock.setblocking(False)
            self._write(frame(wire.encode((endpoint.worker, endpoint.incarnation))))
            self._beat()  # heard from now on
        except OSError:
            self._sock.close()
            self._wake.close()
            raise
        self._start_heartbeat()

    # ---- the caller's thread (the worker's loop) ------------------------------------------
    def _send_message(self, seq: int, body: bytes) -> None:
        self._write(frame(_SEQ.pack(seq) + body))

    def _write(self, data: bytes = b"") -> None:
        """Queue ``data`` behind what waits and write what the socket takes now (under
        ``_io``). Raises OSError: the socket is broken."""
        self._unsent += data
        while self._unsent:
            try:
                sent = self._sock.send(self._unsent)
            except (BlockingIOError, InterruptedError):
                return
            del self._unsent[:sent]

    def _wait(self, timeout_s: float) -> None:
        """Until the socket has bytes, a ``wake``, or ``timeout_s`` seconds (``wait_fds``);
        writes what waits once the socket takes it."""
        if len(self._inbox) or timeout_s <= 0:
            return
        sock = self._sock.fileno()
        ready, writable = wait_fds([sock, self._wake.read_fd], [sock] if self._unsent else [],
                                   timeout_s)
        if self._wake.read_fd in ready:
            self._wake.drain()
        if writable:
            with self._io:
                try:
                    self._write()
                except OSError as err:
                    self._fail(err)

    def _receive(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._fail(err)
                return
            if not data:
                self._fail(ConnectionError("the hub closed the channel"))
                return
            try:
                frames = self._frames.feed(data)
            except ValueError as err:
                self._fail(err)
                return
            for payload in frames:
                command = self._decode(payload)
                if command is not None:
                    self._inbox.put(command)

    # ---- the heartbeat thread ---------------------------------------------------------------
    def _beat(self) -> None:
        with self._io:
            self._write(b"" if self._unsent else frame(_SEQ.pack(HEARTBEAT)))

    def _report_failure(self, body: bytes) -> None:
        with self._io:
            self._write(frame(_SEQ.pack(PORT_FAILED) + body))

    def _close_transport(self) -> None:
        """What waits leaves (up to 1 s for the socket to take it), then the socket closes."""
        deadline_s = time.monotonic() + 1.0
        try:
            while self._unsent and wait_fds([], [self._sock.fileno()], max(
                    0.0, deadline_s - time.monotonic()))[1]:
                self._write()
        except OSError:
            pass
        self._sock.close()
        if not self._thread.is_alive():
            self._wake.close()
