"""planner.band (pdlab plan --speed-spread): the slow and fast ends scale every
step, the goodput bands and the verdict on hand-built curves, and the validation's band
columns and ranking check (experiments.validate)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from engine.config import EngineConfig
from engine.metrics import SLO
from engine.request import Request, SamplingParams
from planner import band, search
from experiments import validate
from planner.latency import DeviceProfile

PROFILE = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"


def test_scales_and_bad_spreads():
    assert band.scales(0.15) == {"slow": 1.15, "fast": 0.85}
    for bad in (-0.1, 1.0, 2.0, float("nan")):
        with pytest.raises(ValueError, match="speed spread"):
            band.scales(bad)


def test_band_runs_scale_every_step_of_the_candidates_own_rates():
    # one request alone: its TTFT is its prefill step, so the slow end's is 1.2x, the fast 0.8x
    profile = DeviceProfile.load(PROFILE)
    engine = EngineConfig(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    requests = {0: [Request("s0-0", tuple(range(3, 33)), SamplingParams(max_tokens=4, ignore_eos=True))]}
    cand = search.Candidate("colocated:1")
    slo = SLO(ttft_s=10.0, tpot_s=10.0)
    runs = search.sweep([cand], [0.5, 2.0], requests, engine, profile, None, slo)
    rows = band.band_runs([cand], runs, requests, engine, profile, None, slo, 0.2)
    assert sorted(rows["speed"].unique()) == ["fast", "slow"]
    assert sorted(rows[rows["speed"] == "slow"]["rate"]) == [0.5, 2.0]
    nominal = runs.set_index("rate")["ttft_p50_s"]
    for speed, k in (("slow", 1.2), ("fast", 0.8)):
        got = rows[rows["speed"] == speed].set_index("rate")["ttft_p50_s"]
        assert list(got / nominal) == pytest.approx([k, k], rel=1e-12)


def _rows(label: str, points: list[tuple[float, float]], speed: str | None = None) -> pd.DataFrame:
    df = pd.DataFrame([{"candidate": label, "placement": label, "chunk_budget": None,
                        "num_devices": 1, "rate": rate, "seed": 0, "slo_attainment": att,
                        "ttft_p50_s": 1.0, "ttft_p99_s": 1.0, "tpot_p50_s": 0.1,
                        "tpot_p99_s": 0.1} for rate, att in points])
    return df if speed is None else df.assign(speed=speed)


def test_goodput_bands_and_the_verdict():
    runs = pd.concat([_rows("a", [(1, 0.99), (2, 0.95), (4, 0.5)]),
                      _rows("b", [(1, 0.99), (2, 0.6), (4, 0.1)])])
    ranked = search.rank(runs)  # a: 2, b: 1 req/s/device
    apart = pd.concat([_rows("a", [(1, 0.99), (2, 0.92), (4, 0.3)], "slow"),
                       _rows("a", [(1, 0.99), (2, 0.99), (4, 0.91)], "fast"),
                       _rows("b", [(1, 0.95), (2, 0.4), (4, 0.0)], "slow"),
                       _rows("b", [(1, 0.99), (2, 0.8), (4, 0.2)], "fast")])
    got = band.with_band(ranked, apart)
    assert list(got["goodput_slow"]) == [2.0, 1.0] and list(got["goodput_fast"]) == [4.0, 1.0]
    assert "a 2 req/s/device [2 slow, 4 fast] stays first" in band.verdict(got, 0.15)
    # b fast reaches 2 req/s/device: as much as a when slow, no clear winner
    close = pd.concat([apart[apart["candidate"] == "a"],
                       _rows("b", [(1, 0.95), (2, 0.4), (4, 0.0)], "slow"),
                       _rows("b", [(1, 0.99), (2, 0.9), (4, 0.2)], "fast")])
    text = band.verdict(band.with_band(ranked, close), 0.15)
    assert text.startswith("speed band ±15%: no clear winner") and "b 1 req/s/device [1 slow, 2 fast]" in text
    # only the first banded: nothing to compare; the curve gets the band beside each point
    alone = band.with_band(ranked, apart[apart["candidate"] == "a"])
    assert math.isnan(alone.loc[1, "goodput_slow"]) and "fewer than two" in band.verdict(alone, 0.1)
    curve = band.curve_band(search.curves(runs), apart)
    assert list(curve[curve["candidate"] == "a"]["slo_attainment_slow"]) == [0.99, 0.92, 0.3]
    assert list(curve[curve["candidate"] == "b"]["slo_attainment_fast"]) == [0.99, 0.8, 0.2]


def test_validation_band_columns_and_the_ranking_check_within_the_band():
    errors = pd.DataFrame({"placement": ["a", "a", "b"], "rate": [1.0, 2.0, 1.0],
                           "measured_attainment": [0.9, 0.5, 0.7]})
    tables = {"slow": pd.DataFrame({"placement": ["a", "a", "b"], "rate": [1.0, 2.0, 1.0],
                                    "slo_attainment": [0.8, 0.6, 0.5]}),
              "fast": pd.DataFrame({"placement": ["a", "a", "b"], "rate": [1.0, 2.0, 1.0],
                                    "slo_attainment": [1.0, 0.9, 0.6]})}
    out = validate.with_band(errors, tables)
    assert list(out["measured_in_band"]) == [1.0, 0.0, 0.0]  # 0.5 < 0.6 and 0.7 > 0.6
    assert list(out["band_slow_attainment"]) == [0.8, 0.6, 0.5]
    assert validate.with_band(errors, {})["band_fast_attainment"].isna().all()
    # the planner's first b is not the real first a: accepted only where the bands overlap
    summary = {"measured_goodput": {"a": 0.2, "b": 0.1}, "simulated_first": "b", "first_agrees": False}
    overlap = validate.band_summary(out, summary, 0.15, {"slow": {"a": 0.1, "b": 0.2}, "fast": {"a": 0.3, "b": 0.4}})
    assert overlap["first_within_band"] and overlap["num_in_band"] == 1 and overlap["measured_firsts"] == ["a"]
    apart = validate.band_summary(out, summary, 0.15, {"slow": {"a": 0.1, "b": 0.3}, "fast": {"a": 0.2, "b": 0.4}})
    assert not apart["first_within_band"] and apart["goodput_band"] == {"a": (0.1, 0.2), "b": (0.3, 0.4)}


def test_pdlab_plan_writes_the_band_and_its_verdict(tmp_path):
    from experiments import cli

    out = tmp_path / "plan"
    code = cli.main(["plan", "--model", "tiny-random-llama", "--profile", str(PROFILE),
                     "--dataset", "synthetic", "--prompt-len", "4-30", "--output-len", "3-8",
                     "--num-requests", "20", "--devices", "2", "--rates", "100,400,1600",
                     "--slo-ttft-s", "0.01", "--slo-tpot-s", "0.0016", "--transport", "inprocess",
                     "--speed-spread", "0.2", "--top", "2", "--jobs", "1", "--out", str(out)])
    assert code == 0
    ranked = pd.read_csv(out / "plan.csv")
    assert ranked["goodput_slow"].notna().sum() == 2 and ranked["goodput_slow"].isna().sum() == 1
    assert (ranked["goodput_slow"].dropna() <= ranked["goodput_fast"].dropna()).all()
    banded = pd.read_csv(out / "plan_band_runs.csv")
    assert set(banded["candidate"]) == set(ranked["candidate"].head(2))
    assert len(banded) == 2 * 2 * 3 * 2  # candidates x speeds x rates x seeds (2: the default)
    assert "speed band ±20%" in (out / "plan.md").read_text()
    curve = pd.read_csv(out / "plan_curves.csv")
    assert curve["slo_attainment_slow"].notna().sum() == 2 * 3
