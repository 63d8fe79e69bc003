"""pdlab's control plane at GPU speed: 8 emulated H100s, measured - modelled.

1. Eight emulated devices (``emu:0-7``, ``engine.emulated``) with the Llama-3.1-8B H100 SXM
   vLLM profile (``pdlab profile --from-silicon-db h100_sxm --backend vllm --model
   engine/configs/llama-3.1-8b``; tests/data holds one), KV bytes scaled to 1/256, Ray
   actors, transport shm: the real router, workers, scheduler and transports, every step
   held for its modelled time.
2. ShareGPT first turns (SmolLM2's tokenizer: its ids fit Llama's vocabulary),
   ``colocated:8``, ``disagg:4p4d``, ``disagg:2p6d`` at each ``--rates``.
3. The simulated twin of every run (``experiments.validate.simulate_like``: the same
   requests and arrival times on ``pdlab plan``'s simulator with the same profile) gives
   the modelled TTFT / TPOT p50; added latency = measured - modelled
   (``validate.added_latency``), in % of modelled.
4. Also: output tokens/s through the router per run (past saturation at the highest
   rate), the steps' lateness p99 (actual / modelled hold: > 1.02, this host could not keep
   the device's time), a cProfile of the router loop at the highest rate (own time).

Writes ``control_plane.csv`` (the printed table), ``control_plane_stages.csv`` (where the
added latency goes: ``validate.stage_latency``'s median per stage, also printed) and
``control_plane.png`` (added latency and tokens/s against the rate) under ``--out`` (default
``results/control-plane-<time>``).

Usage: ``python -m benchmarks.control_plane [--rates 20,60,150] [--num-requests 300]
[--placements colocated:8,disagg:4p4d,disagg:2p6d] [--profile FILE] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import pandas as pd

from engine.config import EngineConfig, ModelConfig, TransferConfig
from engine.metrics import SLO
from engine.model import SMOLLM2_NAME, load_tokenizer
from experiments import analysis, validate, workloads
from experiments.replay import run_placement
from experiments.workload_spec import WorkloadSpec
from planner.latency import DeviceProfile
from router import router as router_module

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "llama-3.1-8b_h100_sxm_vllm_profile.json"
LLAMA = ModelConfig("engine/configs/llama-3.1-8b", "bfloat16")


def profiled_router_loop(stats: list) -> None:
    """Wrap ``Router.run`` (the replay drives the router loop in the calling thread) so
    each run's loop runs under cProfile; each run's profile is appended to ``stats``."""
    original = router_module.Router.run

    def run(self, *args, **kwargs):
        profile = cProfile.Profile()
        profile.enable()
        try:
            return original(self, *args, **kwargs)
        finally:
            profile.disable()
            stats.append(profile)
    router_module.Router.run = run


def top_of(profile: cProfile.Profile, n: int = 12) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def plot(table: pd.DataFrame, path: Path) -> Path:
    """Three panels against the rate, a line per placement: added TTFT p50 and added TPOT p50
    (% of modelled) and output tokens/s through the router."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("added_ttft_p50_pct", "added TTFT p50 (% of modelled)"),
              ("added_tpot_p50_pct", "added TPOT p50 (% of modelled)"),
              ("output_tok_s", "output tokens/s")]
    for ax, (column, label) in zip(axes, panels):
        for placement, rows in table.groupby("placement", sort=False):
            ax.plot(rows["rate"], rows[column], marker="o", label=placement)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("pdlab on emulated devices: measured - modelled (benchmarks.control_plane)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rates", default="20,60,150", help="arrival rates, req/s")
    parser.add_argument("--num-requests", type=int, default=300, help="ShareGPT requests per run")
    parser.add_argument("--placements", default="colocated:8,disagg:4p4d,disagg:2p6d",
                        help="placements on emu:0-7")
    parser.add_argument("--profile", default=str(PROFILE), help="the emulated device's profile")
    parser.add_argument("--transport", default="shm", help="KV transport")
    parser.add_argument("--cprofile", action=argparse.BooleanOptionalAction, default=True,
                        help="cProfile the router loop")
    parser.add_argument("--out", default=None, help="results directory")
    args = parser.parse_args()
    out = Path(args.out or f"results/control-plane-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    profile = DeviceProfile.load(args.profile)
    engine = EngineConfig(max_num_seqs=128, max_model_len=2048, max_num_batched_tokens=2048,
                          device_profile=args.profile, emu_kv_scale=1 / 256)
    spec = WorkloadSpec(dataset="sharegpt", num_requests=args.num_requests, seeds=1,
                        max_prompt_len=1024, max_output_len=512)
    items = {0: workloads.sharegpt(load_tokenizer(ModelConfig(SMOLLM2_NAME)), args.num_requests,
                                   0, max_prompt_len=1024, max_output_len=512,
                                   max_total_len=2048)}
    transfer = TransferConfig(transport=args.transport)
    stats: list = []
    if args.cprofile:
        profiled_router_loop(stats)
    rows, profiles, stages = [], {}, []
    for placement in args.placements.split(","):
        before = len(stats)
        results = run_placement(placement, rates, items, spec, LLAMA, engine, transfer,
                                "emu:0-7", None)
        twins = validate.simulate_like(results, items, spec, engine, args.transport, profile,
                                       profile.transfers.get(args.transport))
        slo = SLO(ttft_s=1.0, tpot_s=0.05)
        measured = analysis.summary_table(results, slo, num_boot=50)
        modelled = analysis.summary_table(twins, slo, num_boot=50)
        added = validate.added_latency(measured, modelled)
        stages.append(validate.stage_latency(results, twins))
        for r, (_, a) in zip(results, added.iterrows()):
            late = pd.Series([s.get("lateness") for s in r.steps], dtype=float).dropna()
            tokens = sum(len(rec.output_token_ids) for rec in r.records)
            rows.append({**a.to_dict(), "output_tok_s": tokens / r.duration_s,
                         "lateness_p99": late.quantile(0.99) if len(late) else float("nan"),
                         "failed": sum(rec.error is not None for rec in r.records)})
        if len(stats) > before:
            profiles[placement] = stats[-1]
    table = pd.DataFrame(rows)
    cols = ["placement", "rate", "ttft_p50_measured_s", "ttft_p50_modelled_s", "added_ttft_p50_pct",
            "tpot_p50_measured_s", "tpot_p50_modelled_s", "added_tpot_p50_pct", "output_tok_s",
            "lateness_p99", "failed"]
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    table[cols].to_csv(out / "control_plane.csv", index=False)
    by_stage = pd.concat(stages, ignore_index=True)
    by_stage.to_csv(out / "control_plane_stages.csv", index=False)
    wide = by_stage.assign(added_ms=1e3 * by_stage["added_s"]).pivot_table(
        index="stage", columns=["placement", "rate"], values="added_ms", sort=False)
    print("\nWhere the added latency goes: measured - modelled median per stage, ms")
    print(wide.to_string(float_format=lambda v: f"{v:+.3f}"))
    print(f"\nWrote {out / 'control_plane.csv'}, {out / 'control_plane_stages.csv'} and "
          f"{plot(table, out / 'control_plane.png')}")
    for placement, prof in profiles.items():
        print(f"\ncProfile of the router loop, {placement} at {max(rates):g} req/s (top by own time):")
        print(top_of(prof))


if __name__ == "__main__":
    main()
