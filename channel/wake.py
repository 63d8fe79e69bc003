"""Waking a waiting thread: ``WakePipe``, a pipe whose read end a poller watches (``select``,
``zmq.Poller``, ``selectors``), so that ``poke`` from any thread ends its wait; ``wait_fds``,
the wait itself on plain descriptors."""

from __future__ import annotations

import math
import os
import select
import threading

SELECT_LIMIT = 1024  # FD_SETSIZE: select(2) refuses a descriptor at or above it


def wait_fds(readers: list[int], writers: list[int],
             timeout_s: float) -> tuple[set[int], set[int]]:
    """Which of ``readers`` are readable and of ``writers`` writable (a hang-up or an error
    counts as both), after up to ``timeout_s`` seconds: select(2), to the microsecond, or
    poll(2), to the millisecond rounded up, where a descriptor is past ``SELECT_LIMIT``."""
    if max(readers + writers) < SELECT_LIMIT:
        readable, writable, _ = select.select(readers, writers, [], timeout_s)
        return set(readable), set(writable)
    poller, flags = select.poll(), {}
    for fd in readers:
        flags[fd] = flags.get(fd, 0) | select.POLLIN
    for fd in writers:
        flags[fd] = flags.get(fd, 0) | select.POLLOUT
    for fd, mask in flags.items():
        poller.register(fd, mask)
    broken = select.POLLHUP | select.POLLERR | select.POLLNVAL
    events = poller.poll(math.ceil(max(0.0, timeout_s) * 1000))
    return ({fd for fd, ev in events if fd in readers and ev & (select.POLLIN | broken)},
            {fd for fd, ev in events if fd in writers and ev & (select.POLLOUT | broken)})


class WakePipe:
    """``poke`` (any thread) makes ``read_fd`` readable until ``drain``."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        # poke and close take turns: a closed descriptor's number may already be another file's
        self._lock = threading.Lock()
        self._closed = False

    def poke(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except OSError:  # full: a wake-up is pending anyway
                pass

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.read_fd, self._write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
