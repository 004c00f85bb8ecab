"""A CPU ``Config``, a run of steps and the median of a steady stat, shared by the scripts that
train pscompile engines on the CPU (activations, disk, lock_free, plan_check, soak, compare, ...)."""

from __future__ import annotations

import logging
import statistics

import torch

import pscompile


def cpu_config(mode: str = "compiled", **kw) -> pscompile.Config:
    """A ``Config`` on the CPU: the eager backend and float32 unless ``kw`` says otherwise."""
    return pscompile.Config(**{"mode": mode, "backend": "eager", "device": "cpu", "dtype": torch.float32, **kw})


def train(engine, batches, *, close: bool = True) -> tuple[list[float], list]:
    """``engine.step`` on each batch (then ``engine.close()`` unless ``close`` is False): the losses
    and each step's ``StepStats``."""
    losses, stats = [], []
    try:
        for b in batches:
            losses.append(engine.step(b))
            stats.append(engine.stats)
    finally:
        if close:
            engine.close()
    return losses, stats


def median_after(stats: list, stat, skip: int = 1) -> float:
    """The median of ``stat`` (a ``StepStats`` field's name, or a function of one) over the steps after
    the first ``skip``."""
    get = stat if callable(stat) else lambda s: getattr(s, stat)
    return statistics.median(get(s) for s in stats[skip:])


class ProgramCount(logging.Handler):
    """Counts the Inductor programs compiled (pscompile's INFO record for each); attach it to the
    "pscompile" logger at INFO."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += "compiled as one program" in record.getMessage()
