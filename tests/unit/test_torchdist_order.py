"""TorchDistributedTransport's ordering and ownership logic with NCCL's semantics, against a
fake process group (``FakeWire``) in one process: messages of a pair match in posting order
whatever the tags, ``wait()`` does not block the host, and sends complete when the test says
(late, out of order) or at once (a small send buffered at the receiver, NVIDIA/nccl#544)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kv_cache import KVSpec
from kv_transfer.torchdist import P2PKey, TorchDistributedTransport
from kv_transfer.transport import KVHandle, TransferFailed, TransferTimeout

SPEC = KVSpec(model_fingerprint="tiny@x", num_layers=2, num_kv_heads=2, head_dim=4,
              dtype="float32")


class FakeWork:
    """One posted send or receive. ``wait()`` returns at once, as ProcessGroupNCCL's does
    (it only orders the current CUDA stream), raising if the work failed."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.done = threading.Event()
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout=None) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class FakeWire:
    """Point-to-point messages between ranks of one process, matched as NCCL matches them:
    per (src, dst) pair the n-th receive posted takes the n-th message sent, tags ignored.
    A receive completes when matched (a size mismatch fails it). A send completes when
    matched, or at once with ``eager``; with ``hold_sends`` only when ``release`` says."""

    def __init__(self, eager: bool = False, hold_sends: bool = False):
        self.eager, self.hold_sends = eager, hold_sends
        self.sends: dict[tuple[int, int], list[FakeWork]] = {}
        self.recvs: dict[tuple[int, int], list[FakeWork]] = {}
        self._lock = threading.Lock()

    def group(self, rank: int) -> _FakeGroup:
        return _FakeGroup(self, rank)

    def post(self, pair: tuple[int, int], work: FakeWork, is_send: bool) -> FakeWork:
        with self._lock:
            (self.sends if is_send else self.recvs).setdefault(pair, []).append(work)
            if is_send and self.eager and not self.hold_sends:
                work.done.set()
            sends, recvs = self.sends.get(pair, []), self.recvs.get(pair, [])
            for i in range(min(len(sends), len(recvs))):
                send, recv = sends[i], recvs[i]
                if recv.done.is_set():
                    continue
                if send.tensor.numel() != recv.tensor.numel():
                    recv.error = (f"size mismatch: receive of {recv.tensor.numel()} bytes "
                                  f"matched a send of {send.tensor.numel()}")
                else:
                    recv.tensor.copy_(send.tensor)
                recv.done.set()
                if not self.hold_sends:
                    send.done.set()
        return work

    def release(self, pair: tuple[int, int], *indices: int) -> None:
        """Complete the sends of ``pair`` with these indices (in posting order)."""
        for i in indices:
            self.sends[pair][i].done.set()


class _FakeGroup:
    def __init__(self, wire: FakeWire, rank: int):
        self.wire, self.rank = wire, rank

    def isend(self, tensor, dst, tag=0):
        return self.wire.post((self.rank, dst), FakeWork(tensor.clone()), is_send=True)

    def irecv(self, tensor, src, tag=0):
        return self.wire.post((src, self.rank), FakeWork(tensor), is_send=False)


def nccl(wire: FakeWire, rank: int, world_size: int = 2) -> TorchDistributedTransport:
    return TorchDistributedTransport(rank, world_size, backend="nccl", device="cpu",
                                     dst_rank=1 if rank == 0 else None, p2p=wire.group(rank),
                                     init_timeout_s=5.0)


def kv(num_tokens: int, value: float) -> torch.Tensor:
    return torch.full(SPEC.kv_shape(num_tokens), float(value))


def eventually(predicate, timeout_s: float = 5.0) -> bool:
    end_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end_s:
            return False
        time.sleep(0.005)
    return True


def test_a_send_is_held_until_the_host_sees_it_complete():
    """NCCL's wait() returns at once: num_held() must still count the send in flight."""
    wire = FakeWire(hold_sends=True)
    sender, receiver = nccl(wire, 0), nccl(wire, 1)
    handle = sender.put("a", SPEC, kv(5, 1.0))
    _, got = receiver.get(handle, SPEC, timeout_s=2.0)
    assert torch.equal(got, kv(5, 1.0))
    time.sleep(0.05)  # the send thread has long returned from wait()
    assert sender.num_held() == 1
    wire.release((0, 1), 0, 1)  # header, then tensor bytes
    assert eventually(lambda: sender.num_held() == 0)


def test_sends_completing_out_of_order_release_each_their_own():
    wire = FakeWire(hold_sends=True)
    sender, receiver = nccl(wire, 0), nccl(wire, 1)
    handles = [sender.put(rid, SPEC, kv(3, i)) for i, rid in enumerate("ab")]
    for i, handle in enumerate(handles):
        assert torch.equal(receiver.get(handle, SPEC, timeout_s=2.0)[1], kv(3, i))
    wire.release((0, 1), 2, 3)  # b's messages complete first
    assert eventually(lambda: sender.num_held() == 1)
    wire.release((0, 1), 0, 1)
    assert eventually(lambda: sender.num_held() == 0)


@pytest.mark.parametrize("eager", [False, True], ids=["in-flight", "completed-into-buffer"])
def test_a_free_on_the_sender_marks_the_pair_broken(eager):
    """The producer frees only handles no consumer took: the receive will never be posted,
    so the next message of the pair would land in the wrong receive. Also when the send
    already completed: a small NCCL send completes into the receiver's buffer."""
    wire = FakeWire(eager=eager)
    sender = nccl(wire, 0)
    handle = sender.put("lost", SPEC, kv(4, 1.0))
    if eager:
        assert eventually(lambda: sender.num_held() == 0)
    sender.free(handle)
    assert "freed before it was received" in sender.broken_peers()[1]
    assert sender.num_held() == 0
    with pytest.raises(TransferFailed, match="pair 0<->1 is broken"):
        sender.put("next", SPEC, kv(4, 2.0))
    sender.free(handle)  # twice is harmless


def test_a_get_waits_for_the_drain_of_an_earlier_send():
    """The fetch of b comes before the free (drain) of a: b's receive must not be posted
    first, or it would take a's bytes."""
    wire = FakeWire()
    sender, receiver = nccl(wire, 0), nccl(wire, 1)
    a = sender.put("a", SPEC, kv(5, 1.0))
    b = sender.put("b", SPEC, kv(3, 2.0))
    got: dict = {}
    fetch = threading.Thread(target=lambda: got.update(b=receiver.get(b, SPEC, timeout_s=5.0)))
    fetch.start()
    time.sleep(0.05)
    receiver.free(a)  # a's request was aborted before its fetch
    fetch.join()
    header, kv_b = got["b"]
    assert header.request_id == "b" and torch.equal(kv_b, kv(3, 2.0))
    assert eventually(lambda: sender.num_held() == 0)
    assert receiver.broken_peers() == {} and sender.broken_peers() == {}


def test_frees_and_gets_from_two_threads_stay_in_the_pairs_order():
    """The decode worker frees on its loop thread while its fetch thread gets: every other
    request is aborted before its fetch."""
    wire = FakeWire()
    sender, receiver = nccl(wire, 0), nccl(wire, 1)
    handles = [sender.put(f"r{i}", SPEC, kv(2 + i % 3, float(i))) for i in range(20)]
    aborted, fetched = handles[0::2], handles[1::2]

    def free_all():
        for handle in aborted:
            receiver.free(handle)

    loop = threading.Thread(target=free_all)
    loop.start()
    for handle in fetched:
        i = int(handle.request_id[1:])
        assert torch.equal(receiver.get(handle, SPEC, timeout_s=5.0)[1], kv(2 + i % 3, float(i)))
    loop.join()
    assert eventually(lambda: sender.num_held() == 0)
    assert receiver.broken_peers() == {}


def test_a_get_whose_predecessor_never_comes_times_out_and_breaks_the_pair():
    wire = FakeWire()
    sender, receiver = nccl(wire, 0), nccl(wire, 1)
    a = sender.put("a", SPEC, kv(2, 1.0))  # its handle never reaches the receiver
    b = sender.put("b", SPEC, kv(2, 2.0))
    with pytest.raises(TransferTimeout, match="waited for transfer seq 0 of that rank"):
        receiver.get(b, SPEC, timeout_s=0.2)
    assert "neither received nor freed here" in receiver.broken_peers()[0]
    with pytest.raises(TransferFailed, match="pair 1<->0 is broken"):
        receiver.get(a, SPEC, timeout_s=0.2)


def test_a_get_waits_on_the_host_until_its_deadline():
    """NCCL's wait() does not block: a receive whose message never comes must still time
    out at its deadline, not hand back an unwritten buffer."""
    receiver = nccl(FakeWire(), 1)
    never_sent = KVHandle("torchdist", "lost", P2PKey(0, 0, 16, 16, 1), 16, 0.0)
    start_s = time.monotonic()
    with pytest.raises(TransferTimeout, match="lost"):
        receiver.get(never_sent, SPEC, timeout_s=0.2)
    assert time.monotonic() - start_s >= 0.2
    assert "timed out" in receiver.broken_peers()[0]


def test_each_pair_has_its_own_sequence():
    """Puts to ranks 1 and 2 interleave; each receiver sees its own 0, 1, 2, ... and gets in
    its own order."""
    wire = FakeWire()
    sender = nccl(wire, 0, world_size=3)
    one, two = nccl(wire, 1, world_size=3), nccl(wire, 2, world_size=3)
    handles = [sender.put(f"r{i}", SPEC, kv(2, float(i)), dst_rank=1 + i % 2) for i in range(6)]
    assert [(h.key.dst_rank, h.key.seq) for h in handles] == [
        (1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    for i in (1, 3, 5, 0, 2, 4):
        receiver = two if i % 2 else one
        assert torch.equal(receiver.get(handles[i], SPEC, timeout_s=2.0)[1], kv(2, float(i)))
    with pytest.raises(TransferFailed, match="sent to rank 2, not to this rank 1"):
        one.get(handles[1], SPEC, timeout_s=0.2)
