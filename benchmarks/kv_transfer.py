"""KV-transfer benchmark: GB/s of every transport against memcpy, and layer-wise streaming.

Run: ``python -m benchmarks.kv_transfer`` (``--quick`` for a small run, ``--out DIR`` to
also write CSVs). Everything is measured in one run, side by side; every time is the min of
N timed runs after one warm-up (``experiments.timing``), the median is shown too.

Part 1, bandwidth. A KV tensor of 1, 16, 64 and 256 MiB (bf16, ``[L=16, 2, H_kv=8, T, D=128]``,
T = 16..4096 tokens) is moved by each transport; GB/s = bytes / (put_s + get_s) (free is
untimed). Checksums as served (CRC-32C on put, verified on get) unless the row says
``nocrc``. Rows:

- ``memcpy``: ``dst.copy_(kv)`` into a preallocated tensor (the floor);
- ``inprocess``: put + get in this process (one copy on put, get is zero-copy);
- ``shm``: ``SharedMemoryTransport`` between **two processes**: the sender's put_s (copy
  into its arena slot) + the receiver's get_s (map, check, checksum, zero-copy view);
  measured in each process, the handle crosses a queue untimed;
- ``shm copy-out``: the same with ``zero_copy=False`` (get copies into a fresh tensor);
- ``ray``: ``ray.put`` + ``ray.get`` in this (driver) process through the local object
  store (no actor);
- ``torchdist``: gloo point-to-point between two spawned processes (sender put_s +
  receiver get_s).

The target is the best intra-node transport at >= 0.5x memcpy for 16 MiB and up. torch runs
with ``--threads`` intra-op threads (default 1: a transfer runs on one worker thread, and
the CRC is single-threaded) in every process, memcpy included.

Part 2, layer-wise streaming (SmolLM2-135M, one 512-token prompt, fp32 KV = 23.6 MB).
The prefill runs as ``PrefillWorker`` runs it: one ``Engine.step`` (the whole prompt in one
step); whole-request: after the step ``export_kv`` + one put; layer-wise: the engine's layer
listener (``Engine(on_layer_done=...)``) puts each layer (``read_kv_layers`` + put) while
the next layer computes. A receiver thread in the same process gets each handle as soon as
it is put (it waits on a queue the puts feed) and frees it after. Measured per run:

- ``prefill_s``: the step's wall time (the hook's puts included for layer-wise);
- ``exposed_s``: from the step's end until the receiver has returned from the get of the
  last chunk (0 if that happened before the step ended); for whole-request that is export
  + put + get;
- ``lengthening_s``: layer-wise prefill_s minus the whole-request prefill_s (min vs min).

Target: layer-wise exposed_s <= 20% of the whole-request exposed_s.
"""

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

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVSpec
from engine.model import load_model
from experiments.measure import random_request
from experiments.timing import Timing, measure, summarize
from experiments.transfer_cost import time_torchdist
from kv_transfer.inprocess import InProcessTransport
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


def _shm_side(role: str, sizes: list[int], repeats: int, checksum: bool, zero_copy: bool,
              threads: int, handle_q, ack_q, result_q) -> None:
    """One process of the two-process shm measurement: ``put`` side or ``get`` side."""

    torch.set_num_threads(threads)
    transport = SharedMemoryTransport(checksum=checksum, capacity_bytes=(max(sizes) + 1) * MIB,
                                      zero_copy=zero_copy)
    for mib in sizes:
        if role == "put":
            kv = kv_of(mib)
            samples = []
            for i in range(1 + repeats):
                start_s = time.perf_counter()
                handle = transport.put("bench", SPEC, kv)
                put_s = time.perf_counter() - start_s
                handle_q.put(handle)
                get_s = ack_q.get(timeout=300)
                if i:
                    samples.append(put_s + get_s)
            result_q.put(samples)
        else:
            for _ in range(1 + repeats):
                handle = handle_q.get(timeout=300)
                start_s = time.perf_counter()
                _, out = transport.get(handle, SPEC, 60.0)
                get_s = time.perf_counter() - start_s
                transport.free(handle)
                del out  # releases the slot (zero-copy lease)
                ack_q.put(get_s)
    if role == "put":
        deadline_s = time.monotonic() + 10  # keep the segment open until every slot is back
        while transport.num_held() and time.monotonic() < deadline_s:
            time.sleep(0.01)
    transport.close()


def time_shm(sizes: list[int], repeats: int, checksum: bool, zero_copy: bool,
             threads: int) -> list[Timing]:
    # the spawned child finds the target by module name even when this runs as __main__ (-m)
    side = importlib.import_module("benchmarks.kv_transfer")._shm_side
    ctx = mp.get_context("spawn")
    handle_q, ack_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    args = (sizes, repeats, checksum, zero_copy, threads, handle_q, ack_q, result_q)
    procs = [ctx.Process(target=side, args=(role, *args), daemon=True)
             for role in ("put", "get")]
    for proc in procs:
        proc.start()
    try:
        return [summarize(result_q.get(timeout=600)) for _ in sizes]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def bandwidth_table(sizes: list[int], repeats: int, threads: int, with_ray: bool,
                    with_torchdist: bool) -> list[dict]:
    rows: list[dict] = []
    memcpy: dict[int, Timing] = {}

    def add(name: str, where: str, mib: int, t: Timing) -> None:
        nbytes = mib * MIB
        rows.append({"transport": name, "MiB": mib, "GBps": nbytes / t.min_s / 1e9,
                     "median_GBps": nbytes / t.median_s / 1e9,
                     "x_memcpy": memcpy[mib].min_s / t.min_s, "min_ms": t.min_s * 1e3,
                     "where": where})

    ray_transport = None
    if with_ray:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
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
    for name, checksum, zero_copy, where in [
            ("shm", True, True, "2 processes: put_s + get_s (zero-copy view)"),
            ("shm nocrc", False, True, "2 processes, no checksum"),
            ("shm copy-out", True, False, "2 processes, get copies into a fresh tensor")]:
        for mib, t in zip(sizes, time_shm(sizes, repeats, checksum, zero_copy, threads)):
            add(name, where, mib, t)
        print(f"  measured {name}", file=sys.stderr)
    if with_torchdist:
        jobs = [(mib * MIB // SPEC.bytes_per_token, [(0, SPEC.num_layers)]) for mib in sizes]
        for mib, t in zip(sizes, time_torchdist(SPEC, jobs, repeats)):
            add("torchdist", "gloo, 2 processes: put_s + get_s", mib, t)
        print("  measured torchdist", file=sys.stderr)
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
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--layers-per-chunk", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write CSVs here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    sizes = list(QUICK_SIZES_MIB if args.quick else SIZES_MIB)

    print(f"# KV transfer bandwidth (torch threads {args.threads}, min of {repeats} runs)",
          file=sys.stderr)
    rows = bandwidth_table(sizes, repeats, args.threads, not args.no_ray,
                           not (args.no_torchdist or args.quick))
    print(f"## Bandwidth: GB/s = bytes / (put_s + get_s), min of {repeats} runs; "
          f"torch threads {args.threads}\n")
    print(markdown(rows, ["transport", "MiB", "GBps", "median_GBps", "x_memcpy", "min_ms",
                          "where"]))
    shm_ok = all(r["x_memcpy"] >= 0.5 for r in rows if r["transport"] == "shm" and r["MiB"] >= 16)
    nocrc_ok = all(r["x_memcpy"] >= 0.5 for r in rows
                   if r["transport"] == "shm nocrc" and r["MiB"] >= 16)
    print(f"\nTarget (shm, checksum on, >= 16 MiB at >= 0.5x memcpy): "
          f"{'holds' if shm_ok else 'misses'}; with checksum off: "
          f"{'holds' if nocrc_ok else 'misses'}")
    stream_rows = []
    if not args.no_streaming:
        print("# layer-wise streaming (SmolLM2-135M)", file=sys.stderr)
        stream_rows = streaming_table(["shm", "inprocess"], args.prompt_len, repeats,
                                      args.layers_per_chunk)
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
        if stream_rows:
            pd.DataFrame(stream_rows).to_csv(args.out / "kv_streaming.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
