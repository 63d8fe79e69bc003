"""The channel's wire format: msgpack, with pickle for the values msgpack has no type for.

Plain values (None, bools, ints, floats, str, bytes, lists, tuples, dicts) travel as msgpack,
arrays coming back as tuples; anything else (a ``Request``, a KV handle) as a ``PICKLED``
extension holding its pickle, as vLLM's engine-core messages do. Peers are trusted as Ray
peers are: bind ``tcp`` channels only on the cluster's own network.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack

from channel.contract import Command

PICKLED = 1  # msgpack extension type: the value's pickle
HEARTBEAT, PORT_FAILED = -1, -2  # a port's message seq of a heartbeat, of its failure report


def _default(value: Any) -> msgpack.ExtType:
    return msgpack.ExtType(PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == PICKLED:
        return pickle.loads(data)
    return msgpack.ExtType(code, data)


def encode(value: Any) -> bytes:
    """``value`` as bytes (module docstring)."""
    return msgpack.packb(value, default=_default, use_bin_type=True)


def decode(data: bytes | memoryview) -> Any:
    """The value ``encode`` made ``data`` from (arrays as tuples); ValueError (msgpack's
    ``ExtraData``, ``FormatError``, ``StackError``) when ``data`` is not a whole message."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False, raw=False,
                           strict_map_key=False)


def decode_command(data: bytes | memoryview) -> Command:
    """A hub's command off the wire, ``[kind, request_id, args]``: a str, a hashable value (the
    abort rule indexes by it), a tuple. Raises ValueError (or what ``decode`` raises): ``data``
    is no such command."""
    kind, request_id, args = decode(data)
    if not (isinstance(kind, str) and _hashable(request_id) and isinstance(args, tuple)):
        raise ValueError(f"({kind!r}, {request_id!r}, {args!r}) is not [kind, request_id, args]")
    return Command(kind, request_id, args)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
