"""Fitted latency models (planner.latency): known coefficients come back from
synthetic measurements, the profile file round-trips, and bad inputs are refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from planner.latency import (DeviceProfile, Fit, StepFeatures, TransferModel,
                                      fit_least_squares, fit_step_models, fit_transfer,
                                      step_correction, summary_lines)

# the true models of the synthetic device (seconds)
PRE = (2e-3, 1e-4, 3e-8)     # a + b·Σn + c·Σn(k+n)
DEC = (5e-3, 4e-4, 2e-7)     # a + b·B + c·Σctx
MIX_A = 6e-3


def _prefill_points():
    return [(StepFeatures(prefill_tokens=p, prefill_attention=p * p),
             PRE[0] + PRE[1] * p + PRE[2] * p * p) for p in (1, 16, 64, 128, 256, 512, 1024)]


def _decode_points():
    pts = []
    for b, ctx in [(1, 16), (1, 256), (1, 1024), (2, 64), (8, 64), (32, 64), (16, 512)]:
        f = StepFeatures(batch_size=b, sum_context=b * ctx)
        pts.append((f, DEC[0] + DEC[1] * b + DEC[2] * b * ctx))
    return pts


def _mixed_points():
    pts = []
    for p, b in [(64, 1), (64, 8), (256, 4)]:
        f = StepFeatures(p, p * p, b, b * 100)
        pts.append((f, MIX_A + PRE[1] * p + PRE[2] * p * p + DEC[1] * b + DEC[2] * b * 100))
    return pts


def test_step_models_recover_known_coefficients():
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    np.testing.assert_allclose(pre.coef, PRE, rtol=1e-6)
    np.testing.assert_allclose(dec.coef, DEC, rtol=1e-6)
    assert mix.coef[0] == pytest.approx(MIX_A, rel=1e-9)
    for fit in (pre, dec, mix):
        assert fit.r2 == pytest.approx(1.0) and fit.max_rel_err < 1e-6
    assert (pre.num_points, dec.num_points, mix.num_points) == (7, 7, 3)


def test_noisy_fit_reports_its_relative_error_and_r2():
    rng = np.random.default_rng(0)
    x = [[1.0, n] for n in range(1, 40)]
    y = [1e-3 + 1e-4 * n for n in range(1, 40)]
    noisy = [v * (1 + 0.05 * e) for v, e in zip(y, rng.uniform(-1, 1, len(y)))]
    fit = fit_least_squares(("1", "n"), x, noisy)
    pred = np.array(x) @ np.array(fit.coef)
    rel = np.abs(pred - noisy) / noisy
    assert fit.mean_rel_err == pytest.approx(rel.mean()) and fit.max_rel_err == pytest.approx(rel.max())
    ss_res = np.sum((np.array(noisy) - pred) ** 2)
    ss_tot = np.sum((np.array(noisy) - np.mean(noisy)) ** 2)
    assert fit.r2 == pytest.approx(1 - ss_res / ss_tot)
    assert fit.coef[1] == pytest.approx(1e-4, rel=0.05)


def test_a_slope_fitted_negative_is_dropped_not_kept():
    # y falls with x2 by noise only: the slope would come out negative; it is pinned at 0
    x = [[1.0, n, m] for n, m in [(1, 5), (2, 1), (3, 4), (4, 0), (5, 3)]]
    y = [1.0 + 0.5 * n - 0.01 * m for n, m in [(1, 5), (2, 1), (3, 4), (4, 0), (5, 3)]]
    fit = fit_least_squares(("1", "x1", "x2"), x, y)
    assert fit.coef[2] == 0.0 and fit.coef[1] > 0


def test_transfer_fit_recovers_latency_and_bandwidth():
    sizes = [1_000, 10_000, 100_000, 1_000_000, 10_000_000]
    model = fit_transfer(sizes, [2e-4 + b / 3e9 for b in sizes])
    assert model.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert model.bandwidth_bytes_s == pytest.approx(3e9, rel=1e-6)
    assert model.seconds(3_000_000) == pytest.approx(2e-4 + 1e-3, rel=1e-6)


def test_step_s_picks_the_model_by_the_batch_mix():
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    prof = DeviceProfile("m", "float32", "cpu", "x", 1, 100, pre, dec, mix)
    assert prof.step_s(StepFeatures(10, 100, 0, 0)) == pytest.approx(PRE[0] + PRE[1] * 10 + PRE[2] * 100)
    assert prof.step_s(StepFeatures(0, 0, 4, 400)) == pytest.approx(DEC[0] + DEC[1] * 4 + DEC[2] * 400)
    assert prof.step_s(StepFeatures(10, 100, 4, 400)) == pytest.approx(
        MIX_A + PRE[1] * 10 + PRE[2] * 100 + DEC[1] * 4 + DEC[2] * 400)
    assert prof.step_s(StepFeatures()) == 0.0


def test_profile_round_trips_and_names_what_it_was_measured_on(tmp_path):
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    prof = DeviceProfile("smollm2-135m", "float32", "cpu", "Some CPU", 1, 18432, pre, dec, mix,
                         {"inprocess": TransferModel(1e-4, 2e9)}, {"torch": "2.13"})
    path = prof.save(tmp_path / "p.json")
    d = json.loads(path.read_text())
    assert (d["model"], d["dtype"], d["device_kind"], d["num_threads"]) == ("smollm2-135m", "float32", "cpu", 1)
    assert DeviceProfile.load(path) == prof
    assert "max_prefill_tokens" not in d  # not recorded: an older profile's key set
    longest = prof.replace(max_prefill_tokens=1024)
    assert json.loads(longest.save(tmp_path / "q.json").read_text())["max_prefill_tokens"] == 1024
    assert DeviceProfile.load(tmp_path / "q.json") == longest


def test_without_mixed_points_the_mixed_intercept_is_the_larger_one():
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points())
    assert mix.coef[0] == max(pre.coef[0], dec.coef[0]) and math.isnan(mix.r2)
    assert mix.num_points == 0


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="needs >= 3 points"):
        fit_least_squares(("1", "a", "b"), [[1, 1, 1]], [1.0])
    with pytest.raises(ValueError, match="> 0 seconds"):
        fit_least_squares(("1", "a"), [[1, 1], [1, 2]], [1.0, 0.0])
    with pytest.raises(ValueError, match="bandwidth"):
        TransferModel(0.0, 0.0)
    (tmp_path / "bad.json").write_text('{"version": 1, "model": "m"}')
    with pytest.raises(ValueError, match="bad.json.*key 'dtype' missing"):
        DeviceProfile.load(tmp_path / "bad.json")
    prof = DeviceProfile("m", "float32", "cpu", "x", 1, 1, Fit(("1",), (1.0,), 1, 0, 0, 1),
                         Fit(("1",), (1.0,), 1, 0, 0, 1), Fit(("1",), (1.0,), 1, 0, 0, 1))
    with pytest.raises(ValueError, match="no transfer model for transport 'ray'.*--transports ray"):
        prof.transfer("ray")


def test_step_correction_is_the_median_of_measured_over_modelled():
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    prof = DeviceProfile("m", "float32", "cpu", "x", 1, 100, pre, dec, mix)
    step = prof.step_time()
    steps = [{"duration_s": k * step(n, 0, b, 0), "num_prefill_tokens": n, "num_decode_tokens": b}
             for k, n, b in [(2.0, 64, 0), (3.0, 0, 4), (2.5, 16, 2), (9.0, 0, 1)]]
    assert step_correction(steps, prof) == pytest.approx(2.75)  # median of 2, 2.5, 3, 9
    assert math.isnan(step_correction([], prof))


def test_step_correction_models_a_rebuilt_step_on_its_own_batch():
    """A step carrying its rebuilt batch is modelled with the attention and context terms;
    the bare token counts would leave them out and read a long-context decode as slower."""
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    prof = DeviceProfile("m", "float32", "cpu", "x", 1, 100, pre, dec, mix)
    step = prof.step_time()
    batch = {"prefill_tokens": 0, "prefill_attention": 0, "batch_size": 4, "sum_context": 4 * 2000}
    rebuilt = {"duration_s": 1.5 * step(0, 0, 4, 8000), "num_prefill_tokens": 0,
               "num_decode_tokens": 4, "rebuilt": True, **batch}
    assert step_correction([rebuilt], prof) == pytest.approx(1.5)
    bare = {k: rebuilt[k] for k in ("duration_s", "num_prefill_tokens", "num_decode_tokens")}
    assert step_correction([bare], prof) > 1.5 * 1.2  # the lower bound it used to be
    assert math.isnan(step_correction([{**rebuilt, "rebuilt": False}], prof))


def test_a_scaled_profile_predicts_every_step_that_much_longer():
    pre, dec, mix = fit_step_models(_prefill_points(), _decode_points(), _mixed_points())
    prof = DeviceProfile("m", "float32", "cpu", "x", 1, 100, pre, dec, mix,
                         {"ray": TransferModel(0.01, 1e9)})
    twice = prof.scaled(2.0)
    for f in (StepFeatures(64, 64 * 64), StepFeatures(batch_size=4, sum_context=400),
              StepFeatures(32, 32 * 40, 3, 300)):
        assert twice.step_s(f) == pytest.approx(2.0 * prof.step_s(f))
    assert twice.transfers == prof.transfers and twice.scaled(1.5).notes["step_scale"] == 3.0
    assert prof.scaled(1.0) is prof
    assert any("scaled x2" in line for line in summary_lines(twice))
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="step scale"):
            prof.scaled(bad)
