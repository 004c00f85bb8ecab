"""The README and the docs cannot rot: their Python blocks run, their commands run, their example
error is the real one.

- every ```python block of the README, then of the docs pages in ``DOCS`` order, runs in one
  namespace (as a reader would paste them: the docs use the README's ``model``, ``batch``, ``config``);
- every ```bash command in docs/ is one of the README's, which run here;
- the first ```bash block is the two commands CI runs (``.ci/run`` reads them from the README);
- ``python -m pscompile inspect ...`` as written in the README runs, and its ``plan`` command (shrunk);
- the example error message is the one ``compile`` raises for the quick-start model at 2 MiB.
The benchmark commands run in their quick form in tests/test_bench_smoke.py, the train command in
CI (the README's first command) and, short, in tests/test_cli.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pscompile
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# the docs pages whose Python blocks run after the README's, in this order (later pages use what
# earlier ones defined); design.md's API listing is ```text
DOCS = ["training.md", "compiled-mode.md", "hugging-face.md", "planner.md", "disk-tier.md", "lock-free.md",
        "profiling.md", "dynamic-shapes.md"]


def _fenced(text: str = README) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of ``text``, in order."""
    out, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                out.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def _blocks(lang: str, text: str = README) -> list[str]:
    return [body for la, body in _fenced(text) if la == lang]


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def test_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    pages = [("README.md", README)] + [(f"docs/{n}", _doc(n)) for n in DOCS]
    for name, text in pages:
        blocks = _blocks("python", text)
        assert blocks, f"{name} has no python block: drop it from DOCS"
        for i, code in enumerate(blocks):
            exec(compile(code, f"{name} python block {i}", "exec"), namespace)   # noqa: S102
    assert (tmp_path / "out" / "schedule.txt").exists()
    runnable = {p.name for p in (ROOT / "docs").glob("*.md") if _blocks("python", p.read_text())}
    assert runnable == set(DOCS), f"docs pages with python blocks not run here: {runnable - set(DOCS)}"


def test_docs_commands_are_the_readme_ones():
    """A command in a docs page is one of the README's (run by this file, or by CI itself)."""
    readme = {line.split("#")[0].strip() for b in _blocks("bash") for line in b.splitlines()}
    for page in (ROOT / "docs").glob("*.md"):
        for block in _blocks("bash", page.read_text()):
            for line in block.splitlines():
                assert line.split("#")[0].strip() in readme, f"{page.name}: {line!r} is run by no test"


def test_first_commands_are_what_ci_runs():
    first = _blocks("bash")[0]
    commands = [re.sub(r"\s*#.*$", "", line) for line in first.strip().splitlines()]
    assert commands == ['pip install torch==2.13.0 && pip install -e ".[test]" && python -m pscompile train',
                        "python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "pip install" not in ci       # CI runs the README's block, nothing else


def test_inspect_command_runs(tmp_path):
    (command,) = re.findall(r"`(python -m pscompile inspect [^`]*)`", README)
    argv = shlex.split(command)
    r = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "schedule.txt").exists()


def test_plan_command_runs_with_its_flags(capsys):
    """The README's ``plan`` command as written, its model shrunk to two layers of 256 by flags
    appended after it (the full 12B plan takes over a minute: its numbers are in the README)."""
    from pscompile.cli.main import main
    (command,) = [line for b in _blocks("bash") for line in b.splitlines() if line.startswith("python -m pscompile plan")]
    argv = shlex.split(command)[3:] + ["--n-layer", "2", "--d-model", "256", "--n-head", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "static partition" in out


def test_example_error_is_the_real_one():
    (example,) = [b for b in _blocks("", _doc("reliability.md")) if b.startswith("pscompile.errors.BudgetError")]
    from pscompile.models.gpt import GPT, gpt_config
    idx = torch.randint(0, 256, (2, 128))
    config = pscompile.Config(mode="hooks", device="cpu", device_memory="2MiB", dtype=torch.float32)
    with pytest.raises(pscompile.BudgetError) as err:
        pscompile.compile(GPT(gpt_config("gpt-mini")), (idx, torch.roll(idx, -1, dims=1)), config=config)
    shown = " ".join(example.split()).removeprefix("pscompile.errors.BudgetError: ")
    assert shown == " ".join(str(err.value).split())


def test_torchrun_command_runs(tmp_path):
    """The README's ZeRO launch, as written (torchrun, or ``python -m torch.distributed.run`` where
    the console script is not on PATH): two ranks train and rank 0 alone prints the summary."""
    import shutil
    (command,) = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()
                  if line.startswith("torchrun ")]
    argv = shlex.split(command)
    launcher = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    # as written; the port through torchrun's environment (PET_MASTER_PORT), since other test
    # files run beside this one and the default port may be taken
    r = subprocess.run(launcher + argv[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PET_MASTER_PORT": str(free_port())})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("| ZeRO ranks") == 1 and "2 (gloo)" in r.stdout
    assert "OK" in r.stdout.split("| peak device")[1].splitlines()[0]
