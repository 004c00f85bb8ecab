"""Run a spec in a fresh interpreter and read its result back.

The parent calls ``run_fresh(script, spec)``; the script's ``main`` hands the hidden flag to
``child`` first (``if child(args.child, work): return 0``), which runs ``work(spec)`` and prints its
JSON result as the last line of stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

CHILD_FLAG = "--_child"


class ChildFailed(RuntimeError):
    """A fresh process exited non-zero, timed out, or printed no result (``tail``: its last output)."""

    def __init__(self, what: str, tail: str):
        super().__init__(f"{what}\n{tail}")
        self.tail = tail


def run_fresh(script: str | Path, spec: dict, *, timeout: float | None = None, env: dict | None = None,
              cold_inductor: bool = False, threads: int | None = None) -> dict:
    """``python script --_child JSON(spec)`` in a new interpreter; its result (the last stdout line,
    JSON). ``cold_inductor``: an empty Inductor cache of its own; ``threads``: OMP_NUM_THREADS."""
    env = {**os.environ, **(env or {})}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="pscompile-bench-") as cache:
        if cold_inductor:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            p = subprocess.run([sys.executable, str(script), CHILD_FLAG, json.dumps(spec)], env=env,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ChildFailed(f"{Path(script).name} {spec}: timed out after {timeout} s",
                              _text(e.stderr)[-2000:]) from None
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise ChildFailed(f"{Path(script).name} {spec}: exit {p.returncode}", (p.stderr or p.stdout)[-2000:])
    return json.loads(lines[-1])


def child(arg: str | None, work: Callable[[dict], Any]) -> bool:
    """In a child (``arg`` is the hidden flag's value): run ``work(spec)``, print its JSON; True."""
    if not arg:
        return False
    print(json.dumps(work(json.loads(arg))), flush=True)
    return True


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
