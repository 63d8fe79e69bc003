"""What the two socket ports share (``channel.sockets.SocketPort``, ``channel.unix.UnixPort``):
the inbox and its abort rule, ``take`` and ``send`` on the caller's thread, the heartbeat
thread, failure, dropping what cannot be decoded or encoded, and closing. A transport supplies
``_wait``, ``_receive``, ``_send_message``, ``_beat``, ``_report_failure`` and
``_close_transport``; ``_io`` guards the writes of the loop and the heartbeat thread."""

from __future__ import annotations

import logging
import threading
from typing import Any

from channel import wire
from channel.contract import Command, Endpoint, Inbox, Taken
from channel.wake import WakePipe


class WorkerPort:
    """``channel.contract.Port`` minus its transport (module docstring).

    Attributes:
        error: why the port failed (None while it works, and after a plain ``close``): its
            hub has been told (best effort), ``take`` returns at once, ``send`` drops.
        dropped: commands that could not be decoded and messages that could not be encoded.
    """

    SOCKET_ERRORS: tuple[type[BaseException], ...] = (OSError,)  # a write that fails the port

    def __init__(self, endpoint: Endpoint, logger: logging.Logger) -> None:
        self.endpoint = endpoint
        self._log = logger
        self._inbox = Inbox()
        self._io = threading.Lock()  # the transport's writes (and reads, where it says so)
        self._taking = threading.Lock()  # held through a take: close waits it out
        self._wake = WakePipe()
        self._stopping = threading.Event()
        self._closed = False
        self._seq = 0
        self.error: str | None = None
        self.dropped = 0

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{self.endpoint.worker}-heartbeat")
        self._thread.start()

    # ---- the caller's thread (the worker's loop) ------------------------------------------
    def take(self, timeout_s: float) -> Taken:
        with self._taking:
            if not self._stopping.is_set():
                self._wait(timeout_s)
                self._receive()
            return self._inbox.take(0)

    @property
    def arrived(self) -> int:
        with self._taking:  # (a read beside a waiting take could eat the wake-up it waits on)
            if not self._stopping.is_set():
                self._receive()
        return self._inbox.arrived

    @property
    def open(self) -> bool:
        return not self._stopping.is_set()

    def wake(self) -> None:
        self._wake.poke()

    def send(self, body: Any) -> None:
        """Encode ``body`` and write it (never blocks); one that cannot be encoded is logged
        and dropped, its number reused."""
        try:
            data = wire.encode(body)
        except Exception as err:
            self._drop(f"message {self._seq} (not sent, its number reused): {err!r}")
            return
        with self._io:
            if self._stopping.is_set():
                return
            try:
                self._send_message(self._seq, data)
            except self.SOCKET_ERRORS as err:
                self._fail(err)
                return
            self._seq += 1

    def _decode(self, data: bytes) -> Command | None:
        """A command off the wire, or None: logged and dropped as undecodable."""
        try:
            return wire.decode_command(data)
        except Exception as err:
            self._drop(f"a command of {len(data)} bytes: {err!r}")
            return None

    def _drop(self, what: str) -> None:
        self.dropped += 1
        self._log.error("channel port of %s incarnation %d: dropped %s", self.endpoint.worker,
                        self.endpoint.incarnation, what)

    def _fail(self, err: BaseException) -> None:
        """The port is broken: the heartbeat thread tells the hub (best effort) and stops;
        a waiting ``take`` returns."""
        if self.error is None:
            self.error = f"{type(err).__name__}: {err}"
            self._log.error("channel port of %s incarnation %d failed: %s",
                            self.endpoint.worker, self.endpoint.incarnation, self.error)
        self._stopping.set()
        self._inbox.close()
        self._wake.poke()

    # ---- the heartbeat thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.wait(self.endpoint.heartbeat_s):
                self._beat()
        except Exception as err:  # the socket (or this thread) is broken: the port is dead
            self._fail(err)
        if self.error is not None:
            try:  # best effort: the hub hears the cause now, not after the silence
                self._report_failure(wire.encode(f"its channel port failed: {self.error}"))
            except Exception:
                pass

    def close(self) -> None:
        """Stop: what was sent leaves (bounded), then nothing more, heartbeats included."""
        self._stopping.set()
        self._wake.poke()
        with self._taking, self._io:  # a take in progress returns first (woken above)
            if self._closed:
                return
            self._closed = True
        self._inbox.close()
        self._thread.join(timeout=5)
        self._close_transport()

    # ---- the transport's part ---------------------------------------------------------------
    def _wait(self, timeout_s: float) -> None:
        """Until a command may be read, a ``wake``, a failure or ``timeout_s`` seconds."""
        raise NotImplementedError

    def _receive(self) -> None:
        """Move every command that reached the transport into the inbox (the abort rule)."""
        raise NotImplementedError

    def _send_message(self, seq: int, body: bytes) -> None:
        """Write message ``seq`` (under ``_io``); raises one of ``SOCKET_ERRORS``."""
        raise NotImplementedError

    def _beat(self) -> None:
        raise NotImplementedError

    def _report_failure(self, body: bytes) -> None:
        """Send ``PORT_FAILED`` with ``body`` (the heartbeat thread, after a failure)."""
        raise NotImplementedError

    def _close_transport(self) -> None:
        """After the heartbeat thread ended (or 5 s): close the sockets."""
        raise NotImplementedError
