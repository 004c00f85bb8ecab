"""The schedule in the standard tools: named ranges for ``torch.profiler`` (and NVTX on CUDA).

While a ``torch.profiler`` records, every memory node and compiled region of compiled mode runs
inside a ``record_function`` range named as in the schedule listing (``fetch chunk 12 (fetch_3)``,
``wait chunk 12 (wait_3)``, ``region 7 (h.0.attn .. h.0.mlp)``, ``offload h_3 (offload_1)``), every
copy a copy thread makes inside one named for its direction and the node that issued it
(``copy h2d fetch_3``) on that thread's lane,
and each AdamW update of a chunk inside ``update chunk 3``. A trace opened in Perfetto
(ui.perfetto.dev) or TensorBoard then shows the schedule: the compute thread's lane holds the
regions and the memory nodes, a ``wait`` range as long as the step waited for that copy, and the
copy threads' lanes hold the copies, so one sees which copy overlapped which region. On CUDA the
same names are NVTX ranges (Nsight Systems). This module holds the recording primitives only; the
names of graph nodes and regions come from the listing that owns them (``compiled/listing.py``).

No range is made while no profiler records (one check of a flag per step or copy), since a
``record_function`` costs about 17 us even then. ``profile`` is the one-call form: it records
``steps`` steps with every thread's lane (``profile_all_threads``) and writes a Chrome trace.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.autograd.profiler as autograd_profiler

NOTHING = contextlib.nullcontext()      # (reusable: a nullcontext keeps no state)


def recording() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) records now, on any thread."""
    return bool(autograd_profiler._is_profiler_enabled)


def named(name: str, cuda: bool = False) -> ContextManager:
    """A range called ``name`` in the profiler's trace (and, with ``cuda``, an NVTX range)."""
    if not cuda:
        return torch.profiler.record_function(name)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.profiler.record_function(name))
    stack.enter_context(torch.cuda.nvtx.range(name))
    return stack


def maybe(name: str, cuda: bool = False) -> ContextManager:
    """``named(name)`` while a profiler records; otherwise a context that does nothing."""
    return named(name, cuda) if recording() else NOTHING


class Profiled:
    """Mixin of ``ChunkEngine`` (and ``LazyEngine``): ``engine.profile``."""

    def profile(self, path: str | os.PathLike, batch: Any, *, steps: int = 2) -> list[float]:
        """``steps`` training steps on ``batch`` recorded by ``torch.profiler``, the Chrome trace
        written to ``path`` (open it in Perfetto or TensorBoard); returns their losses."""
        return profile(self, path, batch, steps=steps)


def profile(engine: Any, path: str | os.PathLike, batch: Any, *, steps: int = 2) -> list[float]:
    """Run ``steps`` training steps of ``engine`` on ``batch`` under ``torch.profiler`` (CPU, and
    CUDA on a GPU; every thread's lane, so the copy threads show) and write the Chrome trace to
    ``path``; returns the steps' losses (they train the model like any step)."""
    if steps < 1:
        raise ValueError(f"profile: steps={steps}; give at least one step")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.config.torch_device.type == "cuda":      # (a lazy engine is not built yet: its config)
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    losses = []
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"pscompile step {i}"):
                losses.append(engine.step(batch))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return losses
