"""``python -m pscompile bench [NAME] [flags]``: run ``bench/NAME.py`` from the source checkout.

``NAME`` is any script of bench/README.md's index (``--list`` prints it); without one, the flags go
to ``bench/compare.py`` (plain PyTorch, torch.compile, hooks and compiled mode on GPT), as before
the index existed.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

DEFAULT = "compare"
# what the marks of the index's time columns mean (bench/README.md says the same above its table)
LEGEND = (("*", "one timed run of the full command, with nothing else running (bench/README.md gives the date)"),
          ("~", "about: the time the docs or the script record"),
          ("≥", "at least: the sum of the times recorded for parts of the run, its other parts not counted"),
          ("<", "under"),
          ("≤", "at most"),
          ("—", "not run there"))


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "python -m pscompile bench [--list | NAME] [flags of bench/NAME.py]"
    p.epilog = ("--list prints the index of the benchmarks (bench/README.md): the question each answers and its "
                "command. NAME runs bench/NAME.py with the flags that follow (each script's --help lists them); "
                f"without a NAME the flags go to bench/{DEFAULT}.py, e.g. --quick --inductor --markdown --out PATH.")


def bench_folder() -> Path:
    """bench/ of the source checkout this package was installed from (editable installs only)."""
    folder = Path(__file__).resolve().parents[2] / "bench"
    if not (folder / "README.md").exists():
        raise ValueError(f"{folder} not found: the benchmarks ship with the source checkout "
                         "(pip install -e . from a clone), not with an installed wheel")
    return folder


def index_rows(readme: str) -> list[list[str]]:
    """The cells of every row of bench/README.md's index table (its header and rule left out)."""
    rows = []
    for line in readme.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]


def scripts(folder: Path) -> list[str]:
    """The names the index lists, in its order."""
    return [row[0].strip("`") for row in index_rows((folder / "README.md").read_text())]


def print_index(folder: Path) -> None:
    """``bench --list``: the index's name, question and time columns, and what the time marks mean."""
    from tabulate import tabulate
    rows = index_rows((folder / "README.md").read_text())
    print(tabulate([[r[0].strip("`"), r[1], r[3], r[4]] for r in rows],
                   ["name", "question it answers", "minutes here", "minutes on a GPU"], tablefmt="simple"))
    print("\nminutes: the full command's wall time, here on this project's 2-core CPU machine; "
          + "; ".join(f"{mark} {meaning}" for mark, meaning in LEGEND))
    print(f"pscompile bench NAME [flags]; the commands and the docs holding each table: {folder / 'README.md'}")


def bench_command(args: argparse.Namespace) -> int:
    folder = bench_folder()
    rest = list(args.bench_args)
    if rest[:1] == ["--list"]:
        print_index(folder)
        return 0
    name = DEFAULT
    if rest and not rest[0].startswith("-"):
        name, rest = rest[0].removesuffix(".py"), rest[1:]
        known = scripts(folder)
        if name not in known:
            raise ValueError(f"bench {name!r} is not in bench/README.md's index; use one of {known} "
                             "(pscompile bench --list)")
    return run_script(folder / f"{name}.py", rest)


def run_script(script: Path, argv: list[str]) -> int:
    """``python bench/NAME.py argv`` in this process: bench/ first on ``sys.path`` (its scripts import
    bench/harness), then both restored; the script's exit status."""
    saved = sys.argv, sys.path[:]
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):           # sys.exit("message"): printed, as the interpreter would
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved
    return 0
