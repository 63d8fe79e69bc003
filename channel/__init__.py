"""The message plane: one channel per worker carries commands in and step outputs out.

Three planes, each with one job: Ray (or the local mode) places, starts, watches and
restarts workers; this channel carries what happens per request and per step; the KV
transports (``kv_transfer``) carry the KV bytes.

The contract (``channel.contract``), two ends:

- ``Hub``, the router's end, used by one thread (the router loop): ``attach`` a worker
  incarnation (returns the ``Endpoint`` that worker opens its ``Port`` with), ``send`` it
  commands, ``receive`` what all workers sent (waking on the sockets, or at once on
  ``wake`` from any thread), and hear of deaths there too.
- ``Port``, a worker's end: ``take`` the commands that arrived, ``send`` one message per
  engine step, and a heartbeat from the port's own thread.

Two implementations pass the same contract tests (tests/unit/test_channel.py):
``channel.local`` (queues in one process: tests and the local mode) and
``channel.sockets`` (msgpack over pyzmq: ``ipc`` within a node, ``tcp`` across nodes).
Only ``channel.sockets`` and ``channel.wire`` load pyzmq and msgpack, so the router, which
takes a ``Hub`` object, imports ``channel.contract`` alone.
"""
