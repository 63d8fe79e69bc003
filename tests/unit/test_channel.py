"""The channel contract (``channel.contract``): ordering, abort overtaking, death and the
incarnation, each checked against both implementations (in-process queues and pyzmq),
plus the bookkeeping they share (``Inbox``, ``Liveness``) and the wire format.

No assertion here is timed: waits are bounded loops that end as soon as the awaited thing
happens (the bound only keeps a broken channel from hanging the suite)."""

from __future__ import annotations

import logging
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from channel import wire
from channel.contract import (ABORT, ADMIT, RELEASE, SUBMIT, Command, Died, Inbox, Liveness,
                              Message, Stale)
from channel.local import LocalHub
from channel.sockets import SocketHub, SocketPort
from channel.unix import MAX_FRAME, UnixHub, UnixPort, frame
from engine.request import Request, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 30.0  # longest wait for anything (a broken channel fails, never hangs)
NEVER_S = 3600.0  # a silence that never counts as death in tests about something else


class LocalChannel:
    name = "local"

    def hub(self, **kwargs):
        return LocalHub(**kwargs)

    def port(self, hub, endpoint):
        return hub.open_port(endpoint)


class SocketChannel:
    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.name = f"zmq-{transport}"

    def hub(self, **kwargs):
        return SocketHub(self.transport, **kwargs)

    def port(self, hub, endpoint):
        return SocketPort(endpoint)


class UnixChannel:
    name = "unix"

    def hub(self, **kwargs):
        return UnixHub(**kwargs)

    def port(self, hub, endpoint):
        return UnixPort(endpoint)


CHANNELS = [LocalChannel(), SocketChannel("ipc"), SocketChannel("tcp"), UnixChannel()]


@pytest.fixture(params=CHANNELS, ids=lambda c: c.name)
def channel(request):
    return request.param


class Opened:
    """A test's hubs and ports of one channel; ``close`` closes them all, ports first."""

    def __init__(self, channel) -> None:
        self.channel, self.hubs, self.ports = channel, [], []

    def hub(self, dead_after_s: float = NEVER_S, **kwargs):
        """A hub (by default silence never counts as death: tests of death set it later)."""
        self.hubs.append(self.channel.hub(dead_after_s=dead_after_s, **kwargs))
        return self.hubs[-1]

    def port(self, hub, worker: str, incarnation: int = 0):
        """``worker``'s port of ``incarnation``, attached and opened."""
        self.ports.append(self.channel.port(hub, hub.attach(worker, incarnation)))
        return self.ports[-1]

    def close(self) -> None:
        for thing in self.ports + self.hubs:  # closing twice is harmless
            thing.close()


@pytest.fixture
def opened(channel):
    things = Opened(channel)
    yield things
    things.close()


def receive_until(hub, done, bound_s: float = BOUND_S) -> list:
    """Everything the hub delivers until ``done(items so far)``."""
    items: list = []
    end_s = time.monotonic() + bound_s
    while not done(items):
        assert time.monotonic() < end_s, f"channel stalled; got {items[-5:]}"
        items.extend(hub.receive(0.5))
    return items


def wait_arrived(hub, port, count: int) -> list:
    """Turn the hub (commands wait there until their port has connected) until ``count``
    commands reached ``port``; what the hub delivered meanwhile."""
    items: list = []
    end_s = time.monotonic() + BOUND_S
    while port.arrived < count:
        assert time.monotonic() < end_s, f"{port.arrived} of {count} commands arrived"
        items.extend(hub.receive(0.001))
    return items


def messages(items) -> list[Message]:
    return [i for i in items if isinstance(i, Message)]


# ---- ordering ---------------------------------------------------------------------------
def test_commands_and_messages_arrive_in_the_order_sent(opened):
    hub = opened.hub()
    port = opened.port(hub, "decode-0")
    sent = [Command(SUBMIT if i % 3 else RELEASE, f"r{i}", (i, f"x{i}", (i, i + 1)))
            for i in range(300)]
    for command in sent:
        hub.send("decode-0", command)
    wait_arrived(hub, port, len(sent))
    assert port.take(0).commands == sent
    for i in range(300):
        port.send({"step": i, "tokens": (i, i + 1)})
    got = messages(receive_until(hub, lambda items: len(messages(items)) == 300))
    assert [m.seq for m in got] == list(range(300))
    assert [m.body for m in got] == [{"step": i, "tokens": (i, i + 1)} for i in range(300)]
    assert {(m.worker, m.incarnation) for m in got} == {("decode-0", 0)}


def test_commands_sent_before_the_port_opens_wait_for_it(opened, channel):
    hub = opened.hub()
    endpoint = hub.attach("prefill-0", 0)
    for i in range(5):
        hub.send("prefill-0", Command(SUBMIT, f"r{i}"))
    hub.receive(0)  # the hub's loop turns while nobody listens
    port = channel.port(hub, endpoint)
    opened.ports.append(port)
    wait_arrived(hub, port, 5)
    assert [c.request_id for c in port.take(0).commands] == [f"r{i}" for i in range(5)]


def test_a_request_travels_whole(opened):
    """A command's arguments may be pdlab objects (pickled inside the msgpack frame)."""
    hub = opened.hub()
    port = opened.port(hub, "prefill-0")
    request = Request("r1", (1, 2, 3), SamplingParams(max_tokens=4))
    hub.send("prefill-0", Command(SUBMIT, "r1", (request, 1, 16)))
    wait_arrived(hub, port, 1)
    assert port.take(0).commands == [Command(SUBMIT, "r1", (request, 1, 16))]


# ---- abort overtaking ---------------------------------------------------------------------
def test_an_abort_cancels_its_requests_queued_command_and_keeps_the_rest_in_order(opened):
    hub = opened.hub()
    port = opened.port(hub, "decode-0")
    sent = [Command(SUBMIT, f"r{i}") for i in range(100)]
    sent.insert(50, Command(ADMIT, "kv", (("handle-1", "handle-2"),)))
    sent += [Command(ABORT, "r7"), Command(ABORT, "kv"), Command(ABORT, "unknown"),
             Command(RELEASE, None, (("h",),))]
    for command in sent:  # the worker is busy: nothing is taken until all arrived
        hub.send("decode-0", command)
    wait_arrived(hub, port, len(sent))
    taken = port.take(0)
    assert taken.cancelled == [Command(SUBMIT, "r7"),
                               Command(ADMIT, "kv", (("handle-1", "handle-2"),))]
    expected = [c for c in sent if c not in taken.cancelled]
    assert taken.commands == expected  # the aborts in their places, all else in order
    assert sum(c.request_id == "r7" for c in taken.commands) == 1  # the abort alone


def test_an_abort_after_its_command_was_taken_is_delivered_plainly():
    inbox = Inbox()
    inbox.put(Command(SUBMIT, "r1"))
    assert inbox.take(0).commands == [Command(SUBMIT, "r1")]
    inbox.put(Command(ABORT, "r1"))
    taken = inbox.take(0)
    assert taken.commands == [Command(ABORT, "r1")] and taken.cancelled == []


# ---- death ------------------------------------------------------------------------------
def test_a_port_that_falls_silent_is_reported_dead_once(opened):
    hub = opened.hub(heartbeat_s=0.05)
    port = opened.port(hub, "decode-0")
    port.send("last words")
    got = receive_until(hub, lambda items: messages(items))
    assert [m.body for m in messages(got)] == ["last words"]
    hub.liveness.dead_after_s = 0.3  # (not before: a busy host must not fake a death)
    port.close()
    items = receive_until(hub, lambda items: any(isinstance(i, Died) for i in items))
    died = [i for i in items if isinstance(i, Died)]
    assert [(d.worker, d.incarnation) for d in died] == [("decode-0", 0)]
    assert died[0].silent_s >= 0.3
    assert not any(isinstance(i, Died) for i in hub.receive(0.4))  # reported once


@pytest.mark.workers
def test_a_killed_worker_process_is_reported_dead():
    """The port lives in another process, killed with SIGKILL mid-run."""
    hub = SocketHub("ipc", dead_after_s=NEVER_S, heartbeat_s=0.05)
    endpoint = hub.attach("prefill-0", 0)
    code = ("import sys, time\n"
            "from channel.contract import Endpoint\n"
            "from channel.sockets import SocketPort\n"
            f"port = SocketPort(Endpoint(*{tuple(vars(endpoint).values())!r}))\n"
            "port.send('up')\n"
            "time.sleep(600)\n")
    worker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        up = receive_until(hub, lambda items: messages(items))
        assert [m.body for m in messages(up)] == ["up"]
        hub.liveness.dead_after_s = 0.3
        os.kill(worker.pid, signal.SIGKILL)
        items = receive_until(hub, lambda items: any(isinstance(i, Died) for i in items))
        died = [(d.worker, d.incarnation) for d in items if isinstance(d, Died)]
        assert died == [("prefill-0", 0)]
    finally:
        worker.kill()
        worker.wait()
        hub.close()


def test_liveness_counts_silence_from_the_first_message_and_reports_each_death_once():
    now = [100.0]
    live = Liveness(dead_after_s=1.0, clock=lambda: now[0])  # (binary-exact steps below)
    live.attach("w", 0)
    now[0] += 50  # loading its model: not watched yet
    assert live.deaths() == [] and live.next_death_in() is None
    assert live.heard("w", 0)
    now[0] += 0.875
    assert live.heard("w", 0)  # a heartbeat in time
    now[0] += 0.75
    assert live.deaths() == [] and live.next_death_in() == 0.25
    now[0] += 0.25
    assert live.deaths() == [Died("w", 0, 1.0)]
    assert live.deaths() == []
    assert not live.heard("w", 0)  # a dead incarnation stays dead
    assert not live.heard("w", 0)
    assert live.stale == {("w", 0): 2}
    assert live.strays() == [Stale("w", 0)] and live.strays() == []  # reported once


def test_a_port_failure_is_a_death_with_its_cause_once():
    live = Liveness(dead_after_s=1.0, clock=lambda: 0.0)
    live.attach("w", 0)
    assert live.heard("w", 0)
    assert live.failed("w", 0, "socket closed") == Died("w", 0, 0.0, "socket closed")
    assert live.failed("w", 0, "again") is None and live.deaths() == []
    assert not live.heard("w", 0)


# ---- incarnation ---------------------------------------------------------------------------
def test_news_of_a_dead_incarnation_is_told_apart_after_its_replacement_rejoins(opened):
    # no heartbeats after the first: the stale count is exactly the old one's late messages
    hub = opened.hub(heartbeat_s=NEVER_S)
    old = opened.port(hub, "decode-0", 0)
    old.send("old-0")
    assert [(m.incarnation, m.body) for m in messages(
        receive_until(hub, lambda items: messages(items)))] == [(0, "old-0")]
    new = opened.port(hub, "decode-0", 1)  # the replacement rejoins
    old.send("old-late")  # the dead one was not quite dead
    new.send("new-0")
    hub.send("decode-0", Command(SUBMIT, "r1"))
    items = receive_until(hub, lambda items: any(m.body == "new-0" for m in messages(items)))
    old.send("old-later")
    new.send("new-1")
    items += receive_until(hub, lambda items: any(m.body == "new-1" for m in messages(items)))
    # (two sockets: the old one's messages may come after the new one's)
    items += receive_until(hub, lambda _: hub.stale.get(("decode-0", 0)) == 2)
    got = messages(items)
    assert [(m.incarnation, m.seq, m.body) for m in got] == [(1, 0, "new-0"), (1, 1, "new-1")]
    # the old one spoke after its replacement joined: reported once, for its owner to stop
    assert [i for i in items if isinstance(i, Stale)] == [Stale("decode-0", 0)]
    wait_arrived(hub, new, 1)
    assert new.take(0).commands == [Command(SUBMIT, "r1")]
    assert old.arrived == 0  # commands go to the incarnation attached last only
    # the old one's heartbeats never keep the new one alive
    hub.liveness.dead_after_s = 0.3
    new.close()
    items = receive_until(hub, lambda items: any(isinstance(i, Died) for i in items))
    died = [(d.worker, d.incarnation) for d in items if isinstance(d, Died)]
    assert died == [("decode-0", 1)]


def test_an_incarnation_must_be_newer_than_the_one_attached(opened):
    hub = opened.hub()
    hub.attach("decode-0", 3)
    with pytest.raises(ValueError, match="not newer than 3"):
        hub.attach("decode-0", 3)


# ---- bad input ------------------------------------------------------------------------------
SOCKET_CHANNELS = [c for c in CHANNELS if c.name.startswith("zmq")]


def _refuse() -> None:
    raise ValueError("this value cannot be rebuilt here")


class Unloadable:
    """Encodes (pickled) and fails to decode: a class the receiver cannot rebuild."""

    def __reduce__(self):
        return _refuse, ()


@pytest.mark.parametrize("channel", SOCKET_CHANNELS, ids=lambda c: c.name)
def test_a_port_drops_what_it_cannot_decode_or_encode_and_goes_on(channel, caplog):
    hub = channel.hub(dead_after_s=NEVER_S)
    try:
        port = channel.port(hub, hub.attach("decode-0", 0))
        with caplog.at_level(logging.ERROR, logger="channel.sockets"):
            hub.send("decode-0", Command(SUBMIT, "r0"))
            wait_arrived(hub, port, 1)
            for garbage in (b"\xc1", wire.encode(42), wire.encode(("submit", "r1"))):
                hub._out["decode-0"].send(garbage)  # what no hub of this version sends
            hub.send("decode-0", Command(SUBMIT, "r2"))
            wait_arrived(hub, port, 2)
            assert [c.request_id for c in port.take(0).commands] == ["r0", "r2"]
            port.send(threading.Lock())  # no pickle for it: dropped, its number reused
            port.send("after")
            got = messages(receive_until(hub, lambda items: messages(items)))
        assert [(m.seq, m.body) for m in got] == [(0, "after")]
        assert port.dropped == 4 and port.error is None
        dropped = [r.getMessage() for r in caplog.records]
        assert len(dropped) == 4 and all("decode-0 incarnation 0: dropped" in d for d in dropped)
        assert "a command of 1 bytes" in dropped[0] and "lock" in dropped[3]
        port.close()
    finally:
        hub.close()


@pytest.mark.parametrize("channel", SOCKET_CHANNELS, ids=lambda c: c.name)
def test_a_bad_message_costs_the_hub_only_itself(channel, caplog):
    """Bodies the hub cannot decode and a frame with no readable header, in one batch
    with good messages: the good ones arrive, each bad one is logged with its sender."""
    hub = channel.hub(dead_after_s=NEVER_S)
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        port = channel.port(hub, hub.attach("decode-0", 0))
        raw.connect(hub.address)
        with caplog.at_level(logging.ERROR, logger="channel.sockets"):
            raw.send(b"\xc1")
            port.send("a")
            port.send(Unloadable())
            port.send("b")
            port.send(Unloadable())
            items = receive_until(hub, lambda items: len(messages(items)) == 2 and
                                  sum(hub.undecodable.values()) == 3)
        assert [(m.seq, m.body) for m in messages(items)] == [(0, "a"), (2, "b")]
        assert hub.undecodable == {("decode-0", 0): 2, ("?", -1): 1}
        logged = sorted(r.getMessage() for r in caplog.records)
        assert "a message from an unknown sender" in logged[0]
        assert [line.split(":")[1] for line in logged[1:]] == [
            " dropped message 1 of decode-0 incarnation 0", " dropped message 3 of decode-0 "
            "incarnation 0"]
        assert all("cannot be rebuilt here" in line for line in logged[1:])
        port.close()
    finally:
        raw.close()
        context.term()
        hub.close()


@pytest.mark.parametrize("channel", SOCKET_CHANNELS + [UnixChannel()], ids=lambda c: c.name)
def test_a_command_whose_request_id_is_unhashable_is_dropped_and_the_port_goes_on(channel):
    """A request id the abort rule cannot index by (a map, a list holding one) would break
    ``take``, and the worker's loop with it: such a command is dropped alone."""
    hub = channel.hub(dead_after_s=NEVER_S)
    try:
        port = channel.port(hub, hub.attach("decode-0", 0))
        for request_id in ({"not": "an id"}, [1, {}], "r1"):
            hub.send("decode-0", Command(SUBMIT, request_id))
        end_s = time.monotonic() + BOUND_S
        commands = []
        while not commands:
            assert time.monotonic() < end_s, "r1 never arrived"
            hub.receive(0.001)
            commands = port.take(0).commands
        assert commands == [Command(SUBMIT, "r1")]
        assert port.dropped == 2 and port.open
        port.close()
    finally:
        hub.close()


@pytest.mark.parametrize("channel", SOCKET_CHANNELS + [UnixChannel()], ids=lambda c: c.name)
def test_a_port_whose_socket_fails_is_reported_dead_with_the_cause(channel):
    """Not silence: the hub hears the port's own report at once (no heartbeat deadline
    here), a worker waiting on the port is woken for good, and what it sends after is
    dropped (not queued for a thread that is gone)."""
    hub = channel.hub(dead_after_s=NEVER_S, heartbeat_s=0.01)
    try:
        port = channel.port(hub, hub.attach("prefill-0", 0))

        def broken() -> None:
            raise zmq.ZMQError(zmq.ENOTSOCK)

        port._beat = broken  # the next heartbeat meets a broken socket
        items = receive_until(hub, lambda items: any(isinstance(i, Died) for i in items))
        died = [i for i in items if isinstance(i, Died)]
        assert [(d.worker, d.incarnation, d.silent_s) for d in died] == [("prefill-0", 0, 0.0)]
        assert died[0].cause.startswith("its channel port failed: ZMQError: ")
        assert port.error.startswith("ZMQError: ")
        assert not port.take(NEVER_S)  # failed: returns at once, empty
        assert not port.open
        port._thread.join(30)
        assert not port._thread.is_alive()
        port.send(("late",))  # dropped: never numbered, never sent
        assert port._seq == 0
        port.close()
    finally:
        hub.close()


def test_the_unix_channel_drops_what_it_cannot_decode_and_closes_a_broken_stream(caplog):
    """A command frame the port cannot decode and a message body the hub cannot decode are
    logged and dropped alone; a stranger's garbage hello and a frame length no message has
    close that connection only; the good commands and messages all arrive."""
    hub = UnixHub(dead_after_s=NEVER_S)
    try:
        port = UnixPort(hub.attach("decode-0", 0))
        with caplog.at_level(logging.ERROR):
            hub.send("decode-0", Command(SUBMIT, "r0"))
            wait_arrived(hub, port, 1)
            connection = hub._current["decode-0"]
            connection.out += frame(b"\xc1") + frame(wire.encode(("submit", "r1")))
            hub.send("decode-0", Command(SUBMIT, "r2"))
            wait_arrived(hub, port, 2)
            assert [c.request_id for c in port.take(0).commands] == ["r0", "r2"]
            assert port.dropped == 2 and port.error is None
            for garbage in (frame(b"\xc1"), struct.pack("<I", MAX_FRAME + 1)):
                stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                stranger.connect(hub.address[len("unix://"):])
                stranger.sendall(garbage)
                stranger.close()
            port.send("a")
            port.send(Unloadable())
            port.send("b")
            items = receive_until(hub, lambda items: len(messages(items)) == 2
                                  and sum(hub.undecodable.values()) == 3)
        assert [(m.seq, m.body) for m in messages(items)] == [(0, "a"), (2, "b")]
        assert hub.undecodable == {("decode-0", 0): 1, ("?", -1): 2}
        port.close()
    finally:
        hub.close()


def test_a_unix_port_whose_hub_went_away_fails_and_waits_no_more():
    hub = UnixHub(dead_after_s=NEVER_S)
    port = UnixPort(hub.attach("prefill-0", 0))
    try:
        hub.send("prefill-0", Command(SUBMIT, "r0"))
        wait_arrived(hub, port, 1)
        hub.close()
        assert port.take(NEVER_S).commands == [Command(SUBMIT, "r0")]  # it came before
        assert not port.take(NEVER_S)  # the hub's end closed: failed, at once
        assert not port.open and port.error == "ConnectionError: the hub closed the channel"
    finally:
        port.close()


def test_a_unix_hub_changes_its_epoll_registration_only_when_a_backlog_starts_or_ends():
    """A command the socket takes whole costs no ``epoll_ctl``; one that leaves a backlog
    adds the wait for room, and the write that empties it removes that, in order."""
    hub = UnixHub(dead_after_s=NEVER_S)
    port = UnixPort(hub.attach("prefill-0", 0))
    modified: list[int] = []
    modify = hub._selector.modify
    hub._selector.modify = lambda sock, events, data=None: (modified.append(events),
                                                             modify(sock, events, data))[1]
    try:
        hub.send("prefill-0", Command(SUBMIT, "r0"))
        wait_arrived(hub, port, 1)
        assert port.take(0.0).commands == [Command(SUBMIT, "r0")] and modified == []
        big = tuple(range(300_000))  # ~1.5 MB a command: more than the socket buffers hold
        for i in range(3):
            hub.send("prefill-0", Command(SUBMIT, f"big{i}", (big,)))
        assert modified == [selectors.EVENT_READ | selectors.EVENT_WRITE]  # the backlog
        got: list = []
        end_s = time.monotonic() + BOUND_S
        while len(got) < 3:
            assert time.monotonic() < end_s, f"{len(got)} of 3 big commands arrived"
            hub.receive(0.001)  # writes what the socket takes now
            got += port.take(0.001).commands
        assert [c.request_id for c in got] == ["big0", "big1", "big2"] and got[2].args == (big,)
        assert modified == [selectors.EVENT_READ | selectors.EVENT_WRITE, selectors.EVENT_READ]
    finally:
        port.close()
        hub.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files in /proc")
def test_a_unix_port_that_cannot_reach_its_hub_raises_and_keeps_no_descriptor():
    hub = UnixHub(dead_after_s=NEVER_S)
    endpoint = hub.attach("prefill-0", 0)
    hub.close()
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError):
            UnixPort(endpoint)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_a_take_waits_until_a_command_arrives_or_a_wake(opened):
    """``take`` returns with the first command to arrive, or empty-handed once woken from
    another thread (a worker's own commands wake its loop so); a closed port's returns at
    once."""
    hub = opened.hub()
    port = opened.port(hub, "prefill-0")
    hub.send("prefill-0", Command(SUBMIT, "r0"))  # the channel is up once this arrived
    wait_arrived(hub, port, 1)
    assert port.take(0).commands == [Command(SUBMIT, "r0")]
    threading.Timer(0.05, lambda: hub.send("prefill-0", Command(SUBMIT, "r1"))).start()
    assert port.take(BOUND_S).commands == [Command(SUBMIT, "r1")]
    threading.Timer(0.05, port.wake).start()
    assert not port.take(NEVER_S)
    assert port.open
    port.close()
    assert not port.open and not port.take(NEVER_S)


def test_a_take_returns_its_command_while_another_thread_reads_arrived(opened):
    """``arrived`` read from another thread (a test's poll) never takes the wake-up a waiting
    ``take`` needs: each take returns with the command that came, not at its timeout."""
    hub = opened.hub()
    port = opened.port(hub, "prefill-0")
    hub.send("prefill-0", Command(SUBMIT, "r0"))
    wait_arrived(hub, port, 1)
    assert port.take(0).commands == [Command(SUBMIT, "r0")]
    for i in range(1, 11):
        stop, taken = threading.Event(), []
        poller = threading.Thread(target=lambda: [port.arrived for _ in iter(stop.is_set, True)])
        taker = threading.Thread(target=lambda: taken.append(port.take(NEVER_S)))
        poller.start()
        taker.start()
        hub.send("prefill-0", Command(SUBMIT, f"r{i}"))
        taker.join(BOUND_S)
        stop.set()
        poller.join()
        assert not taker.is_alive(), f"take {i} missed its command"
        assert taken[0].commands == [Command(SUBMIT, f"r{i}")]


def test_a_take_waits_on_descriptors_past_selects_limit(opened):
    """A worker process with over a thousand files open: select(2) refuses a descriptor of
    1024 or more, yet the port's ``take`` still waits for a command and for a wake."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("the soft limit on open files is under 1200")
    held = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while held[-1] < 1100:
            held.append(os.dup(held[0]))
        hub = opened.hub()
        port = opened.port(hub, "prefill-0")
        hub.send("prefill-0", Command(SUBMIT, "r0"))
        wait_arrived(hub, port, 1)
        assert port.take(0).commands == [Command(SUBMIT, "r0")]
        threading.Timer(0.05, lambda: hub.send("prefill-0", Command(SUBMIT, "r1"))).start()
        assert port.take(BOUND_S).commands == [Command(SUBMIT, "r1")]
        threading.Timer(0.05, port.wake).start()
        assert not port.take(NEVER_S) and port.open
    finally:
        for fd in held:
            os.close(fd)


# ---- wake-up and the wire ---------------------------------------------------------------------
def test_wake_ends_a_receive_at_once(opened):
    """A receive that would wait an hour returns empty-handed once woken (from any thread)."""
    hub = opened.hub()
    hub.wake()
    assert hub.receive(NEVER_S) == []


def test_the_wire_keeps_plain_values_as_msgpack_and_pickles_the_rest():
    request = Request("r1", (5, 6), SamplingParams(max_tokens=2))
    value = ("step", 3, 1.5, None, True, b"\x00\x01", {"a": (1, 2), 7: "x"}, [request])
    assert wire.decode(wire.encode(value)) == (
        "step", 3, 1.5, None, True, b"\x00\x01", {"a": (1, 2), 7: "x"}, (request,))
    assert len(wire.encode((1, "a"))) == 4  # fixarray, fixint, fixstr: no pickle
    with pytest.raises(ValueError):
        wire.decode(wire.encode((1, 2))[:-1])


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="ipc"):
        SocketHub("udp")
