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


def test_verdict_and_peer_rows_on_a_hand_made_result():
    agg = SimpleNamespace(chosen_exp="agg", best_throughputs={"agg": 6672.75, "disagg": 4356.6})
    dis = SimpleNamespace(chosen_exp="disagg", best_throughputs={"disagg": 900.0})
    v_agg, v_dis = aic_peer.verdict_of(agg), aic_peer.verdict_of(dis)
    assert v_agg == {"aic_mode": "agg", "aic_agg_tokens_s_gpu": 6672.75,
                     "aic_disagg_tokens_s_gpu": 4356.6}
    assert v_dis["aic_mode"] == "disagg" and math.isnan(v_dis["aic_agg_tokens_s_gpu"])
    cells = pd.DataFrame([
        {"io_ratio": 4.0, "ttft_slo_s": 1.0, "tpot_slo_s": 0.02, "verdict": "colocated:4",
         "winner_family": "colocated chunked"},
        {"io_ratio": 4.0, "ttft_slo_s": 2.0, "tpot_slo_s": 0.01, "verdict": "conditional:1p3d",
         "winner_family": "conditional"},
        {"io_ratio": 1.0, "ttft_slo_s": 2.0, "tpot_slo_s": 0.05, "verdict": slo_map.NO_CLEAR,
         "winner_family": "disagg"}])
    rows = aic_peer.peer_rows(cells, [v_agg, v_agg, v_dis], 256)
    assert list(rows.columns) == aic_peer.PEER_COLUMNS
    assert rows["map_mode"].tolist() == ["agg", "disagg", ""]  # "": no clear winner
    assert rows["agrees"].tolist() == [True, False, None]
    # 4:1 of 256 tokens: prompt 205 drawn in 102-308 (round half to even), output 51 in 26-76
    assert (rows.loc[0, "isl"], rows.loc[0, "osl"]) == (205, 51)
    assert (rows.loc[2, "isl"], rows.loc[2, "osl"]) == (128, 128)


@pytest.mark.silicon
@pytest.mark.skipif(not aic_peer.available(), reason="aiconfigurator not installed")
def test_kwargs_bind_to_the_installed_cli_default():
    from aiconfigurator.cli.api import cli_default
    kw = aic_peer.aic_kwargs("engine/configs/llama-3.1-8b", "h100_sxm", "vllm", 4, 512, 128, 1.0, 0.02)
    inspect.signature(cli_default).bind(**kw)  # raises TypeError on an unknown or missing argument
