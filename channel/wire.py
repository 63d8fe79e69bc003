"""The channel's wire format: msgpack, with pickle for the values msgpack has no type for.

Plain values (None, bools, ints, floats, str, bytes, lists, tuples, dicts) travel as
msgpack; arrays come back as tuples. Anything else (a ``Request``, a ``WorkerEvent``, a
KV handle) travels as a msgpack extension of type ``PICKLED`` holding its pickle, as
vLLM's engine-core messages do. A peer is trusted as a Ray peer is: bind ``tcp``
channels only on the cluster's own network.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack

PICKLED = 1  # msgpack extension type: the value's pickle


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
    """The value ``encode`` made ``data`` from (arrays as tuples).

    Raises:
        ValueError: ``data`` is not a whole message (msgpack's ``ExtraData``, ``FormatError``
            and ``StackError`` are ValueErrors).
    """
    return msgpack.unpackb(data, ext_hook=_ext_hook, use_list=False, raw=False,
                           strict_map_key=False)
