"""Compiled regions checked and measured on the inputs they really receive.

The tracker cannot see inside compiled code, so what a compiled region allocates inside (its
temporaries, and its outputs beyond their eager sizes) is measured with the profiler
(``memory.region_peaks``). It is measured on real values, never on made-up ones: a region's inputs
may carry indices an earlier region computed (a router's expert ids, token positions, gather
indices), and on made-up values such a region reads or writes out of bounds (on the CPU Inductor's
bounds check aborts the process; on a GPU the same call corrupts memory or ends the CUDA context).

How. The first run of every executor that has compiled regions is a *probing run*
(``Probe.call`` stands in for each region call):

- every compiled region runs as eager graph code, which the tracker sees operator by operator like
  any eager region, so the run keeps to the plan whatever the compiled code would allocate;
- each compiled region's real inputs are checked against the layouts it was compiled for
  (``regions.layout_mismatch``: shape, stride, dtype, device, alignment, on which Inductor's code
  specialises); a region given another layout is never run compiled (it would compute wrong
  numbers) and falls back to eager code;
- the first region of each structural key not measured yet has its inputs copied to the host,
  storage span and layout kept.

After the run, between steps when no activation is live, ``measure`` calls each such region once,
compiled, on device copies of those inputs, under the profiler. Regions of one key run the same
code on inputs of the same layouts, so they allocate the same bytes: one measurement serves every
layer. A region that raises there falls back to eager code too. Each fall-back is logged once as a
``pscompile`` warning naming the region, its source line and the reason.

``region_curve`` turns the measurements into the non-model curve the plan must hold.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import fx

from pscompile.compiled.regions import (Region, TensorMeta, first_line, is_view_op, layout_mismatch,
                                        region_source)
from pscompile.graph.meta import get
from pscompile.graph.analysis import executed_nodes
from pscompile.memory.region_peaks import allocation_peaks
from pscompile.passes.plan_residency import arrivals

__all__ = ["Allocation", "Probe", "Snapshot", "measure", "region_curve", "warn_fallback"]

log = logging.getLogger("pscompile.compiled")


@dataclass(frozen=True)
class Allocation:
    """What one compiled region (one structural key) allocates when it runs."""

    peak: int      # bytes allocated inside at most, beyond what was live at its start (outputs included)
    excess: int    # bytes its outputs hold beyond the same values computed eagerly


@dataclass(frozen=True)
class Snapshot:
    """A host copy of one tensor input: the storage from its first element to its last, and the
    view of it the region received (so a device copy has the same layout and alignment)."""

    span: torch.Tensor                 # on the host
    meta: TensorMeta
    offset: int                        # storage offset the device copy takes (same alignment class)

    @staticmethod
    def of(t: torch.Tensor) -> "Snapshot":
        meta = TensorMeta.of(t, t.device)
        flat = t.as_strided((meta.span,), (1,), t.storage_offset())
        per_16 = max(1, 16 // t.element_size())
        return Snapshot(flat.detach().to("cpu", copy=True), meta, t.storage_offset() % per_16)

    def restore(self) -> torch.Tensor:
        """A device tensor with the snapshot's values, layout and alignment class."""
        base = torch.empty(self.offset + max(self.meta.span, 1), dtype=self.meta.dtype, device=self.meta.device)
        base[self.offset:self.offset + self.meta.span].copy_(self.span)
        return base.as_strided(self.meta.shape, self.meta.stride, self.offset)


def warn_fallback(r: Region, stage: str, reason: str) -> None:
    log.warning("pscompile: compiled region %d (%s) runs as eager code from now on: %s failed: %s",
                r.index, region_source(r), stage, reason)


@dataclass
class Probe:
    """The first run(s) of one executor (see the module doc), until ``_settle_probe``: ``call``
    runs each region. ``known(key)``: the key's allocation is measured already. ``eager_all``: a
    probing run (compiled regions run as eager code; unmeasured keys keep their inputs); else
    only the layouts are checked and the compiled code runs. ``quiet``: a context in which copies
    to the host are not counted as device memory (set per run: the run's tracker, paused)."""

    known: Callable[[str], bool]
    eager_all: bool
    quiet: Callable[[], ContextManager] = contextlib.nullcontext
    saved: dict[str, tuple[Region, list]] = field(default_factory=dict)   # key -> (region, its inputs)
    mismatched: dict[str, tuple[Region, str]] = field(default_factory=dict)  # key -> (region, why)
    learned: dict[int, int] = field(default_factory=dict)   # region index -> bytes its eager run allocated
    checked: int = 0                   # compiled region calls whose inputs were checked

    def call(self, r: Region, compiled: bool, args: list) -> Sequence[Any]:
        if not compiled:
            return r.fn(args)
        self.checked += 1
        problem = layout_mismatch(r, args)
        if problem is not None:
            self.mismatched.setdefault(r.key, (r, problem))
            return r.eager()(args)     # compiled code given another layout computes wrong numbers
        if not self.eager_all:
            return r.fn(args)
        if not self.known(r.key) and r.key not in self.saved:
            with self.quiet():
                self.saved[r.key] = (r, [Snapshot.of(a) if isinstance(a, torch.Tensor) else a for a in args])
        return r.eager()(args)


def measure(saved: dict[str, tuple[Region, list]], device: torch.device
            ) -> tuple[dict[str, Allocation], dict[str, tuple[Region, str]]]:
    """Call each saved region once, compiled, on device copies of its real inputs under the
    profiler: ``(key -> Allocation, key -> (region, why) for those that raised)``. Inputs are
    copied before the region's range opens and kept alive through it (freeing one inside cannot
    hide bytes: an upper bound). Random ops draw from the generators, which are put back."""
    allocs: dict[str, Allocation] = {}
    failed: dict[str, tuple[Region, str]] = {}
    if not saved:
        return allocs, failed
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    label = "pscompile::measure/"
    excess: dict[int, int] = {}
    keys = list(saved)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            for i, key in enumerate(keys):
                r, snaps = saved[key]
                inputs = [s.restore() if isinstance(s, Snapshot) else s for s in snaps]
                try:
                    with torch.profiler.record_function(f"{label}{i}"):
                        outs = r.fn(list(inputs))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except Exception as e:  # noqa: BLE001 -- any failure: the region runs as eager code instead
                    failed[key] = (r, f"{type(e).__name__}: {first_line(e)}")
                    continue
                excess[i] = max(0, _storage_bytes(outs) - _eager_bytes(r.outputs))
                del outs, inputs
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    peaks = allocation_peaks(prof, label, device)
    for i, key in enumerate(keys):
        if key not in failed:
            allocs[key] = Allocation(peaks.get(i, 0), excess[i])
    return allocs, failed


def region_curve(regions: Sequence[Region], extra: dict[int, int], excess: dict[int, int], nonmodel: tuple[int, ...],
                 captured, measured: tuple[int, ...]) -> tuple[int, ...] | None:
    """The schedule's curve ``nonmodel`` with every node of a compiled region raised to the
    region's peak, or None if no node rises. A region starts with at most the bytes of the last
    node that executes before it live (that node's peak in ``measured``, the node-by-node
    measurement) plus what the outputs of the regions before it hold beyond their eager sizes
    (``excess``), and allocates at most ``extra`` inside; the chunks it reads all arrive before it
    starts, so they sit next to that whole peak. The executor gathers every tensor spanning chunks
    that a region reads before the region starts (``regions.lifted_views``), so all of them are
    live at once there, where the node-by-node curve counted each at its own reader: they are
    added to the region's peak, and to each node of an eager region next to its own measurement."""
    arrive = arrivals(measured, executed_nodes(captured))
    curve, changed, wider = list(nonmodel), False, 0
    for r in sorted(regions, key=lambda r: r.index):
        gathered = sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in r.inputs
                       if get(a, "param") is not None and isinstance(a.args[0], fx.Node)
                       and get(a.args[0], "gather") is not None)
        if r.index not in extra and not gathered:
            continue
        # parameter views carry the index of their captured (forward) place, not of this region
        srcs = [get(n, "src_index") for n in r.nodes if get(n, "src_index") is not None and get(n, "param") is None]
        if not srcs:
            continue
        if r.index in extra:
            rises = {src: arrive[min(srcs)] + wider + extra[r.index] + gathered for src in srcs}
            wider += excess.get(r.index, 0)
        else:
            rises = {src: measured[src] + gathered for src in srcs if src < len(measured)}
        for src, peak in rises.items():
            if src < len(curve) and peak > curve[src]:
                curve[src], changed = peak, True
    return tuple(curve) if changed else None


def _storage_bytes(values: Sequence[Any]) -> int:
    seen, total = set(), 0
    for v in values:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _eager_bytes(nodes: Sequence[fx.Node]) -> int:
    """Bytes the values of ``nodes`` hold when computed eagerly (views of one another counted once,
    as far as the graph shows: a view's base is among the nodes)."""
    total = 0
    for n in nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if is_view_op(n) and base in nodes:
            continue
        total += v.numel() * v.element_size()
    return total
