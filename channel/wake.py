"""``WakePipe``: a pipe whose read end a poller watches (``select``, ``zmq.Poller``,
``selectors``), so that ``poke`` from any thread ends its wait."""

from __future__ import annotations

import os


class WakePipe:
    """``poke`` (any thread) makes ``read_fd`` readable until ``drain``."""

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
