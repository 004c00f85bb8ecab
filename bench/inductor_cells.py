"""One cell of ``bench/budgets.py --inductor-only``: an architecture at one budget, Inductor
against compiled eager (docs/inductor.md).

Two engines of the same tiny model at ``budget``, ``backend="inductor"`` and ``"eager"``, each
first run ``WARMUP`` steps alone (capture, measuring, probing, cuts, compiling: ``first_steps_s``
is their time), then ``STEADY`` steps each, interleaved, whose medians give the steady ratio.
Every step's peak is checked against the budget, in both engines. ``compiled_share``: the share of
Inductor's last step's compute operators that ran inside compiled code. Plain PyTorch (the same
model, no budget, ``torch.optim.AdamW(fused=True)``) takes its steady steps interleaved with them
(``plain_step_s``). ``programs``: Inductor programs compiled in the cell (each log line "compiled as
one program"), of which one runs. ``plain_compile_first_step``: plain ``torch.compile``'s first
training step on the same model with no budget.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

import pscompile
from harness.runs import ProgramCount, cpu_config
from pscompile.testing import tiny_model

WARMUP = 6           # steps each engine runs alone before the interleaved ones (measuring, probing, cuts)
STEADY = 8           # interleaved steps per engine whose medians are compared


@dataclass(frozen=True)
class Cell:
    budget: int
    factor: float
    ok: bool
    error: str | None
    peaks: tuple[int, ...]          # Inductor's measured peak per step (all steps)
    eager_peaks: tuple[int, ...]    # compiled eager's
    losses: tuple[float, ...]
    compiled_share: float           # Inductor's last step: compute operators inside compiled code
    shares: tuple[float, ...]       # the same, per step
    step_s: float                   # Inductor's steady step (median of STEADY, interleaved)
    eager_step_s: float             # compiled eager's
    first_steps_s: float            # Inductor's first WARMUP steps, together
    eager_first_steps_s: float
    cuts: int                       # re-plans for Inductor's buffers ...
    solo: int                       # ... and captures run as compiled eager
    seconds: float
    plain_step_s: float = float("nan")   # plain PyTorch's steady step (median, interleaved)
    programs: int = 0               # Inductor programs compiled in the cell

    @property
    def plain_ratio(self) -> float:
        return self.step_s / self.plain_step_s if self.plain_step_s else float("nan")

    @property
    def ratio(self) -> float:
        return self.step_s / self.eager_step_s if self.eager_step_s else float("nan")

    @property
    def regions(self) -> bool:
        return self.compiled_share > 0


def _engine(arch: str, budget: int, backend: str, link: str | None, dtype: torch.dtype):
    model, batch = tiny_model(arch)
    cfg = cpu_config(backend=backend, device_memory=budget, link_bandwidth=link, dtype=dtype)
    return pscompile.compile(model, batch, config=cfg), batch


def _step(engine, batch, budget: int, peaks: list, losses: list | None = None) -> float:
    t = time.perf_counter()
    loss = engine.step(batch)
    dt = time.perf_counter() - t
    peaks.append(engine.stats.peak_device_bytes)
    if losses is not None:
        losses.append(loss)
    if peaks[-1] > budget:
        raise AssertionError(f"step {len(peaks)}: measured peak {peaks[-1]} > budget {budget}")
    return dt


def _plain(arch: str, dtype: torch.dtype):
    """Plain PyTorch's training step on the same model in ``dtype`` (fused AdamW, no budget):
    ``step() -> seconds``."""
    model, batch = tiny_model(arch)
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> float:
        t = time.perf_counter()
        out = model(**batch) if isinstance(batch, dict) else model(*batch)
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t
    return step


def run_cell(arch: str, budget: int, factor: float, link: str | None = None,
             dtype: torch.dtype = torch.float32) -> Cell:
    """Inductor and compiled eager at ``budget``, compute in ``dtype`` (see the module doc)."""
    t0 = time.perf_counter()
    peaks, eager_peaks, losses, shares = [], [], [], []
    times, eager_times, plain_times, cut_count = [], [], [], (0, 0)
    error = None
    engines = []
    programs = ProgramCount()
    logger = logging.getLogger("pscompile")
    level = logger.level
    logger.addHandler(programs)
    logger.setLevel(logging.INFO)
    try:
        ind, batch = _engine(arch, budget, "inductor", link, dtype)
        engines.append(ind)
        eag, _ = _engine(arch, budget, "eager", link, dtype)
        engines.append(eag)
        plain = _plain(arch, dtype)
        first = sum(_step(ind, batch, budget, peaks, losses) for _ in range(WARMUP))
        shares = [ind.stats.compiled_share]
        eager_first = sum(_step(eag, batch, budget, eager_peaks) for _ in range(WARMUP))
        for _ in range(3):
            plain()
        for _ in range(STEADY):
            times.append(_step(ind, batch, budget, peaks, losses))
            shares.append(ind.stats.compiled_share)
            eager_times.append(_step(eag, batch, budget, eager_peaks))
            plain_times.append(plain())
        lives = ind.captures()
        cut_count = (lives[0].program_rounds if lives else 0, sum(bool(c.eager_reason) for c in lives))
    except Exception as e:                              # noqa: BLE001 -- a failed cell is reported, not fatal
        error = f"{type(e).__name__}: {str(e)[:400]}"
        first = eager_first = float("nan")
    finally:
        for e in engines:
            e.close()
        logger.removeHandler(programs)
        logger.setLevel(level)
    ok = error is None and all(map(math.isfinite, losses))
    if error is None and not ok:
        error = f"non-finite loss: {losses}"
    return Cell(budget, factor, ok, error, tuple(peaks), tuple(eager_peaks), tuple(losses),
                shares[-1] if shares else 0.0, tuple(shares),
                statistics.median(times) if times else float("nan"),
                statistics.median(eager_times) if eager_times else float("nan"),
                first, eager_first, cut_count[0], cut_count[1], time.perf_counter() - t0,
                statistics.median(plain_times) if plain_times else float("nan"), programs.count)


def plain_compile_first_step(arch: str, dtype: torch.dtype = torch.float32) -> float:
    """Plain ``torch.compile``'s first training step (forward, backward, ``torch.optim.AdamW``) on
    the same model in ``dtype`` with no budget: seconds until its first step ran."""
    model, batch = tiny_model(arch)
    model.to(dtype)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = time.perf_counter()
    out = compiled(**batch) if isinstance(batch, dict) else compiled(*batch)
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", out)
    loss.backward()
    opt.step()
    return time.perf_counter() - t
