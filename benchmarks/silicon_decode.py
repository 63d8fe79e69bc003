"""A silicon-database profile's decode steps against the database's own estimate.

For each (model, system, backend): ``pdlab profile --from-silicon-db``'s profile
(``planner.silicon.build_profile`` on its default grid), then at B = 1, 16, 64 with isl 512,
osl 64 (the issue's ``aiconfigurator cli estimate`` command):

- ``pdlab``: the mean of the profile's 63 decode steps (``mean_decode_step_s``: the j-th
  attends to 512 + j + 1 tokens), what an emulated device holds;
- ``static_gen``: the database's TPOT of pure decode steps (``cli estimate
  --estimate-mode static_gen``, the same code path ``SiliconDatabase.tpot_s`` calls);
- ``agg`` (unless ``--no-agg``): ``cli estimate --estimate-mode agg``'s TPOT, which averages
  the decode steps with its mixed steps (a 512-token prompt chunk beside the other
  decodes) and so is a decode step only at B = 1.

Also each fit's R² and mean/max relative error over its sampled steps, and Llama-3.1-70B (bf16)
on H100 SXM under vLLM at TP 2, 4 and 8 (``--tp 2`` etc.; TP 1 is refused by
``engine.memory_fit``, 131 GiB of weights on an 80 GiB GPU, and printed as such): the same
columns, the database's ``static_gen`` at that TP (``cli estimate --tp-size``). Deterministic: no
timing, the same numbers on any CPU (the database's, not this machine's).

    .venv/bin/python -m benchmarks.silicon_decode [--quick] [--no-agg]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import print_table
from experiments.commands.profile import silicon_kv_bytes_per_token
from engine.memory_fit import Geometry, check_fits
from planner import silicon

ROOT = Path(__file__).resolve().parents[1]
CASES = [("llama-3.1-8b", "h100_sxm", "vllm"), ("qwen2.5-7b", "h100_sxm", "vllm"),
         ("llama-3.1-8b", "h100_sxm", "sglang"), ("llama-3.1-8b", "h100_sxm", "trtllm"),
         ("llama-3.1-8b", "h200_sxm", "vllm"), ("llama-3.1-8b", "b200_sxm", "vllm"),
         ("llama-3.1-8b", "gb200", "trtllm")]
TP_CASES = [("llama-3.1-70b", "h100_sxm", "vllm", tp) for tp in (1, 2, 4, 8)]
BATCH_SIZES, ISL, OSL = (1, 16, 64), 512, 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.silicon_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the two h100_sxm/vllm cases and "
                                                             "70B at TP 2 only")
    parser.add_argument("--no-agg", action="store_true", help="skip the agg estimates (~4 s each)")
    args = parser.parse_args(argv)
    cases = [c + (1,) for c in CASES] + TP_CASES
    if args.quick:
        cases = cases[:2] + TP_CASES[1:2]
    rows, fits = [], []
    for name, system, backend, tp in cases:
        model_dir = str(ROOT / "engine" / "configs" / name)
        try:
            db = silicon.open_database(model_dir, system, backend, tp)
            geometry = Geometry.from_config(silicon.read_model_config(model_dir))
            check_fits(geometry, 2, tp, 1, db.device_memory_bytes(), ISL + OSL,
                       vocab_parallel=True, what=name, device=f"an {system} GPU")
        except ValueError as err:  # SiliconError included
            print(f"{name} {system}/{backend} TP {tp}: refused: {err}")
            continue
        profile = silicon.build_profile(db, f"engine/configs/{name}",
                                        silicon_kv_bytes_per_token(model_dir, db.kv_dtype))
        for label, fit in (("prefill", profile.prefill), ("decode", profile.decode),
                           ("mixed", profile.mixed)):
            fits.append([name, db.where, label, f"{fit.r2:.4f}", f"{100 * fit.mean_rel_err:.1f}",
                         f"{100 * fit.max_rel_err:.1f}", fit.num_points])
        for row in silicon.decode_table(profile, db, BATCH_SIZES, ISL, OSL):
            agg = "" if args.no_agg or tp > 1 else _agg_tpot_s(model_dir, system, backend,
                                                                 row["batch_size"])
            rows.append([name, db.where, row["batch_size"], f"{1e3 * row['pdlab_s']:.3f}",
                         f"{1e3 * row['database_s']:.3f}", f"{100 * row['error']:+.1f}",
                         agg and f"{1e3 * agg:.3f}"])
    print(f"decode steps at isl {ISL}, osl {OSL}: pdlab's profile vs the database's TPOT (ms)")
    print_table(["model", "database", "B", "pdlab", "static_gen", "error %", "agg"], rows)
    print("\nfits over the sampled steps (planner.silicon.SampleGrid defaults)")
    print_table(["model", "database", "model", "R²", "mean err %", "max err %", "points"], fits)
    return 0


def _agg_tpot_s(model_dir: str, system: str, backend: str, batch_size: int) -> float:
    """``aiconfigurator cli estimate --estimate-mode agg``'s TPOT (seconds)."""
    from aiconfigurator.cli.api import cli_estimate  # the optional package; open_database checked it

    with silicon.quiet():
        result = cli_estimate(model_dir, system, backend_name=backend, mode="agg",
                              batch_size=batch_size, isl=ISL, osl=OSL)
    return result.tpot / 1e3


if __name__ == "__main__":
    sys.exit(main())
