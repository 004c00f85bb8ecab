"""Command line: ``python -m pscompile <command> [flags]``.

Commands are registered in ``_COMMANDS`` (name -> add-arguments function, run function), one module
each: ``train`` (``cli/train.py``), ``inspect`` (``cli/inspect.py``), ``plan`` (``cli/plan.py``), ``bench`` (``cli/bench.py``).

Exit codes: 0 success; 2 bad flags or configuration, including a device budget too small for
the model (the one-line message says what would work); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from pscompile import __version__

from pscompile.cli.bench import add_bench_arguments, bench_command
from pscompile.cli.inspect import add_inspect_arguments, inspect_command
from pscompile.cli.plan import add_plan_arguments, plan_command
from pscompile.cli.train import add_train_arguments, train_command


_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "train": ("train a GPT preset on a byte-level stdlib corpus under a device budget",
              add_train_arguments, train_command),
    "inspect": ("compile a GPT preset (compiled mode) and print and save its memory schedule",
                add_inspect_arguments, inspect_command),
    "plan": ("plan a GPT for a machine one does not have (fake tensors): fits?, chunks, bytes, time",
             add_plan_arguments, plan_command),
    "bench": ("run a benchmark of bench/ (--list: which question each answers); default bench/compare.py",
              add_bench_arguments, bench_command),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pscompile",
                                     description="Train PyTorch models that do not fit in device memory.")
    parser.add_argument("--version", action="version", version=f"pscompile {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (help_text, add_arguments, run) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, by name."""
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> str:
    """The error for flags ``command`` does not take: which other command takes each, and where
    the flags are listed."""
    parsers = command_parsers(parser)
    notes = []
    for flag in (e.split("=")[0] for e in extra if e.startswith("--")):
        others = [name for name, p in parsers.items() if name != command and flag in p._option_string_actions]
        if others:
            notes.append(f"{flag} is a flag of {' and '.join(others)}")
    return (f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(notes)})" if notes else "")
            + f"; {command} takes the flags above (python -m pscompile {command} --help, docs/cli.md)")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra
    elif extra:
        command_parsers(parser)[args.command].error(unrecognized(parser, args.command, extra))
    try:
        return args.run(args)
    except (ValueError, NotImplementedError) as e:
        message = " ".join(str(e).split())  # one line, whatever the source
        print(f"pscompile {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:                    # a file or folder the command reads or writes
        print(f"pscompile {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pscompile {args.command}: interrupted", file=sys.stderr)
        return 130
