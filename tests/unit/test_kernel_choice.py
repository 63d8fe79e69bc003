"""The kernel selector (``engine/kernel_choice.py``) on fake timings: it keeps the
fastest candidate per row bucket, writes its choices to the cache file and reads them back
without measuring, and measures again for another CPU or a candidate it no longer has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import kernel_choice
from engine.kernel_choice import KernelSelector, bucket, describe_buckets

ZEN3 = {"cpu_model": "AMD EPYC", "cpu_family": "25", "cpu_model_id": "1", "threads": 1}
ZEN4 = dict(ZEN3, cpu_model_id="17")
# seconds per call: MKL wins at 1 row, pdlab at 2-4, oneDNN from 5 on
FAKE_S = {0: {"mkl": 1.0, "onednn": 2.0, "pdlab": 3.0},
          1: {"mkl": 3.0, "onednn": 2.0, "pdlab": 1.0},
          2: {"mkl": 3.0, "onednn": 2.0, "pdlab": 1.5},
          3: {"mkl": 3.0, "onednn": 0.5, "pdlab": 1.0}}


class FakeTimer:
    """Returns ``FAKE_S`` for the bucket whose rows the candidates were built for, and counts
    the measurements."""

    def __init__(self):
        self.calls = []

    def __call__(self, runs):
        rows = {run() for run in runs.values()}
        assert len(rows) == 1  # every candidate built for the same row count
        b = bucket(rows.pop())
        self.calls.append(b)
        return {name: FAKE_S[b][name] for name in runs}


def _candidates(names=("mkl", "onednn", "pdlab")):
    return {name: (lambda rows: (lambda: rows)) for name in names}


def test_buckets_are_ceil_log2():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 256, 257, 512)] == [
        0, 1, 2, 2, 3, 3, 4, 8, 9, 9]


def test_choice_for_reads_the_bucket_and_holds_the_last_one_beyond():
    choices = {0: "pdlab", 1: "pdlab512", 2: "onednn"}
    assert [kernel_choice.choice_for(choices, n, 2, "mkl") for n in (1, 2, 3, 4, 5, 4096)] == [
        "pdlab", "pdlab512", "onednn", "onednn", "onednn", "onednn"]
    assert kernel_choice.choice_for({}, 7, 2, "flash") == "flash"  # nothing measured


def test_picks_the_fastest_then_reads_the_cache_without_measuring(tmp_path):
    path = tmp_path / "choices.json"
    timer = FakeTimer()
    first = KernelSelector(ZEN3, path, timer).choose("linear", "576x960", [0, 1, 2, 3],
                                                     _candidates())
    assert first == {0: "mkl", 1: "pdlab", 2: "pdlab", 3: "onednn"}
    assert timer.calls == [0, 1, 2, 3]
    stored = json.loads(path.read_text())
    assert stored == {"key": ZEN3, "choices": {"linear/576x960": {
        "0": "mkl", "1": "pdlab", "2": "pdlab", "3": "onednn"}}}
    again = FakeTimer()  # a later process on the same machine
    assert KernelSelector(ZEN3, path, again).choose("linear", "576x960", [0, 1, 2, 3],
                                                    _candidates()) == first
    assert again.calls == []
    # another shape class is measured and added beside the first in the same file
    KernelSelector(ZEN3, path, again).choose("linear", "576x576", [0], _candidates())
    assert again.calls == [0]
    assert set(json.loads(path.read_text())["choices"]) == {"linear/576x960", "linear/576x576"}


def test_another_cpu_invalidates_the_cache(tmp_path):
    path = tmp_path / "choices.json"
    KernelSelector(ZEN3, path, FakeTimer()).choose("linear", "576x960", [0, 1], _candidates())
    timer = FakeTimer()
    other = KernelSelector(ZEN4, path, timer)
    assert other.choices == {}  # the stored choices were for another CPU
    other.choose("linear", "576x960", [0, 1], _candidates())
    assert timer.calls == [0, 1]
    assert json.loads(path.read_text())["key"] == ZEN4


def test_a_cached_choice_that_is_not_a_candidate_here_is_measured_again(tmp_path):
    path = tmp_path / "choices.json"
    KernelSelector(ZEN3, path, FakeTimer()).choose("linear", "576x960", [1], _candidates())
    timer = FakeTimer()  # pdlab (the cached choice for bucket 1) missing in this process
    got = KernelSelector(ZEN3, path, timer).choose("linear", "576x960", [1],
                                                   _candidates(("mkl", "onednn")))
    assert got == {1: "onednn"} and timer.calls == [1]


def test_one_candidate_needs_no_measurement_and_none_is_refused(tmp_path):
    timer = FakeTimer()
    selector = KernelSelector(ZEN3, None, timer)  # in memory only
    assert selector.choose("linear", "8x8", [0, 5], _candidates(("mkl",))) == {0: "mkl",
                                                                              5: "mkl"}
    assert timer.calls == []
    with pytest.raises(ValueError, match="no candidate kernel for linear 8x8"):
        selector.choose("linear", "8x8", [0], {})


def test_a_corrupt_cache_file_is_measured_again(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    timer = FakeTimer()
    KernelSelector(ZEN3, path, timer).choose("linear", "576x960", [0], _candidates())
    assert timer.calls == [0] and json.loads(path.read_text())["key"] == ZEN3


def test_measure_median_s_takes_each_candidates_median_in_rotated_rounds(monkeypatch):
    """On a fake clock: each call advances it by its scripted seconds. The candidates run
    one warm-up each, then 3 rounds starting at a, b, c in turn; each gets the median of its
    3 samples, so a's one fast sample (0.5, a lucky moment) and c's one slow sample (9, a
    burst of load) move nothing, where the minimum would have made a the fastest."""
    now = [0.0]
    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: now[0])
    script = {"a": [1.0, 2.0, 0.5, 2.0], "b": [1.0, 1.5, 1.5, 1.5], "c": [1.0, 1.0, 9.0, 1.0]}
    order = []

    def run(name):
        def call():
            order.append(name)
            now[0] += script[name][sum(1 for n in order if n == name) - 1]
        return call
    seconds = kernel_choice.measure_median_s({name: run(name) for name in "abc"}, rounds=3,
                                             min_sample_s=0.0)
    assert seconds == {"a": 2.0, "b": 1.5, "c": 1.0}
    assert "".join(order) == "abc" + "abc" + "bca" + "cab"  # warm-up, then rotated rounds
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        kernel_choice.measure_median_s({"a": run("a")}, rounds=0)


def test_candidates_far_behind_leave_the_race_after_three_rounds(monkeypatch):
    """a 1.0 s and b 1.25 s per call stay within 1.3x of each other and run all 5 rounds; c
    at 1.5 s (> 1.3 x 1.0) is dropped after round 3. Alone in the race, a stops at once."""
    now = [0.0]
    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: now[0])
    cost, order = {"a": 1.0, "b": 1.25, "c": 1.5}, []

    def run(name):
        def call():
            order.append(name)
            now[0] += cost[name]
        return call
    seconds = kernel_choice.measure_median_s({name: run(name) for name in "abc"}, rounds=5,
                                             min_sample_s=0.0)
    assert seconds == pytest.approx({"a": 1.0, "b": 1.25, "c": 1.5})
    assert "".join(order) == "abc" + "abc" + "bca" + "cab" + "ba" + "ab"
    order.clear()
    cost["b"] = 2.0
    kernel_choice.measure_median_s({name: run(name) for name in "ab"}, rounds=5,
                                   min_sample_s=0.0)
    assert "".join(order) == "ab" + "ab" + "ba" + "ab"  # warm-up, 3 rounds; then a is alone


def test_short_calls_are_repeated_within_a_sample(monkeypatch):
    """A 1 ms call with 5 ms samples: 5 calls per sample, and the per-call time reported."""
    now, calls = [0.0], [0]

    def call():
        calls[0] += 1
        now[0] += 0.001
    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: now[0])
    seconds = kernel_choice.measure_median_s({"x": call}, rounds=3, min_sample_s=0.005)
    assert calls[0] == 1 + 3 * 5 and seconds["x"] == pytest.approx(0.001)


def test_cache_path_depends_on_the_key(tmp_path):
    assert kernel_choice.cache_path(ZEN3, tmp_path) != kernel_choice.cache_path(ZEN4, tmp_path)
    assert kernel_choice.cache_path(ZEN3, tmp_path) == kernel_choice.cache_path(dict(ZEN3),
                                                                                tmp_path)


def test_machine_key_changes_with_the_cpu_and_the_timing_method(monkeypatch):
    """The real key: a Zen 4 and a Zen 5 core both call themselves "AMD EPYC", but their
    family/model ids and flags differ, so each has its own cache file; the timing method is
    in the key, so choices measured by an older method are measured again."""
    zen4 = {"model": "AMD EPYC", "family": "25", "model_id": "17", "flags": "avx2 avx512f"}
    zen5 = {"model": "AMD EPYC", "family": "26", "model_id": "2",
            "flags": "avx2 avx512f avx512_vp2intersect"}
    monkeypatch.setattr(kernel_choice, "cpu_info", lambda: zen4)
    key4 = kernel_choice.machine_key(1, "build")
    monkeypatch.setattr(kernel_choice, "cpu_info", lambda: zen5)
    key5 = kernel_choice.machine_key(1, "build")
    assert (key4["cpu_family"], key4["cpu_model_id"]) == ("25", "17")
    assert (key5["cpu_family"], key5["cpu_model_id"]) == ("26", "2")
    assert key4["cpu_flags_sha"] != key5["cpu_flags_sha"]
    assert key5["timer"] == kernel_choice.TIMER == "median-of-7x5ms-rotated-pruned-3x1.3"
    assert kernel_choice.cache_path(key4, Path("/x")) != kernel_choice.cache_path(key5, Path("/x"))
    monkeypatch.setattr(kernel_choice, "TIMER", "min-of-3x2ms")
    assert kernel_choice.machine_key(1, "build") != key5


def test_describe_buckets_names_row_ranges():
    assert describe_buckets({0: "pdlab", 1: "pdlab", 8: "pdlab", 9: "mkl"}) == \
        "1-256 pdlab, 257+ mkl"
    assert describe_buckets({0: "mkl", 1: "onednn", 2: "onednn", 3: "mkl"}) == \
        "1 mkl, 2-4 onednn, 5+ mkl"
    assert describe_buckets({0: "mkl", 1: "pdlab", 2: "mkl"}) == "1 mkl, 2 pdlab, 3+ mkl"
    assert describe_buckets({0: "paged"}) == "1+ paged"
    assert kernel_choice.isa_summary("fpu avx2 fma avx512f avx512bw") == "avx2 fma avx512f avx512bw"
