"""A peer for ``pdlab map``: NVIDIA AIConfigurator's own aggregated-vs-disaggregated
recommendation at the same SLOs, beside the map's winner (issue 27).

AIConfigurator (``aiconfigurator cli default``; here its Python API ``cli_default``, version
0.12.0, CPU only) searches agg and disagg configurations of ``total_gpus`` GPUs of one
system on its silicon database and picks the mode with the most tokens/s per GPU that meets
TTFT and TPOT. It has no KV-transfer term (issue 27). pdlab's map answers the same
question per cell with its simulator and a transfer model.

1. ``aic_verdict``: one ``cli_default`` call (about 50 s on the 2-core shared Zen 5) for a
   cell's SLO and a request of ``isl`` prompt / ``osl`` output tokens; ``verdict_of`` reads
   its result (``"agg"`` or ``"disagg"``, both modes' tokens/s per GPU).
2. ``map_mode``: the map's winner family as AIConfigurator's mode (colocated and colocated
   chunked -> agg; disagg and conditional -> disagg; "none" / "no clear winner" -> None).
3. ``peer_rows``: per checked cell the two answers and whether they agree (None where the
   map has no clear winner: nothing to agree with).

``python -m experiments.aic_peer --map-dir results/map-x --system h100_sxm --model
engine/configs/llama-3.1-8b --devices 4 --cells 2`` checks ``--cells`` of the map's cells
(in ``slo_map.pick_cells``' order, the cells with a clear winner first)
and writes aic_peer.csv there. Not run: the
"transfer set to zero" rerun of a disagreement (the issue's explanation step).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from planner import slo_map

PEER_COLUMNS = ["io_ratio", "ttft_slo_s", "tpot_slo_s", "isl", "osl", "map_verdict", "map_mode",
                "aic_mode", "aic_agg_tokens_s_gpu", "aic_disagg_tokens_s_gpu", "agrees"]
_MODES = {"colocated": "agg", "colocated chunked": "agg", "disagg": "disagg",
          "conditional": "disagg"}


def available() -> bool:
    """Whether the optional ``aiconfigurator`` package is installed (``pdlab[silicon]``)."""
    return importlib.util.find_spec("aiconfigurator") is not None


def aic_kwargs(model_dir: str, system: str, backend: str, total_gpus: int, isl: int, osl: int,
               ttft_s: float, tpot_s: float) -> dict:
    """The keyword arguments of ``aiconfigurator.cli.api.cli_default`` for one cell: its
    SLOs in milliseconds (AIConfigurator's unit), top 1.

    Raises:
        ValueError: ``total_gpus`` < 1, ``isl`` or ``osl`` < 1, or an SLO <= 0 (seconds).
    """
    if total_gpus < 1 or isl < 1 or osl < 1:
        raise ValueError(f"total_gpus, isl and osl must be >= 1, got {total_gpus}, {isl}, {osl}")
    if not (ttft_s > 0 and tpot_s > 0):
        raise ValueError(f"SLOs must be > 0 s, got TTFT {ttft_s}, TPOT {tpot_s}")
    return {"model_path": model_dir, "total_gpus": total_gpus, "system": system,
            "backend": backend, "isl": isl, "osl": osl, "ttft": 1000.0 * ttft_s,
            "tpot": 1000.0 * tpot_s, "top_n": 1}


def verdict_of(result) -> dict:
    """Step 1's reading of a ``CLIResult`` (``chosen_exp``, ``best_throughputs``: tokens/s per
    GPU by experiment): ``{"aic_mode": "agg" | "disagg", "aic_agg_tokens_s_gpu",
    "aic_disagg_tokens_s_gpu"}`` (NaN for a mode with no feasible configuration)."""
    best = dict(result.best_throughputs)
    mode = "disagg" if str(result.chosen_exp).startswith("disagg") else "agg"
    return {"aic_mode": mode, "aic_agg_tokens_s_gpu": float(best.get("agg", float("nan"))),
            "aic_disagg_tokens_s_gpu": float(best.get("disagg", float("nan")))}


def aic_verdict(**kwargs) -> dict:
    """Step 1: ``verdict_of(cli_default(**aic_kwargs(...)))``; a cell where AIConfigurator
    finds no feasible configuration gives ``aic_mode`` "none".

    Raises:
        ModuleNotFoundError: aiconfigurator is not installed.
    """
    from aiconfigurator.cli.api import cli_default  # optional dependency: only when asked
    from aiconfigurator.sdk.errors import NoFeasibleConfigError
    logging.getLogger("aiconfigurator").setLevel(logging.ERROR)
    try:
        return verdict_of(cli_default(**kwargs))
    except NoFeasibleConfigError:
        return {"aic_mode": slo_map.NONE, "aic_agg_tokens_s_gpu": float("nan"),
                "aic_disagg_tokens_s_gpu": float("nan")}


def map_mode(cell: Mapping) -> str | None:
    """Step 2: the map cell's winner family as agg / disagg; None without a clear winner."""
    if cell["verdict"] in (slo_map.NONE, slo_map.NO_CLEAR):
        return None
    return _MODES[cell["winner_family"]]


def mean_lengths(ratio: float, request_tokens: int) -> tuple[int, int]:
    """(isl, osl): the means of the map's synthetic lengths at ``ratio`` (the middle of
    ``slo_map.ratio_lengths``' spans)."""
    spans = slo_map.ratio_lengths(ratio, request_tokens)
    return tuple(round(sum(map(int, s.split("-"))) / 2) for s in spans)


def peer_rows(cells: pd.DataFrame, verdicts: Sequence[dict], request_tokens: int) -> pd.DataFrame:
    """Step 3: one row per cell of ``cells`` (``slo_map.cells`` rows) with its AIConfigurator
    verdict (``verdicts``, same order): ``PEER_COLUMNS``; ``map_mode`` "" and ``agrees`` None where the map has
    no clear winner or AIConfigurator found nothing."""
    rows = []
    for cell, v in zip(cells.to_dict("records"), verdicts):
        isl, osl = mean_lengths(cell["io_ratio"], request_tokens)
        mine = map_mode(cell)
        agrees = None if mine is None or v["aic_mode"] == slo_map.NONE else mine == v["aic_mode"]
        rows.append({"io_ratio": cell["io_ratio"], "ttft_slo_s": cell["ttft_slo_s"],
                     "tpot_slo_s": cell["tpot_slo_s"], "isl": isl, "osl": osl,
                     "map_verdict": cell["verdict"], "map_mode": mine or "", **v, "agrees": agrees})
    return pd.DataFrame(rows, columns=PEER_COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.aic_peer`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--map-dir", required=True, help="a pdlab map results directory (map.csv)")
    p.add_argument("--system", required=True, help="AIConfigurator system, e.g. h100_sxm")
    p.add_argument("--model", required=True, help="model directory with config.json")
    p.add_argument("--backend", default="vllm", choices=("vllm", "sglang", "trtllm"))
    p.add_argument("--devices", type=int, required=True, help="the map's --devices")
    p.add_argument("--request-tokens", type=int, default=256, help="the map's --request-tokens")
    p.add_argument("--cells", type=int, default=2, help="cells to check (~50 s each)")
    args = p.parse_args(argv)
    if not available():
        p.error("aiconfigurator is not installed: pip install 'pdlab[silicon]'")
    cells = pd.read_csv(Path(args.map_dir) / "map.csv")
    order = slo_map.pick_cells(cells, len(cells))  # pick_cells' order over the whole grid
    clear = order["clear"].astype(bool)  # a cell without a clear winner judges nothing
    picked = pd.concat([order[clear], order[~clear]]).head(args.cells)
    verdicts = []
    for cell in picked.to_dict("records"):
        isl, osl = mean_lengths(cell["io_ratio"], args.request_tokens)
        verdicts.append(aic_verdict(**aic_kwargs(args.model, args.system, args.backend,
                                                 args.devices, isl, osl, cell["ttft_slo_s"],
                                                 cell["tpot_slo_s"])))
    table = peer_rows(picked, verdicts, args.request_tokens)
    table.to_csv(Path(args.map_dir) / "aic_peer.csv", index=False)
    print(table.to_string(index=False))
    judged = table["agrees"].dropna()
    print(f"AIConfigurator agrees with the map in {int(judged.sum())} of {len(judged)} cell(s) "
          f"with a clear winner ({len(table) - len(judged)} without one)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
