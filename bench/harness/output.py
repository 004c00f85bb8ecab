"""The common flags (``--quick``, ``--out``, ``--markdown``) and the output: a table on stdout (in
Markdown with ``--markdown``) and the JSON result file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .runner import CHILD_FLAG  # noqa: F401  (scripts declare the hidden flag through here)

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parser(doc: str | None, name: str, *, quick: str = "tiny sizes (the smoke test)", child: bool = False,
           markdown: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the common flags: ``--quick``, ``--out`` (default
    bench/results/NAME.json), optionally ``--markdown`` and the hidden child flag (``args.child``)."""
    ap = argparse.ArgumentParser(description=(doc or name).strip().split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="JSON results path")
    if markdown:
        ap.add_argument("--markdown", action="store_true", help="print the tables as GitHub Markdown")
    if child:
        ap.add_argument(CHILD_FLAG, dest="child", default=None, help=argparse.SUPPRESS)
    return ap


def table(rows, headers, *, markdown: bool = True) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers, tablefmt="github" if markdown else "simple")


def write_json(out: Path, result: dict) -> None:
    """Write ``result`` to ``out`` (its folder made), atomically: a reader never sees half a file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out)
