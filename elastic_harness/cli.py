"""Command line: thin. Parses, calls the library, prints.

Each subcommand lives in its own module exposing ``register(subparsers)``; the parser it
adds sets ``func(args) -> int``. A ``HarnessError`` becomes one clear line on stderr and its
exit code; anything else is a bug and keeps its traceback. Command modules import torch
(and other heavy libraries) inside the functions that need it, never at module level, so
``--help`` and ``spec`` answer at once (``tests/cli/test_cli_imports.py`` checks it).
"""

from __future__ import annotations

import sys
import typing

from elastic_harness.errors import HarnessError

if typing.TYPE_CHECKING:
    import argparse

# Subcommand modules, in --help order.
COMMANDS = [
    "elastic_harness.commands.run",
    "elastic_harness.commands.submit",
    "elastic_harness.commands.jobs",
    "elastic_harness.commands.agent",
    "elastic_harness.commands.spec",
    "elastic_harness.commands.report",
    "elastic_harness.commands.chaos",
    "elastic_harness.commands.ckpt",
    "elastic_harness.commands.k8s",
    "elastic_harness.commands.slurm",
    "elastic_harness.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    import argparse  # here, not at the top: Ctrl-C while it loads is `entry`'s to catch
    import importlib

    parser = argparse.ArgumentParser(
        prog="elastic-harness",
        description="Fault-tolerant elastic training for PyTorch (torchelastic + DCP).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    _plain_descriptions(parser)
    return parser


def _plain_descriptions(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's description as ``--help`` shows it: many are their module's
    docstring, whose reST literal marks (double backticks) a terminal does not render."""
    import argparse
    import re

    parser.description = re.sub(r"``(.+?)``", r"\1", parser.description or "", flags=re.DOTALL) or None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _plain_descriptions(sub)


def main(argv: list[str] | None = None) -> int:
    return _dispatch(parse(build_parser(), sys.argv[1:] if argv is None else list(argv)))


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, but ``run``/``submit [FLAGS] train.py [SCRIPT ARGS]`` keeps
    everything after the script for the script (``args.script_args``), as torchrun does, and
    takes the flags ``eh.init(argv=...)`` would take from them (``jobargs.take_script_flags``)."""
    argv, rest = split_script_args(parser, argv)
    args = parser.parse_args(argv)
    args.script_args = rest
    if rest:
        from elastic_harness.commands.jobargs import take_script_flags

        try:
            take_script_flags(args)
        except HarnessError as e:
            parser.exit(e.exit_code, f"error: {e}\n")
    return args


def split_script_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(``run``'s or ``submit``'s own arguments up to a ``.py`` script, the script's), or (argv, [])."""
    if argv[:1] not in (["run"], ["submit"]):
        return argv, []
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    valued = {o for a in sub.choices[argv[0]]._actions if a.nargs != 0 for o in a.option_strings}
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            break
        if token.startswith("-"):
            i += 2 if token in valued else 1
            continue
        return (argv[: i + 1], argv[i + 1:]) if token.endswith(".py") else (argv, [])
    return argv, []


def entry() -> None:
    """The ``elastic-harness`` program: ``main``, then exit. Commands that end with torch
    loaded and their work recorded (``run``, ``agent``: ``fast_exit`` in their defaults)
    skip the interpreter's teardown (``procexit``): a second off every run's end. Ctrl-C
    while the commands are still being imported (the first few tenths of a second) is the
    same one line and exit 130 as later, not an import's traceback."""
    try:
        args = parse(build_parser(), sys.argv[1:])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    code = _dispatch(args)
    if getattr(args, "fast_exit", False):
        from elastic_harness.procexit import exit_without_teardown

        exit_without_teardown(code)
    sys.exit(code)


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `elastic-harness spec | head`
        sys.stderr.close()
        return 0
    finally:
        _warn_skipped_events()


def _warn_skipped_events() -> None:
    """Event logs this command read that held lines which are not events: said once each."""
    if "elastic_harness.events" in sys.modules and not sys.stderr.closed:
        for note in sys.modules["elastic_harness.events"].skipped_notes():
            print(f"warning: {note}", file=sys.stderr)


if __name__ == "__main__":
    entry()
