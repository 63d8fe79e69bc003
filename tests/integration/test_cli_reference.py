"""The committed CLI reference (docs/reference/cli.md) is what the parsers print now."""

from __future__ import annotations

import os
from pathlib import Path

from experiments import cli_reference
from experiments.cli import COMMANDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def test_cli_reference_page_equals_the_parsers_help():
    """Fails when an option, its help or its default changed without the page: regenerate it
    with ``python -m experiments.cli_reference > docs/reference/cli.md``."""
    assert PAGE.read_text() == cli_reference.render(), (
        f"{PAGE} is stale: run python -m experiments.cli_reference > docs/reference/cli.md")


def test_the_page_lists_every_command_and_leaves_columns_as_it_was(monkeypatch):
    monkeypatch.setenv("COLUMNS", "37")
    page = cli_reference.render()
    assert os.environ["COLUMNS"] == "37"
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings == ["## pdlab"] + [f"## pdlab {name}" for name in COMMANDS]
    # the fixed width, not the environment's 37 columns, wrapped the text
    assert max(len(line) for line in page.splitlines() if not line.startswith("#")) > 37

