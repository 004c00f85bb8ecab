"""Ctrl-C during the optimizer update: finish the update, then interrupt.

Until the update starts, a failed step is undone (the parameter chunks are restored from the fp32
masters). The update itself overwrites masters and Adam states chunk by chunk and cannot be undone
without a second copy of them, so it is the step's commit: ``deferred_interrupts`` holds SIGINT
back while it runs and delivers it, to the handler that was installed, as soon as it ends.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT back inside the block (main thread only; elsewhere signals never arrive)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield                                       # (None: a handler Python did not install)
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)      # to the handler that was there: KeyboardInterrupt
