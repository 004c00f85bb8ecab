"""``python -m pscompile bench``: run ``bench/compare.py`` from the source checkout."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "Other arguments go to bench/compare.py, e.g. --quick --inductor --markdown --out PATH."


def bench_command(args: argparse.Namespace) -> int:
    """Run ``bench/compare.py`` from the source checkout this package was installed from."""
    script = Path(__file__).resolve().parents[2] / "bench" / "compare.py"
    if not script.exists():
        raise ValueError(f"{script} not found: the benchmarks ship with the source checkout "
                         "(pip install -e . from a clone), not with an installed wheel")
    saved = sys.argv
    sys.argv = [str(script), *args.bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = saved
    return 0
