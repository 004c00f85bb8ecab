"""``search``: the largest model of a family, or the largest batch, that ``plan`` says fits.

A family is a ``GPTConfig`` with one dimension free: ``depth`` (layers, width fixed), ``width``
(hidden size in steps of ``WIDTH_STEP``, depth and heads fixed) or ``batch``. Fitting is
monotone in each (more of it never needs less memory), so a bisection between a size that fits and
one that does not finds the largest in a logarithmic number of plans. ``min_tflops`` adds a
throughput bar, as PatrickStar's Figure 10 counts a model only above 30 (YARD) or 50 (SuperPod)
estimated TFLOP/s per GPU; ``baseline=True`` asks the same of the static partition.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pscompile.config import Config
from pscompile.models.gpt import GPTConfig
from pscompile.planner.hardware import Hardware
from pscompile.planner.lora import LoRA
from pscompile.planner.plan import plan
from pscompile.planner.report import PlanReport

__all__ = ["SearchResult", "search", "DIMENSIONS"]

DIMENSIONS = ("depth", "width", "batch")
WIDTH_STEP = 256                     # "width" searches the hidden size in steps of this many


@dataclass(frozen=True)
class SearchResult:
    dimension: str
    value: int                       # the largest that fits (0: not even the smallest)
    report: PlanReport | None        # its plan
    tried: tuple[tuple[int, bool], ...]   # (value, fits) in the order planned


def _build(cfg: GPTConfig, batch: tuple[int, int], dimension: str, v: int) -> tuple[GPTConfig, tuple[int, int]]:
    if dimension == "depth":
        return replace(cfg, n_layer=v), batch
    if dimension == "width":
        if (WIDTH_STEP * v) % cfg.n_head:
            raise ValueError(f"width search: n_head={cfg.n_head} must divide the hidden size {WIDTH_STEP * v}")
        return replace(cfg, d_model=WIDTH_STEP * v), batch
    return cfg, (v, batch[1])


def search(cfg: GPTConfig, batch: tuple[int, int], *, dimension: str, hardware: Hardware | str,
           config: Config | None = None, min_tflops: float = 0.0, baseline: bool = False,
           upper: int = 1 << 12, on_plan: Callable[[int, PlanReport], None] | None = None,
           lora: LoRA | None = None) -> SearchResult:
    """The largest value of ``dimension`` ("depth": ``n_layer``; "width": ``d_model / WIDTH_STEP``;
    "batch": the batch size) for which ``plan`` fits (``baseline``: the
    static partition fits) at ``min_tflops`` or more, searched up to ``upper`` (``lora``: a LoRA run
    of each size, ``planner/lora.py``)."""
    if dimension not in DIMENSIONS:
        raise ValueError(f"dimension={dimension!r}; use one of {DIMENSIONS}")
    tried: list[tuple[int, bool]] = []
    reports: dict[int, PlanReport] = {}

    def ok(v: int) -> bool:
        c, b = _build(cfg, batch, dimension, v)
        r = plan(c, b, hardware=hardware, config=config, lora=lora)
        reports[v] = r
        if on_plan is not None:
            on_plan(v, r)
        fits = (r.baseline_fits if baseline else r.fits) and (r.tflops_per_gpu >= min_tflops or baseline)
        tried.append((v, fits))
        return fits

    lo, hi = 0, 1                    # lo fits (0: nothing yet), hi is the next to try
    while hi <= upper and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(dimension, lo, reports.get(lo), tuple(tried))
