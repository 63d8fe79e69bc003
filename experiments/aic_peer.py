"""A peer for ``pdlab map``: NVIDIA AIConfigurator's own aggregated-vs-disaggregated
recommendation at the same SLOs, beside the map's winner.

AIConfigurator (``cli_default``, CPU only) searches agg and disagg configurations of
``total_gpus`` GPUs on its silicon database and picks the mode with the most tokens/s per GPU
that meets TTFT and TPOT; it has no KV-transfer term, which pdlab's map has. Per checked cell
(``peer_rows``): its verdict (``aic_verdict``), the map's winner family as a mode (``map_mode``:
colocated -> agg; disagg, conditional -> disagg), whether they agree and, with a zero-transfer
map, whether the transfer term explains a disagreement (``transfer_explains``).

``python -m experiments.aic_peer --map-dir results/map-x --system h100_sxm --model
engine/configs/llama-3.1-8b --devices 4 --cells 2 --zero-transfer-map-dir results/map-x0``
writes aic_peer.csv in ``--map-dir``; ``map-x0`` is the same ``pdlab map`` command with
``--transfer-latency-s 0 --transfer-bandwidth-gbps 1e9``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from planner import slo_map

PEER_COLUMNS = ["io_ratio", "ttft_slo_s", "tpot_slo_s", "isl", "osl", "map_verdict", "map_mode",
                "map_goodput_per_device_req_s", "map_at_sweep_top", "aic_mode",
                "aic_agg_tokens_s_gpu", "aic_disagg_tokens_s_gpu", "aic_agg_config",
                "aic_disagg_config", "agrees", "zero_transfer_verdict", "zero_transfer_mode",
                "transfer_explains"]
_MODES = {"colocated": "agg", "colocated chunked": "agg", "disagg": "disagg",
          "conditional": "disagg"}


def available() -> bool:
    """Whether the optional ``aiconfigurator`` package is installed (``pdlab[silicon]``)."""
    return importlib.util.find_spec("aiconfigurator") is not None


def aic_kwargs(model_dir: str, system: str, backend: str, total_gpus: int, isl: int, osl: int,
               ttft_s: float, tpot_s: float) -> dict:
    """The keyword arguments of ``aiconfigurator.cli.api.cli_default`` for one cell: its SLOs in
    milliseconds (AIConfigurator's unit), top 1.

    Raises:
        ValueError: ``total_gpus`` < 1, ``isl`` or ``osl`` < 1, or an SLO <= 0 (seconds)."""
    if total_gpus < 1 or isl < 1 or osl < 1:
        raise ValueError(f"total_gpus, isl and osl must be >= 1, got {total_gpus}, {isl}, {osl}")
    if not (ttft_s > 0 and tpot_s > 0):
        raise ValueError(f"SLOs must be > 0 s, got TTFT {ttft_s}, TPOT {tpot_s}")
    return {"model_path": model_dir, "total_gpus": total_gpus, "system": system,
            "backend": backend, "isl": isl, "osl": osl, "ttft": 1000.0 * ttft_s,
            "tpot": 1000.0 * tpot_s, "top_n": 1}


def config_of(best: pd.DataFrame | None, mode: str, total_gpus: int) -> str:
    """The rank-1 row of a ``CLIResult.best_configs`` table (AIConfigurator's ``ColumnsAgg``
    / ``ColumnsDisagg``; ``num_total_gpus`` is one replica's GPUs) in words:
    agg ``"2 x tp2, bs 64"`` (replicas x TP, batch size); disagg ``"1 x (1p tp2 + 2d tp1)"``
    (replicas x (prefill workers and TP + decode workers and TP)). "" for an empty table."""
    if best is None or len(best) == 0:
        return ""
    row = best.iloc[0]
    replicas = total_gpus // max(int(row["num_total_gpus"]), 1)
    if mode == "agg":
        pp = f" pp{int(row['pp'])}" if int(row["pp"]) > 1 else ""
        return f"{replicas} x tp{int(row['tp'])}{pp}, bs {int(row['bs'])}"
    return (f"{replicas} x ({int(row['(p)workers'])}p tp{int(row['(p)tp'])} + "
            f"{int(row['(d)workers'])}d tp{int(row['(d)tp'])})")


def verdict_of(result, total_gpus: int = 0) -> dict:
    """Step 1's reading of a ``CLIResult`` (``chosen_exp``, ``best_throughputs``: output
    tokens/s per GPU by experiment; ``best_configs``, where it has them: the configurations
    by experiment): ``{"aic_mode": "agg" | "disagg", "aic_agg_tokens_s_gpu",
    "aic_disagg_tokens_s_gpu", "aic_agg_config", "aic_disagg_config"}`` (NaN and "" for a
    mode with no feasible configuration; configs by ``config_of`` on ``total_gpus``)."""
    best = dict(result.best_throughputs)
    configs = dict(getattr(result, "best_configs", None) or {})
    mode = "disagg" if str(result.chosen_exp).startswith("disagg") else "agg"
    return {"aic_mode": mode, "aic_agg_tokens_s_gpu": float(best.get("agg", float("nan"))),
            "aic_disagg_tokens_s_gpu": float(best.get("disagg", float("nan"))),
            "aic_agg_config": config_of(configs.get("agg"), "agg", total_gpus),
            "aic_disagg_config": config_of(configs.get("disagg"), "disagg", total_gpus)}


def aic_verdict(**kwargs) -> dict:
    """Step 1: ``verdict_of(cli_default(**aic_kwargs(...)))``; a cell where AIConfigurator finds no
    feasible configuration gives ``aic_mode`` "none".

    Raises:
        ModuleNotFoundError: aiconfigurator is not installed."""
    from aiconfigurator.cli.api import cli_default  # optional dependency: only when asked
    from aiconfigurator.sdk.errors import NoFeasibleConfigError
    logging.getLogger("aiconfigurator").setLevel(logging.ERROR)
    try:
        return verdict_of(cli_default(**kwargs), kwargs["total_gpus"])
    except NoFeasibleConfigError:
        return {"aic_mode": slo_map.NONE, "aic_agg_tokens_s_gpu": float("nan"),
                "aic_disagg_tokens_s_gpu": float("nan"), "aic_agg_config": "",
                "aic_disagg_config": ""}


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


_KEY = ["io_ratio", "ttft_index", "tpot_index"]


def zero_transfer_cells(cells: pd.DataFrame, zero: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``zero`` (the map.csv of the same map rerun with the transfer set to zero) at the
    cells of ``cells`` (``slo_map.cells`` rows), in ``cells``' order.

    Raises:
        ValueError: a cell of ``cells`` is not in ``zero``, or is there at other SLOs (s):
            the two maps do not share the grid."""
    by_key = {tuple(k): i for k, i in zip(zero[_KEY].itertuples(index=False), zero.index)}
    picked = []
    for cell in cells.to_dict("records"):
        key = tuple(cell[k] for k in _KEY)
        i = by_key.get(key)
        if i is None or not (np.isclose(zero.at[i, "ttft_slo_s"], cell["ttft_slo_s"])
                             and np.isclose(zero.at[i, "tpot_slo_s"], cell["tpot_slo_s"])):
            raise ValueError(f"the zero-transfer map has no cell at io {cell['io_ratio']:g}, "
                             f"TTFT {cell['ttft_slo_s']:g} s, TPOT {cell['tpot_slo_s']:g} s: "
                             "rerun the same map (same --io-ratio, --ttft-slo, --tpot-slo)")
        picked.append(i)
    return zero.loc[picked]


def transfer_explains(agrees: bool | None, zero_mode: str | None, aic_mode: str) -> bool | None:
    """Whether pdlab's transfer term explains a disagreement: with the transfer set to zero
    the map's mode (``map_mode`` of the zero-transfer cell; None: no clear winner there)
    is AIConfigurator's. None where there is no disagreement (``agrees`` not False)."""
    if agrees is not False:
        return None
    return zero_mode == aic_mode


def peer_rows(cells: pd.DataFrame, verdicts: Sequence[dict], request_tokens: int,
              zero: pd.DataFrame | None = None) -> pd.DataFrame:
    """Step 3: one row per cell of ``cells`` (``slo_map.cells`` rows) with its AIConfigurator
    verdict (``verdicts``, same order) and, given ``zero`` (``zero_transfer_cells``, same
    order), the zero-transfer map's verdict: ``PEER_COLUMNS``. ``agrees`` None where either
    side has no answer; ``transfer_explains`` None without ``zero``."""
    zero_rows = zero.to_dict("records") if zero is not None else [None] * len(cells)
    rows = []
    for cell, v, z in zip(cells.to_dict("records"), verdicts, zero_rows):
        isl, osl = mean_lengths(cell["io_ratio"], request_tokens)
        mine = map_mode(cell)
        agrees = None if mine is None or v["aic_mode"] == slo_map.NONE else mine == v["aic_mode"]
        zero_mode = map_mode(z) if z is not None else None
        rows.append({"io_ratio": cell["io_ratio"], "ttft_slo_s": cell["ttft_slo_s"],
                     "tpot_slo_s": cell["tpot_slo_s"], "isl": isl, "osl": osl,
                     "map_verdict": cell["verdict"], "map_mode": mine or "",
                     "map_goodput_per_device_req_s": cell["goodput_per_device_req_s"],
                     "map_at_sweep_top": bool(cell["at_sweep_top"]), **v, "agrees": agrees,
                     "zero_transfer_verdict": z["verdict"] if z is not None else "",
                     "zero_transfer_mode": zero_mode or "",
                     "transfer_explains": (transfer_explains(agrees, zero_mode, v["aic_mode"])
                                           if z is not None else None)})
    return pd.DataFrame(rows, columns=PEER_COLUMNS)


def disagreement_lines(table: pd.DataFrame) -> list[str]:
    """Step 4: one line per row of ``table`` (``peer_rows``) where the two disagree, with
    the zero-transfer answer (or that it was not checked) and the at-sweep-top caveat."""
    lines = []
    for r in table[table["agrees"] == False].to_dict("records"):  # noqa: E712 (None: no verdict)
        head = (f"disagreement at io {r['io_ratio']:g}, TTFT {r['ttft_slo_s']:.4g} s, TPOT "
                f"{r['tpot_slo_s']:.4g} s: map {r['map_verdict']} ({r['map_mode']}), "
                f"AIConfigurator {r['aic_mode']}")
        if r["transfer_explains"] is None:
            tail = "transfer term not checked (--zero-transfer-map-dir)"
        else:
            zero = f"{r['zero_transfer_verdict']} ({r['zero_transfer_mode'] or 'no mode'})"
            tail = (f"with the transfer set to zero the map says {zero}: the transfer term "
                    + ("explains it" if r["transfer_explains"] else "does not explain it"))
        top = ("; the map's winner met the SLO at the top swept rate (its goodput "
               f"{r['map_goodput_per_device_req_s']:.4g} req/s per device is a lower bound)"
               if r["map_at_sweep_top"] else "")
        lines.append(f"{head}; {tail}{top}")
    return lines


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
    p.add_argument("--zero-transfer-map-dir", default=None,
                   help="the same map rerun with --transfer-latency-s 0 "
                        "--transfer-bandwidth-gbps 1e9 (map.csv): does the transfer term "
                        "explain a disagreement?")
    args = p.parse_args(argv)
    if not available():
        p.error("aiconfigurator is not installed: pip install 'pdlab[silicon]'")
    cells = pd.read_csv(Path(args.map_dir) / "map.csv")
    zero_map = (pd.read_csv(Path(args.zero_transfer_map_dir) / "map.csv")
                if args.zero_transfer_map_dir else None)
    order = slo_map.pick_cells(cells, len(cells))  # pick_cells' order over the whole grid
    clear = order["clear"].astype(bool)  # a cell without a clear winner judges nothing
    picked = pd.concat([order[clear], order[~clear]]).head(args.cells)
    try:
        zero = zero_transfer_cells(picked, zero_map) if zero_map is not None else None
    except ValueError as err:
        p.error(f"argument --zero-transfer-map-dir: {err}")
    verdicts = []
    for cell in picked.to_dict("records"):
        isl, osl = mean_lengths(cell["io_ratio"], args.request_tokens)
        verdicts.append(aic_verdict(**aic_kwargs(args.model, args.system, args.backend,
                                                 args.devices, isl, osl, cell["ttft_slo_s"],
                                                 cell["tpot_slo_s"])))
    table = peer_rows(picked, verdicts, args.request_tokens, zero)
    table.to_csv(Path(args.map_dir) / "aic_peer.csv", index=False)
    print(table.to_string(index=False))
    judged = table["agrees"].dropna()
    print(f"AIConfigurator agrees with the map in {int(judged.sum())} of {len(judged)} cell(s) "
          f"with a clear winner ({len(table) - len(judged)} without one)")
    print("\n".join(disagreement_lines(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
