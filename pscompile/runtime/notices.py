"""What a user sees without configuring logging: fall-backs and long first steps.

pscompile logs to the ``pscompile`` logger. Details (plans, re-plans, compile times) are INFO,
which a user sees after ``logging.basicConfig(level=logging.INFO)``. Two things must reach a user
who configured nothing, on the first run:

- a **fall-back** from compiled code (a capture that runs as compiled eager, and why), at WARNING;
- a **notice** when one of the first steps of a batch shape, which capture, plan, measure and
  compile it, has run for more than ``SLOW_S`` seconds, and how long it took once it ends
  (``slow_notice``); nothing when those steps are quick.

``install_default_handler`` (called when pscompile is imported) gives the ``pscompile`` logger a
handler of its own that prints both to stderr, one line each, but only while the process has
configured no logging (the root logger has no handler): once it has, its own handlers print them,
at the levels it chose. ``logging.getLogger("pscompile.notice").setLevel(logging.WARNING)``
silences the notices.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
from torch.utils._pytree import tree_leaves

from pscompile.runtime.batching import signature

NOTICE = "pscompile.notice"            # the notices' logger (INFO, shown by default)
SLOW_S = 5.0                           # a setup step longer than this is said
SETUP_STEPS = 3                        # the first steps of a shape that capture, plan, measure and compile
_HANDLER_NAME = "pscompile-default"


def _unconfigured(record: logging.LogRecord) -> bool:
    """Print ``record``: a warning or a notice, while the process configured no logging of its own."""
    if logging.getLogger().handlers:
        return False
    return record.levelno >= logging.WARNING or record.name == NOTICE


def install_default_handler() -> logging.Handler:
    """The ``pscompile`` logger's own stderr handler (the module doc); added once."""
    logger = logging.getLogger("pscompile")
    for h in logger.handlers:
        if h.get_name() == _HANDLER_NAME:
            return h
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_unconfigured)
    logger.addHandler(handler)
    notices = logging.getLogger(NOTICE)
    if notices.level == logging.NOTSET:
        notices.setLevel(logging.INFO)
    return handler


@contextmanager
def slow_notice(what: str, after: float | None = None) -> Iterator[None]:
    """Says ``what`` is under way once it has run ``after`` seconds (default ``SLOW_S``), and its
    time when it ends; nothing when it ends sooner (a timer thread says the first line)."""
    after = SLOW_S if after is None else after
    log = logging.getLogger(NOTICE)
    said = threading.Event()

    def say() -> None:
        said.set()
        log.info("pscompile: %s: %.0f s so far (the first steps of a batch shape capture, plan, measure and "
                 "compile it; later steps reuse that)", what, after)
    timer = threading.Timer(after, say)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()                   # (a notice being said is said whole, before its time)
        if said.is_set():
            log.info("pscompile: %s took %.1f s", what, time.perf_counter() - start)


class SetupNotices:
    """One engine's ``slow_notice``s: over each of the first ``SETUP_STEPS`` calls of a kind
    (``step``, ``evaluate``) for a batch's shapes, the ones that capture, plan, measure and
    compile; nothing after those."""

    def __init__(self):
        self._calls: dict[tuple, int] = {}      # (call, batch signature) -> calls so far

    def around(self, batch: Any, call: str) -> ContextManager[None]:
        sig = (call, signature(batch))
        n = self._calls[sig] = self._calls.get(sig, 0) + 1
        if n > SETUP_STEPS:
            return nullcontext()
        shapes = [tuple(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        return slow_notice(f"{call} {n} of batch shapes {shapes}")
