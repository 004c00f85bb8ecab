"""bench/README.md, the index of the benchmarks, cannot rot, and ``pscompile bench`` runs what it lists.

- every script of bench/ with a command line is in the index and every row names a script;
- every command the index, README.md and docs/ print for a bench script is accepted by that
  script's own argument parser, given through ``pscompile bench NAME`` (parsed, then stopped before
  any work: the benchmarks themselves run in their quick form in tests/test_bench_smoke.py);
- ``pscompile bench --list`` prints the index; an unknown name is refused, naming the index.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from pscompile.cli.bench import index_rows, scripts
from pscompile.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
INDEX = (BENCH / "README.md").read_text()


def _entry_scripts() -> set[str]:
    return {p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}


def test_the_index_lists_every_script_and_only_scripts():
    listed = scripts(BENCH)
    assert len(listed) == len(set(listed)), "a script is listed twice"
    assert set(listed) == _entry_scripts()
    for row in index_rows(INDEX):
        assert len(row) == 6, row
        name, question, command, here, gpu, doc = row
        assert question.endswith("?"), f"{name}: the question column asks a question"
        assert command.startswith(f"`python bench/{name.strip('`')}.py"), (name, command)
        link = re.search(r"\]\((\.\./docs/[\w.-]+\.md)\)", doc)
        assert link and (BENCH / link.group(1)).resolve().exists(), (name, doc)


def _printed_commands() -> list[tuple[str, str, list[str]]]:
    """(where, command, [NAME, flags...]) of every ``python bench/NAME.py ...`` and ``pscompile bench
    NAME ...`` in the index, README.md and docs/."""
    pages = [BENCH / "README.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = set()
    for page in pages:
        for m in re.finditer(r"(?:python bench/(\w+)\.py|pscompile bench (\w+))((?: +[^\s`|#]+)*)", page.read_text()):
            name, words = m.group(1) or m.group(2), shlex.split(m.group(3).replace("$OUT", "/tmp/out"))
            if name != "NAME":           # (the placeholder of ``pscompile bench NAME``)
                out.add((str(page.relative_to(ROOT)), m.group(0).strip(), (name, *words)))
    return sorted(out)


class _Parsed(Exception):
    pass


def _parse_only(monkeypatch):
    """Stop a script right after its parser accepted the arguments (a bad flag exits 2 first).
    ``parse_args`` calls ``parse_known_args``: only the outermost call stops."""
    inside = []
    for method in ("parse_args", "parse_known_args"):
        real = getattr(argparse.ArgumentParser, method)

        def parsed(self, *a, _real=real, **k):
            inside.append(self)
            try:
                result = _real(self, *a, **k)
            finally:
                inside.pop()
            if not inside and not self.prog.startswith("python -m pscompile"):   # the script's, not the CLI's
                raise _Parsed(result)
            return result
        monkeypatch.setattr(argparse.ArgumentParser, method, parsed)


@pytest.mark.parametrize("where,command,words", _printed_commands())
def test_every_printed_bench_command_parses(where, command, words, monkeypatch, capsys):
    name, *flags = words
    assert name in _entry_scripts(), f"{where}: {command!r} names no bench script"
    _parse_only(monkeypatch)
    with pytest.raises(_Parsed):
        status = cli_main(["bench", name, *flags])
        pytest.fail(f"{where}: {command!r} exited {status}: its parser refused the arguments: "
                    f"{capsys.readouterr().err[-500:]}")


def test_list_prints_the_index_and_an_unknown_name_is_refused(capsys):
    assert cli_main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in scripts(BENCH)) and "question it answers" in out
    assert cli_main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "bench 'nosuch' is not in bench/README.md's index" in err and "compare" in err
