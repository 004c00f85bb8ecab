"""The pytest plugin of the lease's tests phase (``gputests``): each test's line, written as it ends.

    PSCOMPILE_LEASE_RESULTS=results.jsonl PSCOMPILE_LEASE_END=<epoch s> PSCOMPILE_LEASE_TEST_S=60 \
        python -m pytest -p cudabench.lease_pytest tests/gpu          (bench/ on PYTHONPATH)

Appends to ``PSCOMPILE_LEASE_RESULTS``, each line on the disk at once: ``collected`` (the tests, in
order), one ``test`` line a test (its worst phase's outcome and first error line) or a file that
failed to collect, and ``not run`` for each test left once the phase's end passed. A test still
running at the phase's end or after ``PSCOMPILE_LEASE_TEST_S`` is stopped by ``faulthandler``
(stacks to ``PSCOMPILE_LEASE_STACKS``, exit 1); the caller writes its line.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

WORST = ("passed", "skipped", "failed", "error")       # a test's outcome: the worst of its phases


def append(path: Path, record: dict) -> None:
    """``record`` as one JSON line at the end of ``path``, on the disk before this returns."""
    with Path(path).open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def first_line(report) -> str | None:
    """The failure's message (``reprcrash``), or a skip's reason, as one line."""
    lr = report.longrepr
    if lr is None:
        return None
    if isinstance(lr, tuple):                          # a skip: (path, line, "Skipped: why")
        return str(lr[2]).removeprefix("Skipped: ")
    crash = getattr(lr, "reprcrash", None)
    text = crash.message if crash is not None else str(lr)
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[0][:400] if lines else None


def phase_outcome(report) -> str:
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "skipped" if report.skipped else "passed"


@dataclass(frozen=True, eq=False)             # eq=False: hashed by identity, as pytest's plugins are
class LeaseLog:
    """Writes the lines; holds the outcome so far of the test that is running."""

    path: Path
    end: float                                         # epoch seconds: the tests phase's end
    test_s: float                                      # one test's limit
    stacks: object                                     # an open file for faulthandler's dump
    outcome: dict = field(default_factory=dict)        # node id -> [worst outcome, first error, seconds]
    done: set = field(default_factory=set)

    def pytest_collection_finish(self, session) -> None:
        append(self.path, dict(kind="collected", tests=[i.nodeid for i in session.items]))

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            append(self.path, dict(kind="test", test=report.nodeid, outcome="error", error=first_line(report),
                                   duration_s=0.0))

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        faulthandler.dump_traceback_later(max(1.0, min(self.test_s, self.end - time.time())), exit=True,
                                          file=self.stacks)

    def pytest_runtest_logreport(self, report) -> None:
        worst, error, seconds = self.outcome.get(report.nodeid, ("passed", None, 0.0))
        now = phase_outcome(report)
        if WORST.index(now) > WORST.index(worst):
            worst, error = now, first_line(report)
        self.outcome[report.nodeid] = (worst, error, seconds + report.duration)
        if report.when == "teardown":
            worst, error, seconds = self.outcome.pop(report.nodeid)
            append(self.path, dict(kind="test", test=report.nodeid, outcome=worst, error=error,
                                   duration_s=round(seconds, 2)))
            self.done.add(report.nodeid)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        faulthandler.cancel_dump_traceback_later()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if time.time() < self.end:
            return None
        for it in item.session.items:
            if it.nodeid not in self.done:
                append(self.path, dict(kind="test", test=it.nodeid, outcome="not run", duration_s=0.0,
                                       error="the tests phase's time limit was reached before it started"))
                self.done.add(it.nodeid)
        item.session.shouldstop = "the lease's tests phase reached its time limit"
        return True                                    # this item is handled: not run


def pytest_configure(config) -> None:
    path = os.environ.get("PSCOMPILE_LEASE_RESULTS")
    if not path:
        return
    stacks = open(os.environ.get("PSCOMPILE_LEASE_STACKS", os.devnull), "a")   # noqa: SIM115 -- held until exit
    config.pluginmanager.register(LeaseLog(
        Path(path), float(os.environ.get("PSCOMPILE_LEASE_END", time.time() + 3600)),
        float(os.environ.get("PSCOMPILE_LEASE_TEST_S", 3600)), stacks), "lease-log")
