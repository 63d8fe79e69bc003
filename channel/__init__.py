"""The message plane: one channel per worker carries commands in and step outputs out (Ray or
the local mode places and watches workers; ``kv_transfer`` carries the KV bytes).

``channel.contract`` states the contract: the router's ``Hub`` (``attach``, ``send``,
``receive``, ``wake``) and a worker's ``Port`` (``take``, ``send``, its own heartbeat).
``channel.local`` (queues in one process), ``channel.unix`` (msgpack over Unix-domain sockets:
a deployment's workers on its own node) and ``channel.sockets`` (msgpack over pyzmq, ``tcp``
across nodes; ``ipc`` too) pass the same contract tests. Only ``sockets`` loads pyzmq, and
``wire`` msgpack, so the router imports ``channel.contract`` and ``channel.local`` alone.
"""
