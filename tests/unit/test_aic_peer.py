"""experiments.aic_peer: AIConfigurator's agg-vs-disagg verdict beside the map's, on a
hand-made result (no aiconfigurator needed), and the call's arguments against the installed
package's own signature (skipped where aiconfigurator is absent)."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pandas as pd
import pytest

from experiments import aic_peer
from planner import slo_map


def test_kwargs_in_milliseconds_and_refusals():
    kw = aic_peer.aic_kwargs("m", "h100_sxm", "vllm", 4, 205, 51, 0.5, 0.02)
    assert kw == {"model_path": "m", "total_gpus": 4, "system": "h100_sxm", "backend": "vllm",
                  "isl": 205, "osl": 51, "ttft": 500.0, "tpot": 20.0, "top_n": 1}
    with pytest.raises(ValueError, match="SLOs must be > 0"):
        aic_peer.aic_kwargs("m", "h100_sxm", "vllm", 4, 10, 10, 0.0, 0.02)
    with pytest.raises(ValueError, match="total_gpus"):
        aic_peer.aic_kwargs("m", "h100_sxm", "vllm", 0, 10, 10, 1.0, 0.02)


def _cells(rows):
    """Hand-made ``slo_map.cells`` rows: (ttft_index, tpot_index, TTFT s, TPOT s, verdict,
    winner family, goodput per device req/s, at_sweep_top) at io ratio 4."""
    return pd.DataFrame([{"io_ratio": 4.0, "ttft_index": i, "tpot_index": j, "ttft_slo_s": t,
                          "tpot_slo_s": p, "verdict": v, "winner_family": f,
                          "goodput_per_device_req_s": g, "at_sweep_top": top}
                         for i, j, t, p, v, f, g, top in rows])


def test_verdict_and_peer_rows_on_a_hand_made_result():
    agg = SimpleNamespace(chosen_exp="agg", best_throughputs={"agg": 6672.75, "disagg": 4356.6})
    dis = SimpleNamespace(chosen_exp="disagg", best_throughputs={"disagg": 900.0})
    v_agg, v_dis = aic_peer.verdict_of(agg), aic_peer.verdict_of(dis)
    assert v_agg == {"aic_mode": "agg", "aic_agg_tokens_s_gpu": 6672.75,
                     "aic_disagg_tokens_s_gpu": 4356.6, "aic_agg_config": "",
                     "aic_disagg_config": ""}
    assert v_dis["aic_mode"] == "disagg" and math.isnan(v_dis["aic_agg_tokens_s_gpu"])
    cells = _cells([(0, 0, 1.0, 0.02, "colocated:4", "colocated chunked", 10.0, False),
                    (1, 0, 2.0, 0.01, "conditional:1p3d", "conditional", 20.0, True),
                    (1, 1, 2.0, 0.05, slo_map.NO_CLEAR, "disagg", 30.0, False)])
    cells.loc[2, "io_ratio"] = 1.0
    rows = aic_peer.peer_rows(cells, [v_agg, v_agg, v_dis], 256)
    assert list(rows.columns) == aic_peer.PEER_COLUMNS
    assert rows["map_mode"].tolist() == ["agg", "disagg", ""]  # "": no clear winner
    assert rows["agrees"].tolist() == [True, False, None]
    assert rows["transfer_explains"].tolist() == [None, None, None]  # no zero-transfer map
    assert rows["map_at_sweep_top"].tolist() == [False, True, False]
    # 4:1 of 256 tokens: prompt 205 drawn in 102-308 (round half to even), output 51 in 26-76
    assert (rows.loc[0, "isl"], rows.loc[0, "osl"]) == (205, 51)
    assert (rows.loc[2, "isl"], rows.loc[2, "osl"]) == (128, 128)
    assert aic_peer.disagreement_lines(rows) == [
        "disagreement at io 4, TTFT 2 s, TPOT 0.01 s: map conditional:1p3d (disagg), "
        "AIConfigurator agg; transfer term not checked (--zero-transfer-map-dir); the map's "
        "winner met the SLO at the top swept rate (its goodput 20 req/s per device is a lower "
        "bound)"]


def test_configs_of_a_hand_made_result():
    agg = pd.DataFrame([{"num_total_gpus": 2, "tp": 2, "pp": 1, "bs": 64},
                        {"num_total_gpus": 1, "tp": 1, "pp": 1, "bs": 8}])
    dis = pd.DataFrame([{"num_total_gpus": 3, "(p)workers": 1, "(p)tp": 1, "(d)workers": 1,
                         "(d)tp": 2}])
    res = SimpleNamespace(chosen_exp="agg", best_throughputs={"agg": 1.0, "disagg": 0.5},
                          best_configs={"agg": agg, "disagg": dis})
    v = aic_peer.verdict_of(res, 4)
    # rank 1 only; 4 GPUs // 2 per replica = 2 replicas; 4 // 3 = 1 disagg replica
    assert v["aic_agg_config"] == "2 x tp2, bs 64"
    assert v["aic_disagg_config"] == "1 x (1p tp1 + 1d tp2)"
    assert aic_peer.config_of(agg.iloc[:0], "agg", 4) == ""


def test_transfer_explains_on_hand_made_maps():
    # the map and its zero-transfer twin on one 2 x 2 grid; AIConfigurator says agg everywhere
    slos = [(0, 0, 0.5, 0.01), (0, 1, 0.5, 0.1), (1, 0, 2.0, 0.01), (1, 1, 2.0, 0.1)]
    normal = _cells([(*k, v, f, 5.0, False) for k, (v, f) in zip(slos, [
        ("disagg:1p1d", "disagg"), ("disagg:1p3d", "disagg"), ("colocated:4", "colocated"),
        ("conditional:2p2d", "conditional")])])
    zero = _cells([(*k, v, f, 5.0, False) for k, (v, f) in zip(slos, [
        ("colocated:4", "colocated chunked"), ("disagg:1p3d", "disagg"),
        ("colocated:4", "colocated"), (slo_map.NO_CLEAR, "colocated")])])
    picked = normal.iloc[[3, 0, 1, 2]]  # pick_cells' order is not the grid's
    twins = aic_peer.zero_transfer_cells(picked, zero.iloc[::-1])
    assert twins["verdict"].tolist() == [slo_map.NO_CLEAR, "colocated:4", "disagg:1p3d",
                                         "colocated:4"]
    v = {"aic_mode": "agg", "aic_agg_tokens_s_gpu": 1.0, "aic_disagg_tokens_s_gpu": 0.5,
         "aic_agg_config": "4 x tp1, bs 8", "aic_disagg_config": ""}
    rows = aic_peer.peer_rows(picked, [v] * 4, 256, twins)
    assert rows["agrees"].tolist() == [False, False, False, True]
    assert rows["zero_transfer_mode"].tolist() == ["", "agg", "disagg", "agg"]
    # explained only where the zero-transfer map turns to AIConfigurator's mode; no clear
    # winner at zero transfer does not agree with it; an agreement has nothing to explain
    assert rows["transfer_explains"].tolist() == [False, True, False, None]
    lines = aic_peer.disagreement_lines(rows)
    assert len(lines) == 3
    assert lines[1] == ("disagreement at io 4, TTFT 0.5 s, TPOT 0.01 s: map disagg:1p1d "
                        "(disagg), AIConfigurator agg; with the transfer set to zero the map "
                        "says colocated:4 (agg): the transfer term explains it")
    assert lines[0].endswith(f"says {slo_map.NO_CLEAR} (no mode): the transfer term does not "
                             "explain it")
    with pytest.raises(ValueError, match="no cell at io 4, TTFT 2 s, TPOT 0.1 s"):
        aic_peer.zero_transfer_cells(picked, zero.iloc[:3])
    moved = zero.assign(tpot_slo_s=zero["tpot_slo_s"] * 2)  # same indices, another grid
    with pytest.raises(ValueError, match="same map"):
        aic_peer.zero_transfer_cells(picked, moved)


@pytest.mark.silicon
@pytest.mark.skipif(not aic_peer.available(), reason="aiconfigurator not installed")
def test_kwargs_bind_to_the_installed_cli_default():
    from aiconfigurator.cli.api import cli_default
    kw = aic_peer.aic_kwargs("engine/configs/llama-3.1-8b", "h100_sxm", "vllm", 4, 512, 128, 1.0, 0.02)
    inspect.signature(cli_default).bind(**kw)  # raises TypeError on an unknown or missing argument
