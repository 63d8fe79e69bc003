"""`pdlab profile` and `pdlab kv-cost` on the tiny model; the estimator and the fit on synthetic data."""

import argparse

import numpy as np
import pandas as pd
import pytest

from experiments import transfer_cost
from experiments.measure import profile_prefill
from experiments.commands import kv_cost, profile
from experiments.timing import describe, measure, measure_interleaved, summarize

REPEATS = 2


# ---- estimator -------------------------------------------------------------------------
def test_measure_counts_runs_and_reports_min_and_median():
    durations = iter([5.0, 3.0, 1.0, 2.0])  # warm-up first, then three timed runs
    now = [0.0]
    events = []

    def clock():
        return now[0]

    def run():
        events.append("run")
        now[0] += next(durations)

    timing = measure(run, 3, setup=lambda: events.append("setup"),
                     teardown=lambda: events.append("teardown"), clock=clock)
    assert events == ["setup", "run", "teardown"] * 4  # 1 warm-up + 3 timed
    assert timing.num_runs == 3 and timing.samples_s == (3.0, 1.0, 2.0)
    assert timing.min_s == 1.0 and timing.median_s == 2.0 and timing.min_s <= timing.median_s


def test_measure_with_real_clock_and_sync():
    syncs = []
    timing = measure(lambda: sum(range(1000)), 4, sync=lambda: syncs.append(1))
    assert timing.num_runs == 4 and 0 < timing.min_s <= timing.median_s
    assert len(syncs) == 2 * 5  # before start and before stop, warm-up included
    assert describe(4) == "min of 4 runs after 1 warm-up; the median beside it"


def test_interleaved_rounds_spread_a_drift_over_every_point():
    # the machine slows 10% per round: each point's samples come one per round, so the two
    # points' medians keep their true ratio (2.0), which back-to-back points would not
    now, rounds, order, ticks = [0.0], [0], [], []
    base = {"a": 1.0, "b": 2.0, "c": 0.5}

    def runner(key):
        def run():
            order.append(key)
            rounds[0] = (len(order) - 1) // len(base)
            now[0] += base[key] * (1 + 0.1 * rounds[0])
        return run

    setups = []
    points = {k: ((lambda k=k: setups.append(k)) if k == "a" else None, runner(k)) for k in base}
    timings = measure_interleaved(points, 3, clock=lambda: now[0], seed=1,
                                  on_run=lambda: ticks.append(1))
    assert list(timings) == ["a", "b", "c"] and len(ticks) == 4 * 3 and setups == ["a"] * 4
    assert all(sorted(order[3 * i:3 * i + 3]) == ["a", "b", "c"] for i in range(4))  # each round once
    assert len({tuple(order[3 * i:3 * i + 3]) for i in range(4)}) > 1  # shuffled per round
    assert timings["a"].samples_s == pytest.approx((1.1, 1.2, 1.3))  # round 0 is the warm-up
    assert timings["b"].median_s / timings["a"].median_s == pytest.approx(2.0)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure_interleaved(points, 0)
    order.clear()  # seed None: the benchmarks' contenders, every round in the order given
    from benchmarks import measure_interleaved as side_by_side

    fixed = side_by_side({k: run for k, (_, run) in points.items()}, 2,
                         setups={"a": points["a"][0]})
    assert order == ["a", "b", "c"] * 3 and setups == ["a"] * 7
    assert all(t.num_runs == 2 for t in fixed.values())


def test_measure_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure(lambda: None, 0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        measure(lambda: None, 1, warmup=-1)
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


# ---- fit -------------------------------------------------------------------------------
def test_fit_reproduces_exact_line():
    batch = np.array([1, 2, 4, 8, 16, 32])
    fit = profile.fit_linear(batch, 0.5 + 0.1 * batch)
    assert fit.a == pytest.approx(0.5, abs=1e-12) and fit.b == pytest.approx(0.1, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit(10) == pytest.approx(1.5)


def test_fit_r2_in_unit_interval():
    rng = np.random.default_rng(0)
    x = np.arange(1, 33)
    noisy = profile.fit_linear(x, 0.5 + 0.1 * x + rng.normal(0, 1.0, x.size))
    assert 0.0 <= noisy.r2 <= 1.0
    assert 0.0 <= profile.fit_linear(x, rng.normal(size=x.size)).r2 <= 1.0
    assert profile.fit_linear([1, 2, 3], [2.0, 2.0, 2.0]).r2 == 1.0  # constant, fitted exactly
    with pytest.raises(ValueError):
        profile.fit_linear([1], [1.0])


def test_pg_table_by_hand():
    prefill = pd.DataFrame({"prompt_len": [4, 8], "prefill_s": [0.2, 0.4]})
    fit = profile.LinearFit(a=0.01, b=0.001, r2=1.0)
    pg = profile.pg_table(prefill, fit, [4, 8], [1, 3])
    assert list(zip(pg["prompt_len"], pg["output_len"])) == [(4, 1), (4, 3), (8, 1), (8, 3)]
    row = pg.iloc[1]  # P=4, G=3: decode steps at contexts 5 and 6
    assert row["ttft_s"] == 0.2
    assert row["decode_s"] == pytest.approx(2 * 0.01 + 0.001 * (5 + 6))
    assert row["total_s"] == pytest.approx(0.2 + row["decode_s"])
    assert row["prompt_share"] == pytest.approx(0.2 / row["total_s"])
    assert pg.iloc[0]["decode_s"] == 0.0 and pg.iloc[0]["prompt_share"] == 1.0  # G=1: prefill only
    with pytest.raises(ValueError, match="prompt length 16"):
        profile.pg_table(prefill, fit, [16], [4])


# ---- profile on the tiny model ---------------------------------------------------------
def test_profile_prefill_and_decode_frames(tiny):
    prefill = profile_prefill(tiny, [1, 4, 16], REPEATS)
    assert list(prefill["prompt_len"]) == [1, 4, 16]
    assert {"prefill_s", "prefill_median_s", "per_token_s", "num_runs"} <= set(prefill.columns)
    assert (prefill["prefill_s"] > 0).all() and (prefill["prefill_s"] <= prefill["prefill_median_s"]).all()
    assert np.allclose(prefill["per_token_s"], prefill["prefill_s"] / prefill["prompt_len"])
    assert (prefill["num_runs"] == REPEATS).all()

    _, context, batch, mixed = profile.profile_interleaved(tiny, [4], [8, 32], [1, 2, 4], 16,
                                                           [8], [2], REPEATS,
                                                           context_batch_sizes=[1, 3])
    assert list(zip(context["batch_size"], context["context_len"])) == [(1, 8), (1, 32), (3, 8), (3, 32)]
    assert (context["step_s"] > 0).all()
    assert list(profile.single_row(context)["context_len"]) == [8, 32]

    assert list(batch["batch_size"]) == [1, 2, 4] and (batch["context_len"] == 16).all()
    assert (batch["step_s"] > 0).all()
    assert np.allclose(batch["per_token_s"], batch["step_s"] / batch["batch_size"])
    assert list(mixed[["prompt_len", "batch_size", "context_len"]].iloc[0]) == [8, 2, 16]
    for df in (context, batch, mixed):
        assert (df["num_runs"] == REPEATS).all() and (df["step_s"] <= df["step_median_s"]).all()


def test_run_profile_tiny(tiny, monkeypatch):
    seen = []

    def spy(points, repeats, **kwargs):  # every point of the four sweeps, in one set of rounds
        seen.append(sorted(map(str, points)))
        return measure_interleaved(points, repeats, **kwargs)

    monkeypatch.setattr(profile, "measure_interleaved", spy)
    result = profile.run_profile(tiny, prompt_lens=[4, 16], contexts=[8, 32], batch_sizes=[1, 2],
                                 batch_context=16, pg_prompts=[16, 32], pg_outputs=[4, 8],
                                 repeats=REPEATS, show_progress=False, mixed_prompts=[8],
                                 mixed_batch_sizes=[1, 2])
    assert len(seen) == 1 and len(seen[0]) == 3 + 2 * 2 + 2 + 2  # contexts at B = 1 and 8
    assert sorted(set(result.decode_context["batch_size"])) == [1, 8]
    for df in (result.prefill, result.decode_context, result.decode_batch, result.mixed):
        assert (df["num_runs"] == REPEATS).all() and (df["step_s" if "step_s" in df else "prefill_s"] > 0).all()
    assert list(result.mixed["batch_size"]) == [1, 2] and "rounds shuffled" in result.estimator
    assert list(result.prefill["prompt_len"]) == [4, 16, 32]  # P sweep and P x G prompts
    assert 0.0 <= result.batch_fit.r2 <= 1.0 and 0.0 <= result.context_fit.r2 <= 1.0
    assert result.ratio["prompt_len"] == 16 and result.ratio["ratio"] > 0
    assert len(result.pg) == 4 and ((result.pg["prompt_share"] > 0) & (result.pg["prompt_share"] <= 1)).all()
    assert (result.pg["total_s"] >= result.pg["ttft_s"]).all()
    assert "min of 2 runs" in result.estimator


def _result(prefill_s, step_s):
    """A ProfileResult of two prompt lengths, two decode rows per sweep and one mixed row,
    every time scaled from ``prefill_s`` / ``step_s``; median = 1.5 x min."""
    pre = pd.DataFrame({"prompt_len": [4, 16], "prefill_s": [prefill_s, 2 * prefill_s],
                        "prefill_median_s": [1.5 * prefill_s, 3 * prefill_s],
                        "per_token_s": [prefill_s / 4, 2 * prefill_s / 16], "num_runs": [2, 2]})
    dec = lambda rows: pd.DataFrame({  # noqa: E731
        "batch_size": [b for b, _ in rows], "context_len": [c for _, c in rows],
        "step_s": [step_s * b for b, _ in rows], "step_median_s": [1.5 * step_s * b for b, _ in rows],
        "per_token_s": [step_s for _ in rows], "num_runs": [2, 2]})
    mixed = pd.DataFrame({"prompt_len": [8], "batch_size": [2], "context_len": [16],
                          "step_s": [prefill_s + step_s], "step_median_s": [1.5 * (prefill_s + step_s)],
                          "num_runs": [2]})
    context, batch = dec([(1, 8), (1, 32)]), dec([(1, 16), (2, 16)])
    return profile.derive(pre, context, batch, mixed, 16, [16], [4], "min of 2 runs", [])


def test_pooled_profiles_take_the_fastest_run_and_the_median_of_medians():
    a, b, c = _result(0.1, 0.01), _result(0.3, 0.02), _result(0.2, 0.04)
    both = profile.pooled([a, b, c], ["cpu:0", "cpu:1", "cpu:2"])
    assert list(both.prefill["prefill_s"]) == [0.1, 0.2]  # a's, the fastest
    assert list(both.prefill["prefill_median_s"]) == pytest.approx([0.3, 0.6])  # c's, the median
    assert list(both.decode_batch["step_median_s"]) == pytest.approx([0.03, 0.06])  # b's
    assert list(both.mixed["step_s"]) == pytest.approx([0.11])
    assert (both.prefill["num_runs"] == 6).all() and (both.mixed["num_runs"] == 6).all()
    assert both.batch_fit.b == pytest.approx(0.01)  # the line through the pooled minima
    assert "measured on cpu:0,cpu:1,cpu:2 at once" in both.estimator
    assert list(both.pg["prompt_len"]) == [16] and both.ratio["prompt_len"] == 16
    other = profile.derive(a.prefill.iloc[:1], a.decode_context, a.decode_batch, a.mixed, 4,
                           [4], [4], "x", [])
    with pytest.raises(ValueError, match="different sweeps"):
        profile.pooled([a, other], ["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="at least one"):
        profile.pooled([], [])


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_profile_on_two_cores_at_once():
    from engine.config import ModelConfig

    result = profile.profile_on_devices(
        ModelConfig("tiny-random-llama"), ["cpu:0", "cpu:1"], prompt_lens=[4, 16],
        contexts=[8, 32], batch_sizes=[1, 2], batch_context=16, pg_prompts=[16], pg_outputs=[4],
        repeats=REPEATS, mixed_prompts=[8], mixed_batch_sizes=[1])
    for df in (result.prefill, result.decode_context, result.decode_batch, result.mixed):
        assert (df["num_runs"] == 2 * REPEATS).all()
    assert (result.prefill["prefill_s"] <= result.prefill["prefill_median_s"]).all()
    assert "measured on cpu:0,cpu:1 at once" in result.estimator


def test_profile_caps_sweeps_by_model_context(tiny):  # the tiny model has 256 positions
    kept = profile.cap_lengths(tiny, [16, 512], [16, 300], [64, 300], [16], 16, REPEATS)
    prompt_lens, contexts, pg_prompts, pg_outputs, notes = kept
    assert prompt_lens == [16] and contexts == [16] and pg_prompts == [64] and pg_outputs == [16]
    assert len(notes) == 3 and "256" in notes[0]


def test_profile_main_writes_outputs(tiny, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-random-llama", "--repeats", "1", "--out",
                              str(tmp_path), "--prompt-lens", "4,16", "--contexts", "8,16",
                              "--batch-sizes", "1,2", "--batch-context", "8",
                              "--pg-prompts", "16", "--pg-outputs", "4"])
    assert profile.run(args) == 0
    for name in ("prefill.csv", "decode_context.csv", "decode_batch.csv", "pg_table.csv",
                 "mixed.csv", "kv_cost.csv", "device_profile.json", "summary.md", "profile.png"):
        assert (tmp_path / name).stat().st_size > 0
    from planner.latency import DeviceProfile

    prof = DeviceProfile.load(tmp_path / "device_profile.json")
    assert (prof.model, prof.dtype, prof.device_kind) == ("tiny-random-llama", "float32", "cpu")
    assert prof.kv_bytes_per_token == tiny.kv_spec.bytes_per_token and prof.num_threads >= 1
    assert prof.prefill.num_points == 2 and prof.decode.num_points == 2 * 2 + 2  # contexts x B 1, 8; batch
    assert prof.mixed.num_points == 3 and set(prof.transfers) == {"inprocess"}
    out = capsys.readouterr().out
    assert "min of 1 runs after 1 warm-up; the median beside it" in out and "batch fit" in out
    assert "prefill step_s =" in out and "transfer inprocess:" in out
    assert "R^2" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("argv, option", [
    (["--dtype", "float64"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--repeats", "0"], "--repeats"),
    (["--prompt-lens", "16,x"], "--prompt-lens"),
    (["--batch-sizes", "0,2"], "--batch-sizes"),
])
def test_profile_bad_options_name_the_option(argv, option, capsys):
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert f"argument {option}" in capsys.readouterr().err


# ---- kv-cost on the tiny model ---------------------------------------------------------
def test_kv_cost_table_tiny_inprocess(tiny):
    df = transfer_cost.kv_cost_table(tiny, [8, 32], ("inprocess",), REPEATS, layers_per_chunk=1)
    assert list(zip(df["prompt_len"], df["mode"])) == [(8, "layer"), (8, "whole"),
                                                       (32, "layer"), (32, "whole")]
    assert (df["kv_bytes"] == 2 * 2 * 2 * 16 * df["prompt_len"] * 4).all()
    assert (df["kv_bytes"] == [tiny.kv_spec.kv_bytes(t) for t in df["prompt_len"]]).all()
    assert list(df["num_chunks"]) == [2, 1, 2, 1]
    for col in ("prefill_s", "memcpy_s", "memcpy_GBps", "transfer_s", "transfer_GBps",
                "transfer_over_prefill", "transfer_over_memcpy"):
        assert (df[col] > 0).all(), col
    assert (df["transfer_s"] <= df["transfer_median_s"]).all()
    assert np.allclose(df["transfer_over_prefill"], df["transfer_s"] / df["prefill_s"])
    assert (df["where"] == transfer_cost.WHERE["inprocess"]).all()


def test_kv_cost_export_matches_formula(tiny):
    kv = transfer_cost.export_prompt_kv(tiny, 5)
    assert tuple(kv.shape) == (2, 2, 2, 5, 16)
    assert kv.numel() * kv.element_size() == 2 * 2 * 2 * 16 * 5 * 4
    assert transfer_cost.layer_chunks(5, 2) == [(0, 2), (2, 4), (4, 5)]


def test_kv_cost_main_writes_outputs(tiny, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kv_cost.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-random-llama", "--repeats", "1", "--out",
                              str(tmp_path), "--prompt-lens", "8,16", "--transports", "inprocess"])
    assert kv_cost.run(args) == 0
    assert (tmp_path / "kv_cost.csv").stat().st_size > 0 and (tmp_path / "kv_cost.png").stat().st_size > 0
    assert len(pd.read_csv(tmp_path / "kv_cost.csv")) == 4
    assert "memcpy_GBps" in capsys.readouterr().out


@pytest.mark.parametrize("argv, option", [
    (["--transports", "inprocess,nccl"], "--transports"),
    (["--transports", "ray,ray"], "--transports"),
    (["--layers-per-chunk", "0"], "--layers-per-chunk"),
    (["--prompt-lens", ""], "--prompt-lens"),
])
def test_kv_cost_bad_options_name_the_option(argv, option, capsys):
    parser = argparse.ArgumentParser()
    kv_cost.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert f"argument {option}" in err
    if option == "--transports":
        assert "inprocess, ray, torchdist" in err


def test_kv_cost_rejects_unknown_transport_in_library(tiny):
    with pytest.raises(ValueError, match="transports must be among"):
        transfer_cost.kv_cost_table(tiny, [8], ("carrier-pigeon",), 1)


def test_device_profile_is_fitted_on_each_points_median_run(tiny):
    """Rows whose median run is 1.5x their fastest: the fitted models give the median's
    times (the simulator needs the typical step), not the minimum's."""
    from types import SimpleNamespace

    pre = lambda p: 0.01 + 1e-4 * p + 1e-8 * p * p  # noqa: E731
    dec = lambda b, c: 0.005 + 1e-3 * b + 1e-6 * b * c  # noqa: E731
    lens = [4, 16, 64, 128]
    prefill = pd.DataFrame({"prompt_len": lens, "prefill_s": [pre(p) for p in lens],
                            "prefill_median_s": [1.5 * pre(p) for p in lens]})
    rows = [(1, 16), (1, 64), (1, 256), (2, 64), (4, 64), (8, 64)]
    decode = pd.DataFrame({"batch_size": [b for b, _ in rows], "context_len": [c for _, c in rows],
                           "step_s": [dec(b, c) for b, c in rows],
                           "step_median_s": [1.5 * dec(b, c) for b, c in rows]})
    mixed = pd.DataFrame({"prompt_len": [16, 64], "batch_size": [2, 4], "context_len": [64, 64],
                          "step_s": [0.02 + pre(16) - 0.01 + dec(2, 64) - 0.005,
                                     0.02 + pre(64) - 0.01 + dec(4, 64) - 0.005]})
    mixed["step_median_s"] = 1.5 * mixed["step_s"]
    result = SimpleNamespace(prefill=prefill, decode_context=decode.iloc[:3], decode_batch=decode.iloc[3:],
                             mixed=mixed, estimator="x")
    prof = profile.fit_device_profile(result, tiny, "float32", "cpu")
    assert prof.notes["fitted_on"] == "median"
    assert prof.max_prefill_tokens == 128  # the longest prompt measured
    assert np.allclose(prof.prefill.coef, [0.015, 1.5e-4, 1.5e-8], rtol=1e-6)
    assert np.allclose(prof.decode.coef, [0.0075, 1.5e-3, 1.5e-6], rtol=1e-6)
    assert prof.mixed.coef[0] == pytest.approx(0.03)
