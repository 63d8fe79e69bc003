"""Opening a worker's end of the channel from the ``Endpoint`` its hub attached: the
in-process port where a ``LocalHub`` of this process made it, else the pyzmq one."""

from __future__ import annotations

from collections.abc import Callable

from channel.contract import Endpoint, Port
from channel.local import open_local_port
from channel.sockets import SocketPort


def open_port(endpoint: Endpoint, on_arrival: Callable[[], None] | None = None) -> Port:
    """The port of ``endpoint``; ``on_arrival()`` runs after each command reaches it.
    KeyError for a local endpoint whose hub is not in this process (or closed)."""
    if endpoint.messages.startswith("local:"):
        return open_local_port(endpoint, on_arrival)
    return SocketPort(endpoint, on_arrival)
