"""Running a bench script's ``main`` inside the test's process instead of a new interpreter.

A new interpreter costs ~7 s on this project's 2-core machines before any work (importing torch,
then warming dynamo at the first compile); the benches' ``--quick`` runs take seconds. Scripts that
measure a fresh process, start processes of their own or change process-wide state keep running
in a new interpreter (``subprocess``) in their tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def load_script(path: Path):
    """The script at ``path`` as a module (its ``if __name__ == "__main__"`` block does not run),
    with its folder first on ``sys.path`` as ``python script.py`` puts it (call it inside
    ``in_process``, which restores ``sys.path``)."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def in_process(main: Callable[[], int | None]) -> subprocess.CompletedProcess:
    """``main()``'s exit code and output, as ``subprocess.run(..., capture_output=True)`` gives
    them; torch's thread count, the root logger and ``sys.path`` (which the scripts change) are as
    they were afterwards. An exception other than ``SystemExit`` propagates."""
    threads, root = torch.get_num_threads(), logging.getLogger()
    handlers, level, path = root.handlers[:], root.level, sys.path[:]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main()
            except SystemExit as e:
                code = e.code
    finally:
        torch.set_num_threads(threads)
        root.handlers[:], sys.path[:] = handlers, path
        root.setLevel(level)
    return subprocess.CompletedProcess([], int(code or 0), out.getvalue(), err.getvalue())
