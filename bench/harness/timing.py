"""Timing: repetitions after a warm-up, interleaved rounds (every system one step a round, so the
machine's noise falls on all alike), and ratios with their spread."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def time_reps(fn: Callable[[], object], reps: int, *, warmup: int = 0) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleave(steps: dict[str, Callable[[int], object]], rounds: int, *, warmup: int = 0) -> dict[str, list[float]]:
    """``warmup`` then ``rounds`` rounds in which every system takes one step (``step(round)``)
    in turn; each system's step seconds."""
    for r in range(warmup):
        for f in steps.values():
            f(r)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for name, f in steps.items():
            t = time.perf_counter()
            f(r)
            times[name].append(time.perf_counter() - t)
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """Median of ``a`` over median of ``b``, and the smallest and largest ratio of one round."""
    per = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(times[a]) / statistics.median(times[b]), min(per), max(per)


def spread(r: tuple[float, float, float]) -> str:
    """``1.23 (1.10-1.40)``."""
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def steady_at(times: list[float], factor: float = 1.5) -> int:
    """Index of the first step from which every step takes at most ``factor`` x the last four's median."""
    ref = factor * statistics.median(times[-4:])
    k = len(times) - 1
    while k > 0 and times[k - 1] <= ref:
        k -= 1
    return k
