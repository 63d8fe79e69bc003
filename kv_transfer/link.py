"""Link peaks: the GB/s a KV transfer could reach on its link, so each ``TransferRecord`` says how
far below it ran (``Transport.peak_gbps``, ``TransferRecord.efficiency``). Within a node the link
is memory: ``memcpy_peak`` times ``dst.copy_(src)`` between preallocated buffers. Between two
processes a probe moves a buffer from the producer's (``ProbeSource``, its picklable
``ProbeTicket``) to the consumer's (``probe_peak``): a NIXL READ where NIXL is installed, else a
TCP stream. Every peak is the fastest of ``repeats`` runs after a warm-up; GB/s = bytes / s / 1e9."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer.nixl import import_nixl, nixl_available

PROBE_BYTES = 32 << 20  # enough to leave per-call overheads behind, short enough for start-up
_PROGRESS_S = 1e-3


@dataclass(frozen=True)
class LinkPeak:
    """A measured peak: ``gbps`` (GB/s), how (``memcpy``, ``nixl`` or ``tcp``), bytes per run."""

    gbps: float
    method: str
    num_bytes: int


def _fastest(run, repeats: int) -> float:
    run()  # warm-up: pages touched, connections made
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        run()
        best_s = min(best_s, time.perf_counter() - start_s)
    return best_s


def memcpy_peak(num_bytes: int = PROBE_BYTES, repeats: int = 3, device: str = "cpu") -> LinkPeak:
    """One copy of ``num_bytes`` between preallocated buffers.

    Raises:
        ValueError: ``num_bytes`` or ``repeats`` < 1."""
    if num_bytes < 1 or repeats < 1:
        raise ValueError(f"num_bytes and repeats must be >= 1, got {num_bytes}, {repeats}")
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    return LinkPeak(num_bytes / _fastest(run, repeats) / 1e9, "memcpy", num_bytes)


@dataclass(frozen=True)
class ProbeTicket:
    """What a consumer needs to probe a ``ProbeSource``: plain values, picklable."""

    method: str          # "nixl" or "tcp"
    num_bytes: int
    agent: str = ""      # nixl: the source's agent name, metadata and buffer address
    metadata: bytes = b""
    addr: int = 0
    host: str = ""       # tcp: where the source listens
    port: int = 0


class ProbeSource:
    """The producer half of a link probe: a ``num_bytes`` buffer served until ``close``; ``host``:
    the address a TCP consumer connects to; ``use_nixl``: READ through NIXL where installed."""

    def __init__(self, num_bytes: int = PROBE_BYTES, host: str = "127.0.0.1",
                 use_nixl: bool = True):
        self.num_bytes = num_bytes
        self.data = pattern(num_bytes)  # touched: no page faults in the timed runs
        self._stop = threading.Event()
        if use_nixl and nixl_available():
            nixl = import_nixl()
            name = f"pdlab-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
            self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False))
            self._agent.register_memory(self.data)
            self.ticket = ProbeTicket("nixl", num_bytes, name, self._agent.get_agent_metadata(),
                                      self.data.data_ptr())
            # a consumer's first connection needs this side's progress (UCX wire-up)
            self._thread = threading.Thread(target=self._progress, daemon=True)
        else:
            self._agent = None
            self._server = socket.create_server((host, 0))
            self.ticket = ProbeTicket("tcp", num_bytes, host=host,
                                      port=self._server.getsockname()[1])
            self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(_PROGRESS_S):
            self._agent.get_new_notifs()

    def _serve(self) -> None:
        self._server.settimeout(0.2)
        view = memoryview(self.data.numpy())
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:  # timeout (look at the stop flag) or closed
                continue
            with conn:
                try:
                    while conn.recv(1) == b"+":  # one byte asks for one buffer
                        conn.sendall(view)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop serving."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._agent is None:
            self._server.close()


def pattern(num_bytes: int) -> torch.Tensor:
    """The bytes a ``ProbeSource`` serves: ``i % 251`` (uint8, so a receiver can check them)."""
    return (torch.arange(num_bytes, dtype=torch.int64) % 251).to(torch.uint8)


def probe_peak(ticket: ProbeTicket, repeats: int = 3, out: torch.Tensor | None = None
               ) -> LinkPeak:
    """The fastest of ``repeats`` moves of the source's buffer here, in GB/s; ``out``: a uint8 CPU
    tensor of ``ticket.num_bytes`` (default: a new one).

    Raises:
        OSError or a NIXL error: the source cannot be reached."""
    dst = torch.empty(ticket.num_bytes, dtype=torch.uint8) if out is None else out
    if ticket.method == "nixl":
        nixl = import_nixl()
        agent = nixl.nixl_agent(f"pdlab-probe-reader-{os.getpid()}-{secrets.token_hex(4)}",
                                nixl.nixl_agent_config(enable_prog_thread=False,
                                                       enable_listen_thread=False))
        agent.register_memory(dst)
        remote = agent.add_remote_agent(ticket.metadata)
        local = agent.get_xfer_descs(dst)
        far = agent.get_xfer_descs([(ticket.addr, ticket.num_bytes, 0)], "DRAM")

        def run() -> None:
            xfer = agent.initialize_xfer("READ", local, far, remote)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise OSError(f"the NIXL probe READ failed ({state})")

        try:
            return LinkPeak(ticket.num_bytes / _fastest(run, repeats) / 1e9, "nixl",
                            ticket.num_bytes)
        finally:
            agent.remove_remote_agent(remote)
    view = memoryview(dst.numpy())
    with socket.create_connection((ticket.host, ticket.port), timeout=30) as conn:
        def run() -> None:
            conn.sendall(b"+")
            got = 0
            while got < ticket.num_bytes:
                n = conn.recv_into(view[got:])
                if not n:
                    raise OSError("the probe source closed the connection")
                got += n

        return LinkPeak(ticket.num_bytes / _fastest(run, repeats) / 1e9, "tcp", ticket.num_bytes)
