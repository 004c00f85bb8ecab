"""Flags shared by the commands, and renamed flags kept working.

Every command names a model, a batch and memory the same way (``--n-layer``, ``--d-model``,
``--n-head``, ``--vocab-size``, ``--seq-len``, ``--batch-size``, ``--device-memory``, ``--dtype``,
``--chunk-size``, ``--activations``; docs/cli.md's table says which command takes which, and
tests/test_cli_docs.py holds the parsers to it). A flag that was renamed keeps its old spelling as an
alias that still works and prints, once per use, which name replaces it.

Sizes are read one way by every flag (``pscompile.units.parse_size``): "GB" is 10^9 bytes, "GiB"
2^30 (likewise kB/MB/TB and KiB/MiB/TiB); a bare K, M, G or T is binary, as in ``free -g``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

from pscompile.units import parse_size

NO_LIMIT = ("none", "unlimited")
SIZE_RULE = "GB = 10^9 bytes, GiB = 2^30"


def deprecated_aliases(canonical: str, aliases: tuple[str, ...]) -> type[argparse.Action]:
    """An action storing the value as usual, with a note on stderr when an old spelling was used."""
    class Store(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string in aliases:
                print(f"{parser.prog}: {option_string} is deprecated, use {canonical} (same meaning)", file=sys.stderr)
            setattr(namespace, self.dest, values)
    return Store


def add_flag(p: argparse.ArgumentParser, name: str, *, old: tuple[str, ...] = (), **kw) -> None:
    """``p.add_argument(name, ...)``, with ``old`` spellings accepted as deprecated aliases."""
    if old:
        kw["action"] = deprecated_aliases(name, old)
    p.add_argument(name, *old, **kw)


def size_flag(flag: str, *, none_ok: bool = False) -> Callable[[str], str | None]:
    """An argparse ``type`` for a size flag: the text as given (``None`` for 'none' when
    ``none_ok``), once ``parse_size`` reads it; an error naming ``flag`` and the units otherwise."""
    def check(text: str) -> str | None:
        if none_ok and text.strip().lower() in NO_LIMIT:
            return None
        try:
            parse_size(text, flag)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size; give e.g. 24GB (24 x 10^9 bytes) or 24GiB (24 x 2^30 bytes)"
                + (", or 'none' for no limit" if none_ok else "")) from None
        return text
    return check


def check_output(path: str | None, flag: str, *, folder: bool = False) -> None:
    """Before a command runs: ``path`` (a file, or with ``folder`` a folder made if missing) can be
    written; a ``ValueError`` naming the flag otherwise (the command then exits 2, having run
    nothing)."""
    if path is None:
        return
    p = Path(path)
    if not folder and p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file path")
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: is a file; give a folder (made if missing)")
    where = p if folder else p.parent
    while not where.exists():
        where = where.parent
    try:                                  # the real test: a file made and removed there
        fd, probe = tempfile.mkstemp(dir=where, prefix=".pscompile-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {where} ({e.strerror}); give a path in a folder you can "
                         "write to") from e

