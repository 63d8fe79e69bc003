"""KV-transfer benchmark: GB/s of every transport against memcpy, and layer-wise streaming.

Run: ``python -m benchmarks.kv_transfer`` (``--quick``, ``--out DIR`` for CSVs). Everything is
measured side by side in one run; each time is the min of N runs after one warm-up, the
median beside it (``experiments.timing``). torch runs ``--threads`` threads (default 1).

Part 1, bandwidth: KV of 1-256 MiB (bf16 ``[16, 2, 8, T, 128]``) moved by each transport,
GB/s = bytes / (put_s + get_s), CRC-32C on unless ``nocrc``. Rows: ``memcpy`` (the floor),
``inprocess``, ``shm`` (two processes; ``copy-out``, ``layer`` variants), ``nixl`` (two
processes; ``nocrc``, ``layer``), ``nixl READ`` (the bare READ, ``kv_transfer.link``),
``ray`` (driver object store), ``torchdist`` (gloo, two processes). ``x_memcpy`` compares
with the ``memcpy`` row, ``x_memcpy_here`` with a memcpy timed inside the rows' own
processes, interleaved. Targets: best intra-node transport >= 0.5x memcpy from 16 MiB; nixl
>= 0.8x whole-request and >= 0.5x layer-wise.

Part 2, layer-wise streaming (SmolLM2-135M, one 512-token prompt): the prefill step as
``PrefillWorker`` runs it, whole-request (``export_kv`` + one put after the step) against
layer-wise (a put per layer from ``on_layer_done``), a receiver thread getting each handle
as it comes. ``prefill_s`` is the step's wall time, ``exposed_s`` the time from the step's
end to the last get's return, ``lengthening_s`` the layer-wise prefill_s minus the
whole-request one. Target: layer-wise exposed_s <= 20% of whole-request.

Part 3, two Ray nodes on this machine, interleaved: ``ray`` and ``nixl`` transports, and
Ray's actor-to-actor tensor paths (object store against Ray Direct Transport over gloo),
GB/s = bytes / seconds from producing call to consumer's return. Target: nixl beats ray."""

from __future__ import annotations

import argparse
import importlib
import queue
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import ray
import torch
import torch.multiprocessing as mp
from ray.cluster_utils import Cluster
from ray.experimental.collective import create_collective_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVSpec
from engine.model import load_model
from experiments.measure import random_request
from deployment.ray_actors import ray_init_kwargs
from experiments.timing import Timing, measure, summarize
from experiments.transfer_cost import time_torchdist
from kv_transfer.inprocess import InProcessTransport
from kv_transfer.link import ProbeSource, probe_peak
from kv_transfer.nixl import NixlTransport, nixl_available
from kv_transfer.ray_store import RayObjectStoreTransport
from kv_transfer.shm import SharedMemoryTransport

MIB = 1 << 20
SPEC = KVSpec(model_fingerprint="bench", num_layers=16, num_kv_heads=8, head_dim=128,
              dtype="bfloat16")  # 64 KiB per token
SIZES_MIB = (1, 16, 64, 256)
QUICK_SIZES_MIB = (1, 16, 64)


def kv_of(mib: int, seed: int = 0) -> torch.Tensor:
    tokens = mib * MIB // SPEC.bytes_per_token
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.kv_shape(tokens), generator=gen).to(torch.bfloat16)


# ---- part 1: bandwidth ---------------------------------------------------------------
def time_memcpy(kv: torch.Tensor, repeats: int) -> Timing:
    dst = torch.empty_like(kv)
    return measure(lambda: dst.copy_(kv), repeats)


def time_local(transport, kv: torch.Tensor, repeats: int) -> Timing:
    """put + get in this process; free untimed."""
    handles: list = []

    def run() -> None:
        handle = transport.put("bench", SPEC, kv)
        handles.append(handle)
        transport.get(handle, SPEC, 60.0)

    def teardown() -> None:
        for handle in handles:
            transport.free(handle)
        handles.clear()

    return measure(run, repeats, teardown=teardown)


def _pair_transport(kind: str, checksum: bool, zero_copy: bool, capacity_bytes: int):
    if kind == "nixl":

        return NixlTransport(checksum=checksum, capacity_bytes=capacity_bytes,
                             landing_bytes=capacity_bytes)

    return SharedMemoryTransport(checksum=checksum, capacity_bytes=capacity_bytes,
                                 zero_copy=zero_copy)


def _pair_side(kind: str, role: str, sizes: list[int], repeats: int, checksum: bool,
               zero_copy: bool, per_layer: bool, threads: int, handle_q, ack_q,
               result_q) -> None:
    """One process of a two-process measurement (``kind`` shm or nixl): ``put`` side or
    ``get`` side. Whole request: one put and one get; ``per_layer``: one put per layer,
    then one get per layer (seconds summed). The put side also times a memcpy of the same
    KV in every round (interleaved), the row's own x_memcpy reference."""
    torch.set_num_threads(threads)
    transport = _pair_transport(kind, checksum, zero_copy, (max(sizes) + 1) * MIB)
    for mib in sizes:
        if role == "put":
            kv = kv_of(mib)
            dst = torch.empty_like(kv)
            chunks = ([(i, i + 1) for i in range(SPEC.num_layers)] if per_layer
                      else [(0, SPEC.num_layers)])
            samples, memcpy = [], []
            for i in range(1 + repeats):
                start_s = time.perf_counter()
                dst.copy_(kv)
                copy_s = time.perf_counter() - start_s
                start_s = time.perf_counter()
                handles = [transport.put("bench", SPEC, kv[a:b], layer_start=a) for a, b in chunks]
                put_s = time.perf_counter() - start_s
                handle_q.put(handles)
                get_s = ack_q.get(timeout=300)
                if i:
                    samples.append(put_s + get_s)
                    memcpy.append(copy_s)
            result_q.put((samples, memcpy))
        else:
            for _ in range(1 + repeats):
                handles = handle_q.get(timeout=300)
                get_s = 0.0
                for handle in handles:
                    start_s = time.perf_counter()
                    _, out = transport.get(handle, SPEC, 60.0)
                    get_s += time.perf_counter() - start_s
                    transport.free(handle)
                    del out  # releases the slot (zero-copy lease)
                ack_q.put(get_s)
    if role == "put":
        deadline_s = time.monotonic() + 10  # keep the arena until every extent is back
        while transport.num_held() and time.monotonic() < deadline_s:
            time.sleep(0.01)
    transport.close()


def _read_side(role: str, sizes: list[int], repeats: int, threads: int, handle_q, ack_q,
               result_q) -> None:
    """The raw NIXL READ of a registered buffer between two processes (``kv_transfer.link``
    probe: no packing, no checksum, no put copy), beside a memcpy timed in the same process."""

    torch.set_num_threads(threads)
    for mib in sizes:
        if role == "put":
            source = ProbeSource(mib * MIB)
            handle_q.put(source.ticket)
            ack_q.get(timeout=300)
            source.close()
        else:
            samples, memcpy = [], []
            src, dst = torch.ones(mib * MIB, dtype=torch.uint8), torch.empty(mib * MIB,
                                                                               dtype=torch.uint8)
            ticket = handle_q.get(timeout=300)
            for _ in range(repeats):  # interleaved: one memcpy, one READ (its own warm-up)
                start_s = time.perf_counter()
                dst.copy_(src)
                memcpy.append(time.perf_counter() - start_s)
                samples.append(mib * MIB / probe_peak(ticket, repeats=1).gbps / 1e9)
            ack_q.put("done")
            result_q.put((samples, memcpy))


def time_pair(kind: str, sizes: list[int], repeats: int, checksum: bool, zero_copy: bool,
              threads: int, per_layer: bool = False, raw_read: bool = False
              ) -> list[tuple[Timing, Timing]]:
    """(transport timing, interleaved memcpy timing) per size, between two processes."""

    # the spawned children find their targets by module name even when this runs as -m
    module = importlib.import_module("benchmarks.kv_transfer")
    ctx = mp.get_context("spawn")
    handle_q, ack_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    if raw_read:
        target, args = module._read_side, (sizes, repeats, threads, handle_q, ack_q, result_q)
    else:
        target = module._pair_side
        args = (sizes, repeats, checksum, zero_copy, per_layer, threads, handle_q, ack_q,
                result_q)
    procs = [ctx.Process(target=target, args=((kind, role) if not raw_read else (role,)) + args,
                         daemon=True) for role in ("put", "get")]
    for proc in procs:
        proc.start()
    try:
        out = []
        for _ in sizes:
            samples, memcpy = result_q.get(timeout=900)
            out.append((summarize(samples), summarize(memcpy)))
        return out
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def bandwidth_table(sizes: list[int], repeats: int, threads: int, with_ray: bool,
                    with_torchdist: bool, with_nixl: bool = True) -> list[dict]:

    rows: list[dict] = []
    memcpy: dict[int, Timing] = {}

    def add(name: str, where: str, mib: int, t: Timing, here: Timing | None = None) -> None:
        """``here``: a memcpy timed in the same process, interleaved with ``t``'s rounds."""
        nbytes = mib * MIB
        rows.append({"transport": name, "MiB": mib, "GBps": nbytes / t.min_s / 1e9,
                     "median_GBps": nbytes / t.median_s / 1e9,
                     "x_memcpy": memcpy[mib].min_s / t.min_s,
                     "x_memcpy_here": (here or memcpy[mib]).min_s / t.min_s,
                     "min_ms": t.min_s * 1e3, "where": where})

    ray_transport = None
    if with_ray:

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 configure_logging=False,
                 object_store_memory=max(4 * max(sizes) * MIB, 512 * MIB))
        ray_transport = RayObjectStoreTransport()
    try:
        for mib in sizes:
            kv = kv_of(mib)
            memcpy[mib] = time_memcpy(kv, repeats)
            add("memcpy", "dst.copy_(kv), preallocated dst", mib, memcpy[mib])
            add("inprocess", "put+get, one process", mib,
                time_local(InProcessTransport(), kv, repeats))
            add("inprocess nocrc", "put+get, one process, no checksum", mib,
                time_local(InProcessTransport(checksum=False), kv, repeats))
            if ray_transport is not None:
                add("ray", "put+get in the driver (local object store)", mib,
                    time_local(ray_transport, kv, repeats))
            print(f"  measured {mib} MiB (memcpy, inprocess{', ray' if with_ray else ''})",
                  file=sys.stderr)
    finally:
        if with_ray:

            ray.shutdown()
    pairs = [("shm", "shm", True, True, False, "2 processes: put_s + get_s (zero-copy view)"),
             ("shm nocrc", "shm", False, True, False, "2 processes, no checksum"),
             ("shm copy-out", "shm", True, False, False,
              "2 processes, get copies into a fresh tensor"),
             ("shm layer", "shm", True, True, True, "2 processes, one put + get per layer")]
    if with_nixl:

        if nixl_available():
            pairs += [("nixl", "nixl", True, True, False,
                       "2 processes: put_s + get_s (READ into the landing buffer)"),
                      ("nixl nocrc", "nixl", False, True, False, "2 processes, no checksum"),
                      ("nixl layer", "nixl", True, True, True,
                       "2 processes, one put + get (READ) per layer"),
                      ("nixl READ", "nixl", False, False, False,
                       "2 processes: the READ alone (no put copy, no pack, no checksum)")]
        else:
            print("  nixl skipped: pip install 'pdlab[nixl]'", file=sys.stderr)
    for name, kind, checksum, zero_copy, per_layer, where in pairs:
        timings = time_pair(kind, sizes, repeats, checksum, zero_copy, threads, per_layer,
                            raw_read=name == "nixl READ")
        for mib, (t, here) in zip(sizes, timings):
            add(name, where, mib, t, here)
        print(f"  measured {name}", file=sys.stderr)
    if with_torchdist:

        jobs = [(mib * MIB // SPEC.bytes_per_token, [(0, SPEC.num_layers)]) for mib in sizes]
        for mib, t in zip(sizes, time_torchdist(SPEC, jobs, repeats)):
            add("torchdist", "gloo, 2 processes: put_s + get_s", mib, t)
        print("  measured torchdist", file=sys.stderr)
    return rows


# ---- part 3: across two Ray nodes ---------------------------------------------------------
def _node_side_class():
    """The benchmark actor of part 3 (built lazily: ``import ray`` only when it runs)."""

    class NodeSide:
        """One Ray node's side: pdlab transports (``put`` / ``get``) and Ray's own tensor
        paths (``produce_*`` returns a tensor, ``consume`` receives it)."""

        def __init__(self, capacity_bytes: int):
            self.capacity_bytes = capacity_bytes
            self.transports: dict = {}
            self.kv: dict[int, torch.Tensor] = {}
            self.buf = torch.empty(0, dtype=torch.uint8)
            torch.set_num_threads(1)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def _transport(self, kind: str):
            if kind not in self.transports:
                if kind == "nixl":

                    self.transports[kind] = NixlTransport(capacity_bytes=self.capacity_bytes,
                                                          landing_bytes=self.capacity_bytes)
                else:

                    self.transports[kind] = RayObjectStoreTransport()
            return self.transports[kind]

        def put(self, kind: str, mib: int):
            kv = self.kv.setdefault(mib, kv_of(mib))
            return self._transport(kind).put("bench", SPEC, kv)

        def get(self, kind: str, handle) -> float:
            transport = self._transport(kind)
            start_s = time.perf_counter()
            _, out = transport.get(handle, SPEC, 120.0)
            get_s = time.perf_counter() - start_s
            transport.free(handle)
            del out
            return get_s

        def held(self, kind: str) -> int:
            return self._transport(kind).num_held()

        def make(self, mib: int) -> None:
            self.buf = torch.ones(mib * MIB, dtype=torch.uint8)

        def produce_store(self) -> torch.Tensor:
            return self.buf

        @ray.method(tensor_transport="gloo")
        def produce_rdt(self) -> torch.Tensor:
            return self.buf

        def consume(self, tensor: torch.Tensor) -> int:
            return int(tensor.numel())

    return NodeSide


def two_node_table(sizes: list[int], repeats: int, with_nixl: bool = True) -> list[dict]:
    """Part 3: two Ray nodes on this machine (``ray.cluster_utils.Cluster``, one CPU each),
    one actor per node, measured interleaved round by round: the ``ray`` and ``nixl``
    transports (GB/s = bytes / (put_s + get_s), as part 1), and Ray's own actor-to-actor
    tensor paths, the object store against Ray Direct Transport over gloo (GB/s = bytes /
    seconds from the producing call to the consumer's return, measured by the driver)."""

    store_bytes = max(6 * max(sizes) * MIB, 512 * MIB)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": store_bytes})
    cluster.add_node(num_cpus=1, object_store_memory=store_bytes)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_init_kwargs()["runtime_env"],
             log_to_driver=False)
    rows: list[dict] = []
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        side = ray.remote(_node_side_class())
        prod, cons = (side.options(num_cpus=1, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node, soft=False)).remote(2 * (max(sizes) + 1) * MIB) for node in nodes[:2])
        assert ray.get(prod.node_id.remote()) != ray.get(cons.node_id.remote())
        create_collective_group([prod, cons], backend="torch_gloo")
        kinds = ["ray"] + (["nixl"] if with_nixl and nixl_available() else [])
        for mib in sizes:
            ray.get(prod.make.remote(mib))
            samples: dict[str, list[float]] = {k: [] for k in
                                               kinds + ["ray actor (object store)", "ray RDT gloo"]}
            for i in range(1 + repeats):  # round 0 warms up (connections, pages)
                for kind in kinds:
                    handle = ray.get(prod.put.remote(kind, mib))
                    get_s = ray.get(cons.get.remote(kind, handle))
                    if i:
                        samples[kind].append(handle.put_s + get_s)
                    del handle
                for name, method in (("ray actor (object store)", prod.produce_store),
                                     ("ray RDT gloo", prod.produce_rdt)):
                    start_s = time.perf_counter()
                    assert ray.get(cons.consume.remote(method.remote())) == mib * MIB
                    if i:
                        samples[name].append(time.perf_counter() - start_s)
            for name, values in samples.items():
                t = summarize(values)
                rows.append({"transport": name, "MiB": mib, "GBps": mib * MIB / t.min_s / 1e9,
                             "median_GBps": mib * MIB / t.median_s / 1e9,
                             "min_ms": t.min_s * 1e3})
            print(f"  measured two nodes, {mib} MiB", file=sys.stderr)
        for kind in kinds:  # nothing left behind on the producer
            deadline_s = time.monotonic() + 10
            while ray.get(prod.held.remote(kind)) and time.monotonic() < deadline_s:
                time.sleep(0.05)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


# ---- part 2: layer-wise streaming ----------------------------------------------------
class Receiver:
    """A thread that gets every handle as soon as it is queued (then frees it)."""

    def __init__(self, transport, spec: KVSpec):
        self.transport, self.spec = transport, spec
        self.handles: queue.Queue = queue.Queue()
        self.expected = 0
        self.done = threading.Event()
        self.last_got_s = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        got = 0
        while True:
            handle = self.handles.get()
            if handle is None:
                return
            _, kv = self.transport.get(handle, self.spec, 60.0)
            self.last_got_s = time.perf_counter()
            self.transport.free(handle)
            del kv
            got += 1
            if got == self.expected:
                got = 0
                self.done.set()

    def expect(self, num_chunks: int) -> None:
        self.expected = num_chunks
        self.done.clear()

    def close(self) -> None:
        self.handles.put(None)
        self.thread.join(timeout=10)


def streaming_table(transport_names: list[str], prompt_len: int, repeats: int,
                    layers_per_chunk: int) -> list[dict]:

    loaded = load_model(ModelConfig("smollm2-135m"))
    spec = loaded.kv_spec
    gen = torch.Generator().manual_seed(0)
    num_layers = spec.num_layers
    chunks = [(s, min(s + layers_per_chunk, num_layers))
              for s in range(0, num_layers, layers_per_chunk)]
    sink: dict = {}  # the transport and receiver being measured

    def put_layers(layer: int, batch) -> None:
        for state in batch.requests:  # the step's one prompt
            for start, end in chunks:
                if end == layer + 1:
                    kv = engines["layer"].read_kv_layers(state.request_id, slice(start, end))
                    sink["receiver"].handles.put(
                        sink["transport"].put(state.request_id, spec, kv, layer_start=start))

    # one engine per mode, as a prefill worker's granularity is fixed when it is built
    config = EngineConfig(max_num_seqs=1, max_model_len=prompt_len + 2,
                          max_num_batched_tokens=prompt_len,
                          enable_prefix_caching=False)  # every repeat: the same prompt
    engines = {"whole": Engine(loaded, config),
               "layer": Engine(loaded, config, quiet=True, on_layer_done=put_layers)}
    rows = []
    for name in transport_names:
        if name == "nixl":

            transport = NixlTransport()
        else:
            transport = SharedMemoryTransport() if name == "shm" else InProcessTransport()
        receiver = Receiver(transport, spec)
        sink.update(transport=transport, receiver=receiver)
        results: dict[str, dict[str, list[float]]] = {}
        try:
            for mode, engine in engines.items():
                prefill, exposed = [], []
                for i in range(1 + repeats):
                    request = random_request(gen, loaded, prompt_len, 2)
                    rid = request.request_id
                    engine.add_request(request, prefill_only=True)
                    receiver.expect(1 if mode == "whole" else len(chunks))
                    start_s = time.perf_counter()
                    engine.step()
                    end_s = time.perf_counter()
                    if mode == "whole":
                        kv, _ = engine.export_kv(rid)
                        receiver.handles.put(transport.put(rid, spec, kv))
                    else:
                        engine.finish_prefilled(rid)
                    if not receiver.done.wait(60):
                        raise RuntimeError("receiver did not get every chunk")
                    if i:
                        prefill.append(end_s - start_s)
                        exposed.append(max(0.0, receiver.last_got_s - end_s))
                results[mode] = {"prefill": prefill, "exposed": exposed}
        finally:
            receiver.close()
        if transport.num_held():
            raise RuntimeError(f"{name} still holds {transport.num_held()} transfers")
        whole, layer = (summarize(results[m]["exposed"]) for m in ("whole", "layer"))
        pw, pl = (summarize(results[m]["prefill"]) for m in ("whole", "layer"))
        for mode, exp, pre in (("whole", whole, pw), ("layer", layer, pl)):
            rows.append({"transport": name, "mode": mode,
                         "chunks": 1 if mode == "whole" else len(chunks),
                         "prefill_ms": pre.min_s * 1e3, "prefill_median_ms": pre.median_s * 1e3,
                         "exposed_ms": exp.min_s * 1e3, "exposed_median_ms": exp.median_s * 1e3,
                         "exposed_over_whole": exp.min_s / whole.min_s,
                         "exposed_median_over_whole": exp.median_s / whole.median_s,
                         "lengthening_ms": (pre.min_s - pw.min_s) * 1e3})
    return rows


# ---- output --------------------------------------------------------------------------
def markdown(rows: list[dict], columns: list[str]) -> str:
    def fmt(v) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_transfer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1, 16, 64 MiB, 3 runs, no torchdist; streaming 3 runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray object store")
    parser.add_argument("--no-torchdist", action="store_true", help="skip gloo")
    parser.add_argument("--no-streaming", action="store_true", help="skip part 2 (SmolLM2)")
    parser.add_argument("--no-nixl", action="store_true", help="skip the nixl rows")
    parser.add_argument("--no-two-nodes", action="store_true",
                        help="skip part 3 (two Ray nodes: ray vs nixl, object store vs RDT)")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--layers-per-chunk", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write CSVs here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    sizes = list(QUICK_SIZES_MIB if args.quick else SIZES_MIB)

    print(f"# KV transfer bandwidth (torch threads {args.threads}, min of {repeats} runs)",
          file=sys.stderr)
    parts = {int(p) for p in args.parts.split(",")}
    rows: list[dict] = []
    if 1 in parts:
        rows = bandwidth_table(sizes, repeats, args.threads, not args.no_ray,
                               not (args.no_torchdist or args.quick), not args.no_nixl)
        print(f"## Bandwidth: GB/s = bytes / (put_s + get_s), min of {repeats} runs; "
              f"torch threads {args.threads}; x_memcpy_here: against a memcpy timed in the "
              "same process, interleaved round by round\n")
        print(markdown(rows, ["transport", "MiB", "GBps", "median_GBps", "x_memcpy",
                              "x_memcpy_here", "min_ms", "where"]))

        def holds(name: str, ratio: float, column: str = "x_memcpy_here") -> str:
            got = [r[column] for r in rows if r["transport"] == name and r["MiB"] >= 16]
            return "n/a" if not got else (
                f"{'holds' if min(got) >= ratio else 'misses'} (min {min(got):.2f}x)")

        print(f"\nTarget (shm, checksum on, >= 16 MiB at >= 0.5x memcpy): {holds('shm', 0.5)}; "
              f"with checksum off: {holds('shm nocrc', 0.5)}")
        print(f"Target (nixl, >= 16 MiB whole-request at >= 0.8x memcpy): put + get with "
              f"checksum {holds('nixl', 0.8)}, without {holds('nixl nocrc', 0.8)}, the READ "
              f"alone {holds('nixl READ', 0.8)}; layer-wise at >= 0.5x: "
              f"{holds('nixl layer', 0.5)}")
    node_rows: list[dict] = []
    if 3 in parts and not args.no_two_nodes and not args.no_ray:
        print("# two Ray nodes", file=sys.stderr)
        node_rows = two_node_table(sizes, repeats, not args.no_nixl)
        print(f"\n## Two Ray nodes on this machine (ray.cluster_utils.Cluster, one actor per "
              f"node), interleaved, min (and median) of {repeats} runs\n")
        print(markdown(node_rows, ["transport", "MiB", "GBps", "median_GBps", "min_ms"]))
        by = {(r["transport"], r["MiB"]): r["GBps"] for r in node_rows}
        if any(t == "nixl" for t, _ in by):
            wins = all(by[("nixl", m)] > by[("ray", m)] for m in sizes if m >= 1)
            print(f"\nTarget (nixl beats ray across two nodes at every size >= 1 MiB): "
                  f"{'holds' if wins else 'misses'} ("
                  + ", ".join(f"{m} MiB {by[('nixl', m)] / by[('ray', m)]:.1f}x" for m in sizes)
                  + ")")
        rdt = [by[("ray RDT gloo", m)] / by[("ray actor (object store)", m)] for m in sizes]
        print("Ray Direct Transport (gloo) / object store, actor to actor: "
              + ", ".join(f"{m} MiB {x:.2f}x" for m, x in zip(sizes, rdt)))
    stream_rows = []
    if 2 in parts and not args.no_streaming:
        print("# layer-wise streaming (SmolLM2-135M)", file=sys.stderr)

        names = ["shm"] + (["nixl"] if nixl_available() and not args.no_nixl else []) + [
            "inprocess"]
        stream_rows = streaming_table(names, args.prompt_len, repeats, args.layers_per_chunk)
        print(f"\n## Layer-wise streaming: SmolLM2-135M, {args.prompt_len}-token prompt, "
              f"{args.layers_per_chunk} layer(s) per chunk, min (and median) of {repeats} runs\n")
        print(markdown(stream_rows, ["transport", "mode", "chunks", "prefill_ms",
                                     "prefill_median_ms", "exposed_ms", "exposed_median_ms",
                                     "exposed_over_whole", "exposed_median_over_whole",
                                     "lengthening_ms"]))
        for r in stream_rows:
            if r["mode"] == "layer":
                print(f"{r['transport']}: layer-wise exposes {r['exposed_over_whole']:.0%} of the "
                      f"whole-request transfer time (target <= 20%: "
                      f"{'holds' if r['exposed_over_whole'] <= 0.2 else 'misses'}); prefill "
                      f"lengthened by {r['lengthening_ms']:.1f} ms")
    if args.out is not None:

        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out / "kv_bandwidth.csv", index=False)
        if node_rows:
            pd.DataFrame(node_rows).to_csv(args.out / "kv_two_nodes.csv", index=False)
        if stream_rows:
            pd.DataFrame(stream_rows).to_csv(args.out / "kv_streaming.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
