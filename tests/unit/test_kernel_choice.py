"""The kernel selector (``engine/kernel_choice.py``, issue 30) on fake timings: it keeps the
fastest candidate per row bucket, writes its choices to the cache file and reads them back
without measuring, and measures again for another CPU or a candidate it no longer has."""

from __future__ import annotations

import json

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


def test_measure_min_s_times_every_run_and_cache_path_depends_on_the_key(tmp_path):
    calls = {"a": 0, "b": 0}

    def count(name):
        def run():
            calls[name] += 1
        return run
    seconds = kernel_choice.measure_min_s({"a": count("a"), "b": count("b")}, rounds=2,
                                          min_sample_s=0.0)
    assert set(seconds) == {"a", "b"} and all(s >= 0 for s in seconds.values())
    assert calls == {"a": 3, "b": 3}  # one warm-up + two timed rounds, one call each
    assert kernel_choice.cache_path(ZEN3, tmp_path) != kernel_choice.cache_path(ZEN4, tmp_path)
    assert kernel_choice.cache_path(ZEN3, tmp_path) == kernel_choice.cache_path(dict(ZEN3),
                                                                                tmp_path)


def test_describe_buckets_names_row_ranges():
    assert describe_buckets({0: "pdlab", 1: "pdlab", 8: "pdlab", 9: "mkl"}) == \
        "1-256 pdlab, 257+ mkl"
    assert describe_buckets({0: "mkl", 1: "onednn", 2: "onednn", 3: "mkl"}) == \
        "1 mkl, 2-4 onednn, 5+ mkl"
    assert describe_buckets({0: "mkl", 1: "pdlab", 2: "mkl"}) == "1 mkl, 2 pdlab, 3+ mkl"
    assert describe_buckets({0: "paged"}) == "1+ paged"
    assert kernel_choice.isa_summary("fpu avx2 fma avx512f avx512bw") == "avx2 fma avx512f avx512bw"
