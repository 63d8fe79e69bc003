"""How often each test that starts workers, kills them or times things fails: the tests
marked ``ray`` or ``workers`` (soak, self-healing, liveness, serve, every Ray test) run
``--runs`` times (default 10), each run a fresh ``pytest`` process; one row per test with
its failure count.

    python tests/flakiness.py [--runs N] [--marker EXPR] [--out DIR] [pytest paths or args]

Prints the table (tests that failed at least once first) and writes it to
``<out>/flakiness.csv`` (columns: test, runs, passed, failed, skipped; ``pd.read_csv``
reads it) beside each run's JUnit XML and output (default out:
``results/flakiness/<UTC time>``). A run that ends without its XML (pytest killed, a crash
at collection) is a row ``<run N: no report>`` with one failure, so nothing is lost
silently. Exit status: 0 when no test failed in any run, else 1.

A failure in a test that uses ``tmp_path`` or a port does not leak into the next run: each
run is its own process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
MARKER = "ray or workers"


def outcomes(junit: Path) -> dict[str, str]:
    """test id (``file::name[params]``) -> passed / failed / skipped, from pytest's JUnit XML
    (xunit2: an error at setup or teardown is a failure here)."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test = f"{path}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[test] = ("failed" if kinds & {"failure", "error"} else
                        "skipped" if "skipped" in kinds else "passed")
    return result


def table(runs: list[dict[str, str] | None]) -> pd.DataFrame:
    """One row per test over all runs (None: a run without a report); failed first."""
    counts: dict[str, Counter] = {}
    for i, run in enumerate(runs, 1):
        if run is None:
            run = {f"<run {i}: no report>": "failed"}
        for test, outcome in run.items():
            counts.setdefault(test, Counter())[outcome] += 1
    frame = pd.DataFrame([{"test": test, "runs": sum(c.values()), "passed": c["passed"],
                           "failed": c["failed"], "skipped": c["skipped"]}
                          for test, c in counts.items()],
                         columns=["test", "runs", "passed", "failed", "skipped"])
    return frame.sort_values(["failed", "test"], ascending=[False, True], ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="pytest runs (default 10)")
    parser.add_argument("--marker", default=MARKER, help=f"pytest -m (default {MARKER!r})")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the table and each run's report go")
    parser.add_argument("pytest_args", nargs="*", help="paths or pytest options (after --)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    out = args.out or ROOT / "results" / "flakiness" / datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)  # this checkout first, for Ray workers and subprocesses too
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    runs: list[dict[str, str] | None] = []
    for i in range(1, args.runs + 1):
        junit = out / f"run-{i:02d}.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-m", args.marker, f"--junitxml={junit}", "-o", "junit_family=xunit2",
                   *args.pytest_args]
        start_s = time.monotonic()
        with open(out / f"run-{i:02d}.log", "w") as log:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        runs.append(outcomes(junit) if junit.exists() else None)
        failed = (sum(o == "failed" for o in runs[-1].values()) if runs[-1] is not None
                  else "no report")
        print(f"flakiness: run {i}/{args.runs}: exit {code}, failed {failed}, "
              f"{time.monotonic() - start_s:.0f} s", file=sys.stderr, flush=True)
    frame = table(runs)
    frame.to_csv(out / "flakiness.csv", index=False)
    with pd.option_context("display.max_rows", None, "display.max_colwidth", None,
                           "display.width", 200):
        print(frame.to_string(index=False))
    print(f"flakiness: {int((frame['failed'] > 0).sum())} of {len(frame)} tests failed at "
          f"least once in {args.runs} runs; table in {out / 'flakiness.csv'}", file=sys.stderr)
    return 1 if (frame["failed"] > 0).any() else 0


if __name__ == "__main__":
    sys.exit(main())
