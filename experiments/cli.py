"""The ``pdlab`` command: the only place that knows the commands (``COMMANDS``).

Each command is one module of ``experiments.commands`` with ``HELP``, ``add_arguments(parser)``,
``check(args)`` (every option checked before anything starts: no Ray, no model weights; raises
``ValueError`` naming the first bad option) and ``run(args, checked) -> exit code``. A command's
module is imported only when it runs (or its ``--help`` is asked for), so ``pdlab --help`` loads
neither torch nor Ray. Options come from the config dataclasses' fields
(``engine.config.add_dataclass_args``): one name, one default, one rule. A bad value exits 2 with
one line naming the option; an error while running exits 2 with one line keeping its root cause
(``engine.errors.describe_error``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from types import ModuleType

from engine.errors import describe_error


@dataclass(frozen=True)
class Command:
    """A ``pdlab`` command: its module under ``experiments.commands``, its one-line help,
    and keyword arguments for the module's ``add_arguments``."""

    module: str
    help: str
    options: dict = field(default_factory=dict)


COMMANDS = {
    "run": Command("compare", "one placement, one workload, one or more rates",
                   {"single": True}),
    "compare": Command("compare", "several placements on the same device set"),
    "serve": Command("serve", "an OpenAI-compatible HTTP server over one placement"),
    "bench": Command("bench", "the workloads of run/compare against any OpenAI-compatible "
                              "server (streaming HTTP)"),
    "profile": Command("profile", "prefill/decode phase profile of a model"),
    "kv-cost": Command("kv_cost", "KV transfer cost vs prefill cost"),
    "interference": Command("interference", "decode stall caused by a prefill, per mode"),
    "plan": Command("plan", "rank placements of N devices on the simulator (--validate: and "
                            "check it against real runs)"),
    "map": Command("map", "where disaggregation wins over SLO targets and prompt:output "
                          "ratios (--validate K: checked for real)"),
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``pdlab run: error: argument --x: ...``, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def load(name: str) -> ModuleType:
    """The module of command ``name`` (imported on first use: the one dynamic import of the
    CLI, so that a command's heavy imports load only when it runs)."""
    return importlib.import_module(f"experiments.commands.{COMMANDS[name].module}")


def build_parser(loaded: Collection[str] = tuple(COMMANDS)) -> Parser:
    """The ``pdlab`` parser with the options of the ``loaded`` commands (default: all); the
    others are listed with their help, but their modules are not imported."""
    parser = Parser(prog="pdlab", description=(
        "Placement experiments for disaggregated LLM serving: colocated vs disaggregated "
        "prefill/decode on the same devices, interference, KV-transfer cost."))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.help)
        if name in loaded:
            load(name).add_arguments(command_parser, **command.options)
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def option_message(err: ValueError, parser: argparse.ArgumentParser) -> str:
    """The message of ``err``, naming the option when it starts with the name of one of the
    command's options (a config dataclass's ``<field> must ...``)."""
    message = str(err)
    field_name = message.split(" ", 1)[0]
    if any(action.dest == field_name for action in parser._actions):
        message = f"argument --{field_name.replace('_', '-')}: {message}"
    return message


def check_options(args: argparse.Namespace):
    """Check ``args`` of any command before it starts anything; returns what the command's
    ``check`` returns (its checked options). Raises ValueError: the first bad option."""
    return load(args.command).check(args)


def main(argv: list[str] | None = None) -> int:
    """Parse and check every option (exit 2 naming the first bad one), then run the command.

    Returns:
        0 on success; 2 when the command failed (one line on stderr with the root cause)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    argv = sys.argv[1:] if argv is None else argv
    named = argv[:1] if argv and argv[0] in COMMANDS else []  # the command comes first
    args = build_parser(loaded=named).parse_args(argv)
    try:
        checked = check_options(args)
    except ValueError as err:
        args.command_parser.error(option_message(err, args.command_parser))
    try:
        return load(args.command).run(args, checked)
    except (ValueError, RuntimeError, OSError) as err:  # ModelLoadError is a ValueError
        print(f"pdlab {args.command}: error: {describe_error(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
