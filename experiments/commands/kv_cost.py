"""``pdlab kv-cost``: what moving a prompt's KV costs next to computing it, per transport (the
table and how each row is measured: ``experiments.transfer_cost``). Outputs: kv_cost.csv and
kv_cost.png. On an emulated device (``--device emu:0 --device-profile FILE``) prefill seconds are
the profile's and the emulated KV moves through this host's transports; the outputs say so."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from engine.config import TRANSPORTS
from engine.emulated import Emulation
from engine.model import model_context_len
from experiments import measure, plots
from experiments.options import int_list, positive_int, transport_list
from experiments.timing import describe
from experiments.transfer_cost import DEFAULT_PROMPT_LENS, WHERE, kv_cost_table

HELP = "KV transfer cost vs prefill cost"
DEFAULT_TRANSPORTS = ("inprocess", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``pdlab kv-cost``."""
    measure.add_measure_args(parser, "kv-cost", emulated=True)
    parser.add_argument("--prompt-lens", type=int_list, default=DEFAULT_PROMPT_LENS,
                        help="prompt lengths T (default: 16,64,128,256,512)")
    parser.add_argument("--transports", type=transport_list, default=DEFAULT_TRANSPORTS,
                        help=f"from {','.join(TRANSPORTS)}; torchdist spawns two gloo processes "
                             "(default: inprocess,ray)")
    parser.add_argument("--layers-per-chunk", type=positive_int, default=1,
                        help="layers per layer-wise message (default: 1)")
    parser.add_argument("--checksum", default=True, action=argparse.BooleanOptionalAction,
                        help="CRC32 in every transfer, as served (default: on)")


def check(args: argparse.Namespace) -> Emulation | None:
    """``pdlab kv-cost`` options joined to the device and the model's context (read from its config
    file: no weights), checked before the model loads. Returns the ``Emulation`` of an emulated
    ``--device emu:i`` (``measure.emulation_of``), else None.

    Raises:
        ValueError: ``argument --x: ...`` for the first bad option."""
    model = measure.check_measure_args(args)
    emulation = measure.emulation_of(args)
    limit = model_context_len(model)
    if limit is not None and not any(p + 2 <= limit for p in args.prompt_lens):
        raise ValueError(f"argument --prompt-lens: no length fits the context of model "
                         f"{model.model} ({limit} tokens, 2 of them kept for decoding)")
    return emulation


def run(args: argparse.Namespace, emulation: Emulation | None = None) -> int:
    """Measure the table, write kv_cost.csv and kv_cost.png, print both tables
    (``emulation``: ``check``'s, for ``--device emu:i``)."""
    loaded = measure.load_for(args, emulation)
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
    with tqdm(total=len(prompt_lens), desc="kv-cost", unit="T", file=sys.stderr) as bar:
        df = kv_cost_table(loaded, prompt_lens, args.transports, args.repeats,
                           args.layers_per_chunk, "cpu" if emulation else args.device,
                           args.seed, args.checksum, bar, emulation)
    out = measure.out_dir(args, "kv-cost")
    header = measure.run_header(loaded, args, emulation)
    df.to_csv(out / "kv_cost.csv", index=False)
    plots.plot_kv_cost(df, out / "kv_cost.png", f"{header}; {describe(args.repeats)}")
    spec = loaded.kv_spec
    print(f"{header}\nestimator: {describe(args.repeats)}"
          + ("; prefill_s: the device profile's modelled prefill (nothing timed)"
             if emulation else ""))
    print(f"KV geometry: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x head_dim "
          f"{spec.head_dim} x {spec.itemsize} B = {spec.bytes_per_token} bytes/token; "
          f"layer-wise = {args.layers_per_chunk} layer(s) per message; "
          f"checksum {'on' if args.checksum else 'off'}")
    if emulation is not None:
        moved = emulation.scaled_spec(spec)
        print(f"emulated KV moved: {moved.num_layers} layers x {moved.num_kv_heads} x "
              f"{moved.head_dim} x {moved.itemsize} B = {moved.bytes_per_token} bytes/token "
              f"(--emu-kv-scale {emulation.kv_scale:g}); modelled_transfer_s: the profile's "
              f"transfer model at the unscaled bytes (link "
              f"{(emulation.device.source or {}).get('link', 'as profiled')})")
    for name in args.transports:
        print(f"  {name}: {WHERE[name]}")
    floor = df.drop_duplicates("prompt_len")[["prompt_len", "kv_bytes", "prefill_s", "memcpy_s",
                                               "memcpy_GBps"]]
    print("\nprefill and memcpy floor:\n" + floor.to_string(index=False))
    cols = ["prompt_len", "transport", "mode", "num_chunks", "transfer_s", "transfer_median_s",
            "transfer_GBps", "transfer_over_prefill", "transfer_over_memcpy"]
    if emulation is not None:
        cols.append("modelled_transfer_s")
    print("\ntransfers:\n" + df[cols].to_string(index=False))
    share = df.pivot_table(index="transport", columns="mode", values="efficiency",
                           aggfunc="median", sort=False)
    print(f"\nefficiency = transfer GB/s / link peak {df['peak_GBps'].iloc[0]:.3g} GB/s (one "
          "32 MiB memcpy, as a one-node run measures it), median over prompt lengths:\n"
          + share.to_string(float_format=lambda v: f"{v:.3f}"))
    print(f"\nwrote {out}/: kv_cost.csv kv_cost.png")
    return 0
