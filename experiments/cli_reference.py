"""The CLI reference page (docs/reference/cli.md), printed from the ``pdlab`` parsers:
``python -m experiments.cli_reference > docs/reference/cli.md`` writes it, and
``tests/integration/test_cli_reference.py`` fails when the page differs from ``render()``.
argparse formats every command's options at a fixed ``WIDTH``, so the page does not depend on the
terminal (rendering imports every command's module; ``pdlab --help`` still loads none)."""

from __future__ import annotations

import os
import sys

from experiments.cli import COMMANDS, build_parser

WIDTH = 100  # argparse's help width (it reads $COLUMNS); fixed so the page is reproducible

HEADER = """\
# CLI reference

Every `pdlab` command's `--help`, generated from the argparse parsers by
`python -m experiments.cli_reference > docs/reference/cli.md`. A test
(`tests/integration/test_cli_reference.py`) fails when this page differs from what the
parsers print, so regenerate it after changing an option.
"""


def render() -> str:
    """The reference page: ``pdlab --help``, then each command's ``--help`` in
    ``experiments.cli.COMMANDS`` order, each in a fenced block under its own heading."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if a.dest == "command").choices
        parts = [HEADER, "## pdlab\n", "```text\n" + parser.format_help().rstrip() + "\n```\n"]
        for name in COMMANDS:
            parts.append(f"## pdlab {name}\n")
            parts.append("```text\n" + commands[name].format_help().rstrip() + "\n```\n")
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
