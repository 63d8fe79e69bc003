"""``tests/flakiness.py``: each test's failure count over several fresh pytest runs, the
tests it selects by marker, and a run without a report counted as a failure."""

from __future__ import annotations

import flakiness
import pandas as pd

FLAKY = '''
import os
from pathlib import Path

import pytest


@pytest.mark.workers
def test_steady():
    assert True


@pytest.mark.workers
def test_fails_on_odd_runs():
    count = Path(os.environ["FLAKY_COUNTER"])
    runs = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(runs))
    assert runs % 2 == 0


@pytest.mark.workers
@pytest.mark.parametrize("x", [1])
def test_skipped(x):
    pytest.skip("not here")


def test_unmarked_is_not_run():
    assert False
'''


def test_three_runs_count_each_test_s_failures(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_flaky_case.py").write_text(FLAKY)
    monkeypatch.setenv("FLAKY_COUNTER", str(tmp_path / "counter"))
    out = tmp_path / "out"
    code = flakiness.main(["--runs", "3", "--out", str(out), "--",
                           str(tmp_path / "test_flaky_case.py")])
    assert code == 1
    frame = pd.read_csv(out / "flakiness.csv")
    rows = {t.split("::")[-1]: (r, p, f, s) for t, r, p, f, s in frame.itertuples(index=False)}
    assert rows == {"test_fails_on_odd_runs": (3, 1, 2, 0), "test_steady": (3, 3, 0, 0),
                    "test_skipped[1]": (3, 0, 0, 3)}
    assert frame["test"].iloc[0].endswith("test_fails_on_odd_runs")  # failed first
    assert "test_fails_on_odd_runs" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("run-*.xml")) == ["run-01.xml", "run-02.xml",
                                                             "run-03.xml"]


def test_a_run_without_a_report_is_a_failure_row():
    frame = flakiness.table([{"a.py::t": "passed"}, None, {"a.py::t": "failed"}])
    assert frame.to_dict("records") == [
        {"test": "<run 2: no report>", "runs": 1, "passed": 0, "failed": 1, "skipped": 0},
        {"test": "a.py::t", "runs": 2, "passed": 1, "failed": 1, "skipped": 0}]
