"""The lease's tests phase: tests/gpu in a pytest subprocess (``-o addopts=``: one process, whether
or not pytest-xdist is installed) with ``lease_pytest`` writing each test's line as it ends. A test
that hangs or kills pytest gets its line here, and pytest starts again on the tests after it."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESTART_MIN_S = 20.0          # a new pytest process on the tests left needs this much of the phase:
                              # python, torch, CUDA's context and the first test's model (~10 s)


def pytest_once(lease, targets: list[str], end: float, test_s: float, cwd: Path) -> tuple[int, list[str]]:
    """One pytest process on ``targets``, its output echoed; its exit status and last lines."""
    env = dict(os.environ, PSCOMPILE_LEASE_RESULTS=str(lease.out), PSCOMPILE_LEASE_STACKS=str(lease.stacks),
               PSCOMPILE_LEASE_END=str(end), PSCOMPILE_LEASE_TEST_S=str(test_s),
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if lease.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=",
           "-p", "cudabench.lease_pytest", *targets]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque = collections.deque(maxlen=200)
    pump = threading.Thread(target=echo, args=(proc.stdout, tail), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=max(1.0, end - time.time()) + 15)      # faulthandler stops it first
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    pump.join(timeout=5)
    return rc, list(tail)


def echo(stream, tail) -> None:
    for line in stream:
        print(line.rstrip("\n"), flush=True)
        tail.append(line.rstrip())


def first_frame(stacks: str) -> str:
    """The innermost frame of this repository in the test's thread (the one running pytest) of a
    faulthandler dump (threads one after another, each most recent call first)."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)
    main = [s for s in threads if "_pytest" in s] or threads
    mine = [x.strip() for x in main[-1].splitlines() if str(ROOT) in x and "site-packages" not in x]
    return mine[0].replace(str(ROOT) + os.sep, "") if mine else "no frame of this repository"


def missing_reason(lease, rc: int, tail: list[str], stacks: str, end: float, test_s: float) -> str:
    if stacks.strip():
        limit = "the tests phase's end" if time.time() >= end - 2 else f"its limit of {test_s:.0f} s"
        return f"stopped: ran past {limit} (stacks in {lease.stacks.name}); innermost: {first_frame(stacks)}"
    fatal = [x[x.index("Fatal"):] for x in tail if "Fatal Python error" in x] or tail[-1:] or ["no output"]
    return f"the pytest process ended (exit status {rc}) while it ran: {fatal[0]}"


def tests_phase(lease, limit_s: float, test_s: float, targets=("tests/gpu",), cwd: Path = ROOT) -> list[dict]:
    """Runs ``targets`` until each test has a line (``lease``: a ``lease.Lease``); a test that hangs or
    kills pytest gets one here, and pytest starts again on the tests after it while the phase has
    RESTART_MIN_S left."""
    end = time.time() + limit_s
    pending, out = list(targets), []
    lease.stacks.touch()
    while pending:
        since, stacks_at = lease.out.stat().st_size, lease.stacks.stat().st_size
        rc, tail = pytest_once(lease, pending, end, test_s, cwd)
        new = lease.lines(since)
        out += [r for r in new if r["kind"] == "test"]
        collected = [t for r in new if r["kind"] == "collected" for t in r["tests"]]
        if not collected and not any(r["kind"] == "test" for r in new):
            return out + [account(lease, " ".join(pending), "error",
                                  f"pytest collected nothing (exit status {rc}): {tail[-1] if tail else ''}")]
        done = {r["test"] for r in out}
        missing = [t for t in collected if t not in done]
        if not missing:
            break
        stacks = lease.stacks.read_bytes()[stacks_at:].decode(errors="replace")
        out.append(account(lease, missing[0], "failed", missing_reason(lease, rc, tail, stacks, end, test_s)))
        pending = missing[1:]
        if pending and end - time.time() < RESTART_MIN_S:
            why = (f"the tests phase had {end - time.time():.0f} s left, under the {RESTART_MIN_S:.0f} s a new "
                   "pytest process needs")
            return out + [account(lease, t, "not run", why) for t in pending]
    return out


def account(lease, test: str, outcome: str, error: str) -> dict:
    """A test's line that pytest could not write (it was stopped, or died, or never started)."""
    line = dict(kind="test", test=test, outcome=outcome, error=error, duration_s=None)
    lease.write(line)
    print(f"[test] {outcome}: {test}: {error}", flush=True)
    return line
