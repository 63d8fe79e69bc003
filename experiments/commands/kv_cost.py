"""``pdlab kv-cost``: what moving a prompt's KV costs next to computing it, per transport.

For each prompt length T:

1. Prefill seconds: the engine step that prefills T tokens whole (``profile.time_prefill``).
2. The prompt's real KV: a prefill-only request is run and its KV exported
   (``Engine.export_kv``, ``[L, 2, H_kv, T, D]``); its bytes must equal ``kv_spec.kv_bytes(T)``
   and ``2 * layers * kv_heads * head_dim * T * itemsize`` (else the run stops with an error).
3. memcpy floor: ``dst.copy_(kv)`` into a preallocated tensor of the same bytes.
4. Each transport moves that KV, **whole** (one put + one get) and **layer-wise** (one put per
   range of ``layers_per_chunk`` layers, then one get per range; seconds of all chunks
   together). A run is put + get (free is untimed). Where the two sides run:
   - ``inprocess``: put and get in this process;
   - ``ray``: put and get in this (driver) process through the local shared-memory object
     store (no actor: actors are created only by ``experiments/placement.py``); objects under
     Ray's 100 KiB inline limit never touch the store;
   - ``torchdist``: gloo between two spawned processes on this host; the sender's put_s plus
     the receiver's get_s (measured in each process; the handle crosses a queue, untimed).
5. Ratios: transfer / prefill and transfer / memcpy.

Every time is ``experiments.timing``'s estimator: min of N runs after 1 warm-up, median shown.
Outputs: kv_cost.csv and kv_cost.png (transfer and prefill seconds vs T, log-log).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from engine.config import TRANSPORTS, EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVSpec
from engine.model import LoadedModel
from experiments.commands import profile
from experiments.timing import Timing, describe, device_sync, measure, summarize

DEFAULT_PROMPT_LENS = (16, 64, 128, 256, 512)
DEFAULT_TRANSPORTS = ("inprocess", "ray")
WHERE = {
    "inprocess": "put+get in one process",
    "ray": "put+get in the driver (local object store, no actor)",
    "torchdist": "gloo, 2 processes: sender put_s + receiver get_s",
    "shm": "put+get in one process through its shared-memory arena (zero-copy get)",
}


def layer_chunks(num_layers: int, layers_per_chunk: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer ranges of ``layers_per_chunk`` layers (the last may be shorter)."""
    return [(s, min(s + layers_per_chunk, num_layers)) for s in range(0, num_layers, layers_per_chunk)]


def export_prompt_kv(loaded: LoadedModel, prompt_len: int, device: str = "cpu",
                     seed: int = 0) -> torch.Tensor:
    """Prefill a random ``prompt_len``-token prompt (prefill only) and export its KV
    ``[L, 2, H_kv, T, D]``, checking its bytes against the KV formula.

    Raises:
        RuntimeError: the exported bytes differ from ``kv_spec.kv_bytes(T)`` or the formula.
    """
    engine = Engine(loaded, EngineConfig(max_num_seqs=1, max_model_len=prompt_len + 2,
                                         max_num_batched_tokens=max(prompt_len, 1), device=device))
    gen = torch.Generator().manual_seed(seed)
    request = profile._request(gen, profile._vocab(loaded), prompt_len, max_tokens=2)
    engine.add_request(request, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    kv, _ = engine.export_kv(request.request_id)
    spec = loaded.kv_spec
    got = kv.numel() * kv.element_size()
    formula = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * prompt_len * spec.itemsize
    if not got == spec.kv_bytes(prompt_len) == formula:
        raise RuntimeError(f"KV of {prompt_len} tokens is {got} bytes; kv_spec.kv_bytes gives "
                           f"{spec.kv_bytes(prompt_len)}, the formula {formula}")
    return kv


def time_memcpy(kv: torch.Tensor, repeats: int) -> Timing:
    """``dst.copy_(kv)`` into a preallocated tensor on the same device."""
    dst = torch.empty_like(kv)
    return measure(lambda: dst.copy_(kv), repeats, sync=device_sync(str(kv.device)))


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

    timing = measure(run, repeats, teardown=teardown)
    if transport.num_held():
        raise RuntimeError(f"{transport.name} still holds {transport.num_held()} transfers")
    return timing


# ---- torch.distributed (two processes) -------------------------------------------------
def _torchdist_rank(rank: int, init_method: str, spec_dict: dict, jobs: list, repeats: int,
                    checksum: bool, handle_q, ack_q, result_q) -> None:
    """One rank of the gloo measurement: rank 0 puts, rank 1 gets (see module docstring)."""
    from kv_transfer.torchdist import TorchDistributedTransport

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
    import torch.multiprocessing as mp

    from kv_transfer.torchdist import open_rendezvous

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


# ---- the table -------------------------------------------------------------------------
def _make_transport(name: str, checksum: bool):
    """A transport for put and get in this process (the driver), built by the factory."""
    from engine.config import TransferConfig
    from kv_transfer.factory import make_transport

    if name == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
    return make_transport(TransferConfig(transport=name, checksum=checksum))


def kv_cost_table(loaded: LoadedModel, prompt_lens: Sequence[int] = DEFAULT_PROMPT_LENS,
                  transports: Sequence[str] = ("inprocess",), repeats: int = 5,
                  layers_per_chunk: int = 1, device: str = "cpu", seed: int = 0,
                  checksum: bool = True, progress=None) -> pd.DataFrame:
    """Measure the module docstring's table.

    Returns:
        One row per (prompt length, transport, mode): ``prompt_len, kv_bytes, prefill_s,
        memcpy_s, memcpy_GBps, transport, mode`` (whole | layer), ``num_chunks, transfer_s``
        (min), ``transfer_median_s, transfer_GBps, transfer_over_prefill,
        transfer_over_memcpy, where``.
    """
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"transports must be among {TRANSPORTS}, got {unknown}")
    spec = loaded.kv_spec
    modes = {"whole": layer_chunks(spec.num_layers, spec.num_layers),
             "layer": layer_chunks(spec.num_layers, layers_per_chunk)}
    prefill = profile.profile_prefill(loaded, prompt_lens, repeats, device, seed)
    live = {name: _make_transport(name, checksum) for name in transports if name != "torchdist"}
    base_rows, rows = [], []
    for p, prefill_s in zip(prefill["prompt_len"], prefill["prefill_s"]):
        kv = export_prompt_kv(loaded, int(p), device, seed + int(p))
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
    if "torchdist" in transports:
        jobs = [(b["prompt_len"], chunks) for b in base_rows for chunks in modes.values()]
        timings = iter(time_torchdist(spec, jobs, repeats, checksum))
        for base in base_rows:
            for mode, chunks in modes.items():
                rows.append(_row(base, "torchdist", mode, chunks, next(timings)))
    order = {name: i for i, name in enumerate(transports)}
    df = pd.DataFrame(rows)
    return df.sort_values(["prompt_len", "transport", "mode"],
                          key=lambda c: c.map(order) if c.name == "transport" else c,
                          ignore_index=True)


def _row(base: dict, transport: str, mode: str, chunks, t: Timing) -> dict:
    return {**base, "transport": transport, "mode": mode, "num_chunks": len(chunks),
            "transfer_s": t.min_s, "transfer_median_s": t.median_s,
            "transfer_GBps": base["kv_bytes"] / t.min_s / 1e9,
            "transfer_over_prefill": t.min_s / base["prefill_s"],
            "transfer_over_memcpy": t.min_s / base["memcpy_s"], "where": WHERE[transport]}


def plot_kv_cost(df: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    first = df.drop_duplicates("prompt_len")
    ax.plot(first["prompt_len"], first["prefill_s"], "k-o", label="prefill")
    ax.plot(first["prompt_len"], first["memcpy_s"], "k:", label="memcpy (floor)")
    for (transport, mode), group in df.groupby(["transport", "mode"], sort=False):
        ax.plot(group["prompt_len"], group["transfer_s"], "--" if mode == "layer" else "-",
                marker=".", label=f"{transport} ({mode})")
    ax.set(xscale="log", yscale="log", xlabel="prompt length T (tokens)", ylabel="seconds",
           title="KV transfer vs prefill")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI -------------------------------------------------------------------------------
def transport_list(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated transport names."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TRANSPORTS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"must be a comma-separated list of distinct transports from {', '.join(TRANSPORTS)}, "
            f"got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab kv-cost``."""
    profile.add_common_arguments(parser, "kv-cost")
    parser.add_argument("--prompt-lens", type=profile.int_list, default=DEFAULT_PROMPT_LENS,
                        help="prompt lengths T (default: 16,64,128,256,512)")
    parser.add_argument("--transports", type=transport_list, default=DEFAULT_TRANSPORTS,
                        help=f"from {','.join(TRANSPORTS)}; torchdist spawns two gloo processes "
                             "(default: inprocess,ray)")
    parser.add_argument("--layers-per-chunk", type=profile.positive_int, default=1,
                        help="layers per layer-wise message (default: 1)")
    parser.add_argument("--checksum", default=True, action=argparse.BooleanOptionalAction,
                        help="CRC32 in every transfer, as served (default: on)")


def check_arguments(args: argparse.Namespace, model) -> None:
    """``pdlab kv-cost`` options joined to the device and the model's context (read from its
    config file: no weights), checked before the model loads.

    Raises:
        ValueError: ``argument --x: ...`` for the first bad option.
    """
    from engine.model import model_context_len

    profile.check_device(args.device)
    limit = model_context_len(model)
    if limit is not None and not any(p + 2 <= limit for p in args.prompt_lens):
        raise ValueError(f"argument --prompt-lens: no length fits the context of model "
                         f"{model.model} ({limit} tokens, 2 of them kept for decoding)")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    loaded = profile.load_for(args)
    if loaded is None:
        return 2
    limit = loaded.max_context_len
    prompt_lens = [p for p in args.prompt_lens if p + 2 <= limit]
    if len(prompt_lens) < len(args.prompt_lens):
        print(f"note: dropped prompt lengths over the model context ({limit}): "
              f"{[p for p in args.prompt_lens if p + 2 > limit]}")
    if not prompt_lens:
        print("error: --prompt-lens: no length fits the model context", file=sys.stderr)
        return 2
    try:
        with tqdm(total=len(prompt_lens), desc="kv-cost", unit="T", file=sys.stderr) as bar:
            df = kv_cost_table(loaded, prompt_lens, args.transports, args.repeats,
                               args.layers_per_chunk, args.device, args.seed, args.checksum, bar)
    finally:
        if "ray" in args.transports:
            import ray

            ray.shutdown()
    out = profile.out_dir(args, "kv-cost")
    header = profile.run_header(loaded, args)
    df.to_csv(out / "kv_cost.csv", index=False)
    plot_kv_cost(df, out / "kv_cost.png", f"{header}; {describe(args.repeats)}")
    spec = loaded.kv_spec
    print(f"{header}\nestimator: {describe(args.repeats)}")
    print(f"KV geometry: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x head_dim "
          f"{spec.head_dim} x {spec.itemsize} B = {spec.bytes_per_token} bytes/token; "
          f"layer-wise = {args.layers_per_chunk} layer(s) per message; "
          f"checksum {'on' if args.checksum else 'off'}")
    for name in args.transports:
        print(f"  {name}: {WHERE[name]}")
    floor = df.drop_duplicates("prompt_len")[["prompt_len", "kv_bytes", "prefill_s", "memcpy_s",
                                               "memcpy_GBps"]]
    print("\nprefill and memcpy floor:\n" + floor.to_string(index=False))
    cols = ["prompt_len", "transport", "mode", "num_chunks", "transfer_s", "transfer_median_s",
            "transfer_GBps", "transfer_over_prefill", "transfer_over_memcpy"]
    print("\ntransfers:\n" + df[cols].to_string(index=False))
    print(f"\nwrote {out}/: kv_cost.csv kv_cost.png")
    return 0
