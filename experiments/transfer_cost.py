"""What moving a prompt's KV costs, per transport (``pdlab kv-cost``'s table, and the
transfer models ``pdlab profile`` fits on it). For each prompt length T:

1. Prefill seconds: the engine step that prefills T tokens whole (``measure.time_prefill``).
2. The prompt's real KV (``Engine.export_kv``, ``[L, 2, H_kv, T, D]``); its bytes must equal
   ``kv_spec.kv_bytes(T)`` = ``2 * layers * kv_heads * head_dim * T * itemsize``, else an error.
3. memcpy floor: ``dst.copy_(kv)`` into a preallocated tensor of the same bytes.
4. Each transport moves it whole and layer-wise (per ``layers_per_chunk`` layers); a run is
   put + get. ``inprocess`` and ``ray`` run in this process; ``torchdist`` between two spawned
   gloo processes (sender's put_s plus receiver's get_s).
5. Ratios: transfer / prefill and transfer / memcpy; efficiency: GB/s over the link peak
   (``kv_transfer.link.memcpy_peak``, the peak every ``TransferRecord.efficiency`` uses).

Times: ``experiments.timing``'s min of N runs after 1 warm-up, the median beside it. On an
emulated device prefill seconds are the profile's (``measure.modelled_prefill``), the KV is the
emulated geometry scaled by ``kv_scale`` (``true_kv_bytes`` unscaled) moved for real, and
``modelled_transfer_s`` is the profile's transfer model at ``true_kv_bytes`` (NaN without one)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pandas as pd
import torch
import torch.multiprocessing as mp

from engine.config import TRANSPORTS, EngineConfig, TransferConfig
from engine.emulated import Emulation
from engine.engine import Engine
from engine.kv_cache import KVSpec
from engine.model import LoadedModel
from experiments import measure
from deployment.ray_actors import driver_ray
from experiments.timing import Timing, device_sync, measure as time_runs, summarize
from kv_transfer.factory import make_transport
from kv_transfer.link import memcpy_peak
from kv_transfer.torchdist import TorchDistributedTransport, open_rendezvous

DEFAULT_PROMPT_LENS = (16, 64, 128, 256, 512)


WHERE = {
    "inprocess": "put+get in one process",
    "ray": "put+get in the driver (local object store, no actor)",
    "torchdist": "gloo, 2 processes: sender put_s + receiver get_s",
    "shm": "put+get in one process through its shared-memory arena (zero-copy get)",
    "nixl": "put+get in one process: a NIXL READ of its own registered arena (UCX)",
}


def layer_chunks(num_layers: int, layers_per_chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer ranges of ``layers_per_chunk`` layers (the last may be shorter)."""
    return [(s, min(s + layers_per_chunk, num_layers)) for s in range(0, num_layers, layers_per_chunk)]


def export_prompt_kv(loaded: LoadedModel, prompt_len: int, device: str = "cpu",
                     seed: int = 0, emulation: Emulation | None = None) -> torch.Tensor:
    """Prefill a random ``prompt_len``-token prompt (prefill only) and export its KV ``[L, 2, H_kv,
    T, D]``, checking its bytes against the KV formula of the engine's ``kv_spec`` (on
    ``emulation``'s device: the scaled geometry the store holds).

    Raises:
        RuntimeError: the exported bytes differ from ``kv_spec.kv_bytes(T)`` or the formula."""
    engine = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=prompt_len + 2,
                                         max_num_batched_tokens=max(prompt_len, 1), device=device),
                    quiet=emulation is not None, emulation=emulation)
    gen = torch.Generator().manual_seed(seed)
    request = measure.random_request(gen, loaded, prompt_len, max_tokens=2)
    engine.add_request(request, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    kv, _ = engine.export_kv(request.request_id)
    spec = engine.kv_spec
    got = kv.numel() * kv.element_size()
    formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * prompt_len * spec.itemsize
    if not got == spec.kv_bytes(prompt_len) == formula:
        raise RuntimeError(f"KV of {prompt_len} tokens is {got} bytes; kv_spec.kv_bytes gives "
                           f"{spec.kv_bytes(prompt_len)}, the formula {formula}")
    return kv


def time_memcpy(kv: torch.Tensor, repeats: int) -> Timing:
    """``dst.copy_(kv)`` into a preallocated tensor on the same device."""
    dst = torch.empty_like(kv)
    return time_runs(lambda: dst.copy_(kv), repeats, sync=device_sync(str(kv.device)))


def time_transfer(transport, spec: KVSpec, kv: torch.Tensor, repeats: int,
                  chunks: Sequence[tuple[int, int]], timeout_s: float = 60.0) -> Timing:
    """Put every layer range of ``kv`` then get every one back (timed), then free (untimed)."""
    handles: list = []

    def run() -> None:
        handles.extend(transport.put("kv-cost", spec, kv[a:b], layer_start=a) for a, b in chunks)
        for handle in handles:
            transport.get(handle, spec, timeout_s)

    def teardown() -> None:
        for handle in handles:
            transport.free(handle)
        handles.clear()

    timing = time_runs(run, repeats, teardown=teardown)
    if transport.num_held():
        raise RuntimeError(f"{transport.name} still holds {transport.num_held()} transfers")
    return timing


def _torchdist_rank(rank: int, init_method: str, spec_dict: dict, jobs: list, repeats: int,
                    checksum: bool, handle_q, ack_q, result_q) -> None:
    """One rank of the gloo measurement: rank 0 puts, rank 1 gets (see module docstring)."""
    torch.set_num_threads(1)
    spec = KVSpec(**spec_dict)
    transport = TorchDistributedTransport(rank, 2, "gloo", init_method=init_method, dst_rank=1,
                                          checksum=checksum)
    try:
        for prompt_len, chunks in jobs:
            if rank == 0:
                kv = torch.randn(spec.kv_shape(prompt_len)).to(spec.torch_dtype)
                samples = []
                for i in range(1 + repeats):  # 1 warm-up
                    start_s = time.perf_counter()
                    handles = [transport.put("kv-cost", spec, kv[a:b], layer_start=a)
                               for a, b in chunks]
                    put_s = time.perf_counter() - start_s
                    handle_q.put(handles)
                    get_s = ack_q.get(timeout=300)
                    if i >= 1:
                        samples.append(put_s + get_s)
                result_q.put(samples)
            else:
                for _ in range(1 + repeats):
                    handles = handle_q.get(timeout=300)
                    start_s = time.perf_counter()
                    for handle in handles:
                        transport.get(handle, spec, 60.0)
                    ack_q.put(time.perf_counter() - start_s)
                    for handle in handles:
                        transport.free(handle)
    finally:
        transport.close()


def time_torchdist(spec: KVSpec, jobs: list[tuple[int, list[tuple[int, int]]]], repeats: int,
                   checksum: bool = True, timeout_s: float = 600.0) -> list[Timing]:
    """Run every ``(prompt_len, chunks)`` job through gloo between two spawned processes;
    returns one Timing per job (random KV of the right shape: bytes, not values, matter)."""
    ctx = mp.get_context("spawn")
    handle_q, ack_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    store, init_method = open_rendezvous()  # held here while the two ranks live
    args = (init_method, spec.to_dict(), jobs, repeats, checksum, handle_q, ack_q, result_q)
    procs = [ctx.Process(target=_torchdist_rank, args=(rank, *args), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        return [summarize(result_q.get(timeout=timeout_s)) for _ in jobs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def kv_cost_table(loaded: LoadedModel, prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
                  transports: Sequence[str] = ("inprocess",), repeats: int = 5,
                  layers_per_chunk: int = 1, device: str = "cpu", seed: int = 0,
                  checksum: bool = True, progress=None,
                  emulation: Emulation | None = None) -> pd.DataFrame:
    """Measure the module docstring's table (on ``emulation``'s device when given; then ``device``
    must be ``cpu``, where its KV lives).

    Returns:
        One row per (prompt length, transport, mode): ``prompt_len, kv_bytes, prefill_s,
        memcpy_s, memcpy_GBps, transport, mode`` (whole | layer), ``num_chunks, transfer_s``
        (min), ``transfer_median_s, transfer_GBps, transfer_over_prefill,
        transfer_over_memcpy, peak_GBps, efficiency, where, emulated``; emulated also
        ``kv_scale, true_kv_bytes, modelled_transfer_s``."""
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"transports must be among {TRANSPORTS}, got {unknown}")
    if emulation is not None and device != "cpu":
        raise ValueError(f"an emulated device's KV lives on cpu, not {device}")
    spec = loaded.kv_spec if emulation is None else emulation.scaled_spec(loaded.kv_spec)
    modes = {"whole": layer_chunks(spec.num_layers, spec.num_layers),
             "layer": layer_chunks(spec.num_layers, layers_per_chunk)}
    prefill = (measure.profile_prefill(loaded, prompt_lens, repeats, device, seed)
               if emulation is None else
               measure.modelled_prefill(loaded, emulation, prompt_lens, seed))
    peak_gbps = memcpy_peak(device=device).gbps
    with driver_ray("ray" in transports):  # ray: put and get through this process's store
        live = {name: make_transport(TransferConfig(transport=name, checksum=checksum))
                for name in transports if name != "torchdist"}
        base_rows, rows = _in_process_rows(loaded, prefill, live, modes, repeats, device, seed,
                                           progress, emulation)
    if "torchdist" in transports:
        jobs = [(b["prompt_len"], chunks) for b in base_rows for chunks in modes.values()]
        timings = iter(time_torchdist(spec, jobs, repeats, checksum))
        for base in base_rows:
            for mode, chunks in modes.items():
                rows.append(_row(base, "torchdist", mode, chunks, next(timings)))
    order = {name: i for i, name in enumerate(transports)}
    df = pd.DataFrame(rows)
    df["peak_GBps"] = peak_gbps
    df["efficiency"] = df["transfer_GBps"] / peak_gbps
    df["emulated"] = emulation is not None
    if emulation is not None:
        df["kv_scale"] = emulation.kv_scale
        df["true_kv_bytes"] = df["prompt_len"].map(loaded.kv_spec.kv_bytes)
        df["modelled_transfer_s"] = [_modelled_transfer_s(emulation, t, b) for t, b in
                                     zip(df["transport"], df["true_kv_bytes"])]
    return df.sort_values(["prompt_len", "transport", "mode"],
                          key=lambda c: c.map(order) if c.name == "transport" else c,
                          ignore_index=True)


def _modelled_transfer_s(emulation: Emulation, transport: str, num_bytes: int) -> float:
    """The device profile's transfer seconds of ``num_bytes`` over ``transport`` (NaN where
    the profile has no model for it)."""
    model = emulation.device.transfers.get(transport)
    return math.nan if model is None else model.seconds(int(num_bytes))


def _in_process_rows(loaded, prefill, live, modes, repeats, device, seed, progress,
                     emulation=None):
    spec = loaded.kv_spec if emulation is None else emulation.scaled_spec(loaded.kv_spec)
    base_rows, rows = [], []
    for p, prefill_s in zip(prefill["prompt_len"], prefill["prefill_s"]):
        kv = export_prompt_kv(loaded, int(p), device, seed + int(p), emulation)
        memcpy = time_memcpy(kv, repeats)
        nbytes = kv.numel() * kv.element_size()
        base = {"prompt_len": int(p), "kv_bytes": nbytes, "prefill_s": float(prefill_s),
                "memcpy_s": memcpy.min_s, "memcpy_GBps": nbytes / memcpy.min_s / 1e9}
        base_rows.append(base)
        for name, transport in live.items():
            for mode, chunks in modes.items():
                rows.append(_row(base, name, mode, chunks,
                                 time_transfer(transport, spec, kv, repeats, chunks)))
        if progress is not None:
            progress.update(1)
    return base_rows, rows


def _row(base: dict, transport: str, mode: str, chunks, t: Timing) -> dict:
    return {**base, "transport": transport, "mode": mode, "num_chunks": len(chunks),
            "transfer_s": t.min_s, "transfer_median_s": t.median_s,
            "transfer_GBps": base["kv_bytes"] / t.min_s / 1e9,
            "transfer_over_prefill": t.min_s / base["prefill_s"],
            "transfer_over_memcpy": t.min_s / base["memcpy_s"], "where": WHERE[transport]}
