"""benchmarks/cpu_parity.py: every step runs a module or test file that exists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from benchmarks import cpu_parity

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_runs_something_that_exists():
    for name, argv in cpu_parity.STEPS.items():
        assert argv[0] == "-m" and importlib.util.find_spec(argv[1]) is not None, name
        for arg in argv[2:]:
            if arg.startswith("tests/"):
                assert (ROOT / arg).is_file(), arg
