"""Opening a worker's end of the channel from the ``Endpoint`` its hub attached: the
in-process port where a ``LocalHub`` of this process made it, the Unix-socket one of a
``UnixHub``, else the pyzmq one."""

from __future__ import annotations

from channel.contract import Endpoint, Port
from channel.local import open_local_port
from channel.sockets import SocketPort
from channel.unix import SCHEME, UnixPort


def open_port(endpoint: Endpoint) -> Port:
    """The port of ``endpoint``; KeyError for a local endpoint whose hub is not in this
    process (or closed)."""
    if endpoint.messages.startswith("local:"):
        return open_local_port(endpoint)
    if endpoint.messages.startswith(SCHEME):
        return UnixPort(endpoint)
    return SocketPort(endpoint)
