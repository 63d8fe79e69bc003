"""The message plane: one channel per worker carries commands in and step outputs out; Ray (or
the local mode) places, starts and watches workers, and ``kv_transfer`` carries the KV bytes.

The contract (``channel.contract``) has two ends. ``Hub``, the router's, used by one thread:
``attach`` a worker incarnation (returning the ``Endpoint`` it opens its ``Port`` with),
``send`` it commands, ``receive`` what all workers sent and their deaths (woken by the sockets,
or by ``wake`` from any thread). ``Port``, a worker's: ``take`` the commands that arrived,
``send`` one message per engine step, heartbeat from its own thread.

``channel.local`` (queues in one process) and ``channel.sockets`` (msgpack over pyzmq, ``ipc``
within a node, ``tcp`` across) pass the same contract tests. Only ``sockets`` and ``wire`` load
pyzmq and msgpack, so the router imports ``channel.contract`` and ``channel.local`` (its
default hub) alone.
"""
