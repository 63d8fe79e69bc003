"""Placement search (planner.search): candidates, the rate bracket refinement and
the goodput ranking, on hand-built attainment curves."""

from __future__ import annotations

import pandas as pd
import pytest

from planner import search


def test_candidates_of_three_devices():
    labels = [c.label for c in search.candidates(3, [256, 128])]
    assert labels == ["colocated:3", "colocated:3 (budget 128)", "colocated:3 (budget 256)",
                      "colocated-nochunk:3", "disagg:1p1d", "disagg:1p2d", "disagg:2p1d"]
    assert [c.num_devices for c in search.candidates(3)] == [3, 3, 2, 3, 3]
    with pytest.raises(ValueError, match="devices must be >= 1"):
        search.candidates(0)


def _runs(curves: dict[str, tuple[int, list[tuple[float, float]]]]) -> pd.DataFrame:
    rows = []
    for label, (n_dev, points) in curves.items():
        for rate, att in points:
            for seed, delta in ((0, 0.02), (1, -0.02)):  # seeds straddle the mean
                rows.append({"candidate": label, "placement": label, "chunk_budget": None,
                             "num_devices": n_dev, "rate": rate, "seed": seed,
                             "slo_attainment": att + delta, "ttft_p50_s": rate, "ttft_p99_s": 1.0,
                             "tpot_p50_s": 0.1, "tpot_p99_s": 0.2})
    return pd.DataFrame(rows)


def test_rank_reads_distserve_goodput_per_device_best_first():
    runs = _runs({"colocated:2": (2, [(1, 0.99), (2, 0.95), (4, 0.5)]),
                  "disagg:1p1d": (2, [(1, 0.99), (2, 0.97), (4, 0.93), (8, 0.2)]),
                  "disagg:1p2d": (3, [(1, 0.5), (2, 0.99)])})  # misses the lowest: 0
    ranked = search.rank(runs)
    assert list(ranked["candidate"]) == ["disagg:1p1d", "colocated:2", "disagg:1p2d"]
    assert list(ranked["goodput_per_device_req_s"]) == [2.0, 1.0, 0.0]  # 4/2, 2/2, 0
    assert list(ranked["goodput_rate"]) == [4, 2, 1]
    assert ranked.loc[0, "ttft_p50_s"] == 4  # latencies at the goodput rate
    assert list(ranked["rank"]) == [1, 2, 3]
    assert not ranked["at_sweep_top"].any()
    # a candidate that still meets the target at the top of its sweep is only a lower bound
    top = search.rank(_runs({"colocated:2": (2, [(1, 0.99), (2, 0.97)])}))
    assert top.loc[0, "goodput_per_device_req_s"] == 1.0 and bool(top.loc[0, "at_sweep_top"])


def test_refine_rates_adds_points_inside_the_bracket_only():
    runs = _runs({"a": (1, [(1, 0.99), (4, 0.95), (16, 0.5)]),
                  "all": (1, [(1, 0.99), (2, 0.99)]), "none": (1, [(1, 0.3), (2, 0.1)])})
    extra = search.refine_rates(runs, num_points=3)
    assert set(extra) == {"a"}
    assert extra["a"] == [5.66, 8.0, 11.3]  # geometric between 4 and 16


def test_attainment_plot_overlays_the_simulated_curve_dashed(tmp_path, monkeypatch):
    from experiments import plots

    seen = {}
    real_save = plots._save

    def keep(fig, path):
        seen["lines"] = [(ln.get_label(), ln.get_linestyle()) for ln in fig.axes[0].get_lines()]
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    measured = pd.DataFrame({"placement": ["colocated:2"] * 2, "rate": [1.0, 2.0],
                             "slo_attainment": [0.95, 0.5]})
    simulated = measured.assign(slo_attainment=[0.97, 0.4])
    path = plots.plot_attainment(measured, tmp_path / "a.png", simulated=simulated)
    assert path.stat().st_size > 0
    assert ("colocated:2 (measured)", "-") in seen["lines"]
    assert ("colocated:2 (simulated)", "--") in seen["lines"]


def test_sweep_over_two_processes_gives_the_rows_of_one():
    from pathlib import Path

    from engine.config import EngineConfig
    from engine.metrics import SLO
    from engine.request import Request, SamplingParams
    from planner.latency import DeviceProfile

    profile = DeviceProfile.load(Path(__file__).resolve().parents[1] / "data"
                                 / "tiny_device_profile.json")
    requests = {seed: [Request(f"s{seed}-{i}", tuple(range(3, 3 + 8 + 5 * i)),
                               SamplingParams(max_tokens=4 + i % 3, ignore_eos=True))
                       for i in range(12)] for seed in (0, 1)}
    cands = [c for c in search.candidates(2, []) if c.placement in ("colocated:2", "disagg:1p1d")]
    transfer = next(iter(profile.transfers.values()))
    args = (cands, {cands[0].label: [2.0, 8.0], cands[1].label: [4.0]}, requests,
            EngineConfig(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32),
            profile, transfer, SLO(1.0, 0.1))
    one, two = search.sweep(*args, jobs=1), search.sweep(*args, jobs=2)
    assert len(one) == 6 and list(one["rate"]) == [2.0, 2.0, 8.0, 8.0, 4.0, 4.0]
    pd.testing.assert_frame_equal(one.drop(columns="sim_s"), two.drop(columns="sim_s"))


def test_workers_start_without_the_parents_main_module():
    """While a sweep starts its workers, ``__main__`` shows multiprocessing neither a module
    name nor a path (so a spawned worker does not import pdlab's CLI, and torch); both are
    back afterwards."""
    import multiprocessing.spawn
    import sys

    main = sys.modules["__main__"]
    before = (main.__dict__.get("__spec__"), main.__dict__.get("__file__"))
    with search._children_skip_main():
        data = multiprocessing.spawn.get_preparation_data("w")
        assert "init_main_from_name" not in data and "init_main_from_path" not in data
    assert (main.__dict__.get("__spec__"), main.__dict__.get("__file__")) == before
    if before != (None, None):  # pytest's __main__ has a path: it would have been passed
        data = multiprocessing.spawn.get_preparation_data("w")
        assert "init_main_from_name" in data or "init_main_from_path" in data


def test_plan_speed_runs_from_a_clean_checkout_on_its_reference_profile(tmp_path, monkeypatch):
    from benchmarks import plan_speed
    from engine.config import ModelConfig

    monkeypatch.chdir(tmp_path)  # no results/profile-*: the built-in profile
    profile, source = plan_speed.load_profile(None, ModelConfig("smollm2-135m"))
    assert source.startswith("REFERENCE_PROFILE")
    assert profile.model == "smollm2-135m" and "ray" in profile.transfers
    assert profile.step_time()(0, 0, 2, 100) == pytest.approx(
        0.045976369793162795 + 2 * 0.004722918813309089 + 100 * 9.028762355320699e-06)


def test_prompts_longer_than_the_profile_measured_are_warned_about(tmp_path):
    from pathlib import Path

    from experiments import cli
    from experiments.commands.plan import prefill_range_warning
    from planner.latency import DeviceProfile

    path = Path(__file__).resolve().parents[1] / "data" / "tiny_device_profile.json"
    old = DeviceProfile.load(path)
    assert old.max_prefill_tokens is None and prefill_range_warning(old, 10**6) == ""
    short = old.replace(max_prefill_tokens=16)
    assert prefill_range_warning(short, 16) == ""
    text = prefill_range_warning(short, 30)
    assert "prompts of up to 30 tokens" in text and "only up to 16" in text
    out = tmp_path / "plan"
    code = cli.main(["plan", "--model", "tiny-random-llama", "--profile",
                     str(short.save(tmp_path / "short.json")), "--dataset", "synthetic",
                     "--prompt-len", "30", "--output-len", "3-8", "--num-requests", "8",
                     "--devices", "1", "--rates", "100,400", "--transport", "inprocess",
                     "--seeds", "1", "--jobs", "1", "--out", str(out)])
    assert code == 0
    plan_md = (out / "plan.md").read_text()
    assert "only up to 16" in plan_md and "--prompt-lens ...,30" in plan_md
