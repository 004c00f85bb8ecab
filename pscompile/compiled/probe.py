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

``region_peaks`` turns the measurements into each region's peak, and ``over_plan`` says which regions
the plan does not hold (compiled/lowering.py cuts them).
"""

from __future__ import annotations

import contextlib
import logging
import operator
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

__all__ = ["Allocation", "Measured", "Probe", "Snapshot", "measure", "RegionPeak", "over_plan",
           "region_peaks", "warn_fallback", "room_of", "made_bytes"]

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

    @property
    def numel(self) -> int:
        """Elements of the device storage ``restore`` allocates."""
        return self.offset + max(self.meta.span, 1)

    @property
    def nbytes(self) -> int:
        return self.numel * self.span.element_size()

    def restore(self) -> torch.Tensor:
        """A device tensor with the snapshot's values, layout and alignment class."""
        base = torch.empty(self.numel, dtype=self.meta.dtype, device=self.meta.device)
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
    starts: dict[int, int] = field(default_factory=dict)    # region index -> non-model bytes live at its start
    checked: int = 0                   # compiled region calls whose inputs were checked
    eager_ops: int = 0                 # compute operators of compiled regions it ran as eager code

    def call(self, r: Region, compiled: bool, args: list) -> Sequence[Any]:
        if not compiled:
            return r.fn(args)
        self.checked += 1
        problem = layout_mismatch(r, args)
        if problem is not None:
            self.mismatched.setdefault(r.key, (r, problem))
            self.eager_ops += r.ops
            return r.eager()(args)     # compiled code given another layout computes wrong numbers
        if not self.eager_all:
            return r.fn(args)
        if not self.known(r.key) and r.key not in self.saved:
            with self.quiet():
                self.saved[r.key] = (r, [Snapshot.of(a) if isinstance(a, torch.Tensor) else a for a in args])
        self.eager_ops += r.ops
        return r.eager()(args)


@dataclass(frozen=True)
class Measured:
    """What ``measure`` found: per key its allocation, the keys that failed (with why), and the
    most device bytes a measurement held at once (its input copies plus what the region allocated:
    the measuring step's peak counts it)."""

    allocs: dict[str, Allocation]
    failed: dict[str, tuple[Region, str]]
    footprint: int = 0


def measure(saved: dict[str, tuple[Region, list]], device: torch.device) -> Measured:
    """Call each saved region once, compiled, on device copies of its real inputs under the
    profiler. Inputs are copied before the region's range opens; the region is called as the
    executor calls it (boxed: the inputs it is the last reader of, ``Region.frees``, die inside it
    at their last use; the others are kept alive through it, as the executor's environment keeps
    them). Random ops draw from the generators, which are put back."""
    allocs: dict[str, Allocation] = {}
    failed: dict[str, tuple[Region, str]] = {}
    if not saved:
        return Measured(allocs, failed)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    label = "pscompile::measure/"
    excess: dict[int, int] = {}
    copies: dict[int, int] = {}
    keys = list(saved)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            for i, key in enumerate(keys):
                r, snaps = saved[key]
                args = [s.restore() if isinstance(s, Snapshot) else s for s in snaps]
                copies[i] = _storage_bytes(args)
                held = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
                kept = [a for j, a in enumerate(args) if j not in r.frees]    # live after it in a real run
                try:
                    with torch.profiler.record_function(f"{label}{i}"):
                        outs = r.fn(args)          # (boxed: clears ``args``)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except Exception as e:  # noqa: BLE001 -- any failure: the region runs as eager code instead
                    failed[key] = (r, f"{type(e).__name__}: {first_line(e)}")
                    continue
                finally:
                    args.clear()
                excess[i] = _excess_bytes(outs, r, held)
                del outs, kept
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    peaks = allocation_peaks(prof, label, device)
    footprint = 0
    for i, key in enumerate(keys):
        if key not in failed:
            allocs[key] = Allocation(peaks.get(i, 0), excess[i])
            footprint = max(footprint, copies[i] + peaks.get(i, 0))
    return Measured(allocs, failed, footprint)


@dataclass(frozen=True)
class RegionPeak:
    """The most non-model bytes live while one region runs, and the captured nodes it spans."""

    peak: int
    srcs: tuple[int, ...]        # its nodes' ``src_index`` (parameter views left out), in order


def region_peaks(regions: Sequence[Region], inside: dict[int, int], excess: dict[int, int],
                 starts: dict[int, int] | None, captured, measured: tuple[int, ...]) -> dict[int, RegionPeak]:
    """Region index -> its peak, for each region whose allocations are known (``inside``: bytes it
    allocates beyond what is live at its start: a compiled region's measured by ``measure``, an
    eager one's by the tracker in a probing run) or that receives gathered parameters.

    A region starts with ``starts[index]`` live (measured at its start in a probing run, every
    region run as eager code there) plus what the outputs of the compiled regions before it hold
    beyond their eager sizes (``excess``). Without ``starts``, an upper bound: the peak of the last
    node that executes before it in the node-by-node measurement ``measured``, plus the tensors
    spanning chunks the executor gathers before it (``regions.lifted_views``). An eager region not
    measured yet holds at each node what the node-by-node run held there, plus the gathered copies
    of readers after it (node by node, a gathered copy is made right before its one reader), plus
    the gradients whose stores the executor runs after the region (``Region.deferred``) from the
    store's place on (node by node, a gradient is stored, and freed, there)."""
    arrive = arrivals(measured, executed_nodes(captured)) if starts is None else None
    out: dict[int, RegionPeak] = {}
    wider = _excess_live(regions, excess)
    position: dict[fx.Node, int] = {}
    for r in sorted(regions, key=lambda r: r.index):
        gathers = _gathered_inputs(r)
        srcs = tuple(i for n in r.nodes if (i := get(n, "src_index")) is not None and _in_place(n)
                     and i < len(measured))
        if not srcs or (r.index not in inside and not gathers and not r.deferred):
            continue
        if r.index in inside:
            start = starts[r.index] if starts is not None else arrive[min(srcs)] + sum(gathers.values())
            out[r.index] = RegionPeak(start + wider.get(r.index, 0) + inside[r.index], srcs)
            continue
        if not position:
            position.update((n, i) for i, n in enumerate(r.nodes[0].graph.nodes))
        held = _deferred_gradients(r)
        peak = max(measured[get(n, "src_index")] + sum(b for cat, b in gathers.items() if position[cat] > position[n])
                   + sum(b for store, b in held.items() if position[store] < position[n])
                   for n in r.nodes if get(n, "src_index") in srcs)
        out[r.index] = RegionPeak(peak + wider.get(r.index, 0), srcs)
    return out


def _in_place(n: fx.Node) -> bool:
    """Whether ``n`` runs in its region where the plan placed it: not a parameter view (made where
    it is read) nor a ``getitem`` (it stays with its multi-output op: the backward's getitems of a
    forward attention's outputs run in the forward's region, where the plan left less room)."""
    return get(n, "param") is None and n.target is not operator.getitem


def over_plan(peaks: dict[int, RegionPeak], nonmodel: Sequence[int], floors: dict[int, int] | None = None,
              floor: int = 0) -> dict[int, int]:
    """Region index -> how far its peak goes beyond the room it has, for the regions that go beyond
    it. A region runs between memory nodes, so the chunks on the device do not change while it
    runs, and it has the most of: the non-model bytes the plan planned for any of its nodes
    (``nonmodel``, the curve it was planned with), ``floor`` (the budget less every slot of the
    plan and what lives on the device for good) and ``floors[index]`` if given."""
    floors = floors or {}
    return {i: p.peak - room for i, p in peaks.items()
            if p.peak > (room := max(max(nonmodel[s] for s in p.srcs), floor, floors.get(i, 0)))}


def room_of(r: Region) -> int | None:
    """The most non-model room the plan leaves region ``r`` (``verify_schedule``'s ``room`` meta of
    its nodes that run where the plan placed them), None if none has one."""
    return max((x for n in r.nodes if _in_place(n) and (x := get(n, "room"))), default=None)


def made_bytes(r: Region) -> int:
    """Bytes of every value region ``r``'s nodes make (views and ``getitem``s left out, a tuple's
    tensors counted): what any code for its graph allocates at most, temporaries that fusion
    removes included (library calls' workspaces aside)."""
    total = 0
    for n in r.nodes:
        if is_view_op(n) or n.target is operator.getitem:
            continue
        v = n.meta.get("val")
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _gathered_inputs(r: Region) -> dict[fx.Node, int]:
    """The gathered copies of tensors spanning chunks that region ``r`` receives: ``cat`` node ->
    bytes (the executor makes them before the region)."""
    out = {}
    for a in r.inputs:
        if get(a, "param") is not None and isinstance(a.args[0], fx.Node) and get(a.args[0], "gather") is not None:
            v = a.meta["val"]
            out[a.args[0]] = v.numel() * v.element_size()
    return out


def _excess_live(regions: Sequence[Region], excess: dict[int, int]) -> dict[int, int]:
    """Region index -> the bytes the outputs of the compiled regions before it hold beyond their
    eager sizes and that are still live when it runs (an output lives to the last region that
    reads it; one no later region reads, a graph output, to the end)."""
    by_index = sorted(regions, key=lambda r: r.index)
    readers: dict[fx.Node, int] = {}
    for r in by_index:
        for a in r.inputs:
            readers[a] = r.index
    out: dict[int, int] = {}
    for r in by_index:
        if not excess.get(r.index):
            continue
        last = max((readers.get(o, 1 << 30) for o in r.outputs), default=r.index)
        for q in by_index:
            if r.index < q.index <= last:
                out[q.index] = out.get(q.index, 0) + excess[r.index]
    return out


def _deferred_gradients(r: Region) -> dict[fx.Node, int]:
    """Region ``r``'s gradient stores the executor runs after it: store node -> the bytes of the
    gradient it keeps alive to the region's end (its storage's)."""
    out = {}
    for d in r.deferred:
        v = d.args[1].meta.get("val") if isinstance(d.args[1], fx.Node) else None
        if isinstance(v, torch.Tensor):
            try:
                out[d] = v.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):       # (a value without a storage)
                out[d] = v.numel() * v.element_size()
    return out


def _storage_bytes(values: Sequence[Any], skip: frozenset[int] | set[int] = frozenset()) -> int:
    """Bytes of the storages of ``values`` (each once), but those whose address is in ``skip``."""
    seen, total = set(skip), 0
    for v in values:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _excess_bytes(outs: Sequence[Any], r: Region, inputs: set[int]) -> int:
    """Bytes the compiled outputs ``outs`` of ``r`` hold beyond the same values computed eagerly.
    Outputs that are views of the region's inputs (storage addresses ``inputs``) hold nothing new,
    compiled or eager (Inductor returns a split of an input as a view of it, as eager code does):
    they are left out on both sides; an output eager code makes as a view of an input but the
    compiled code makes anew counts whole."""
    fresh = [(o, n) for o, n in zip(outs, r.outputs)
             if not (isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in inputs)]
    made = _storage_bytes([o for o, _ in fresh], inputs)
    placeholders = set(r.inputs)
    return max(0, made - _eager_bytes([n for _, n in fresh if not _views_an_input(n, placeholders)]))


def _views_an_input(n: fx.Node, inputs: set[fx.Node]) -> bool:
    """Whether the eager value of ``n`` is a view of one of ``inputs`` (a region's: a chain of
    view ops and getitems back to one)."""
    while n not in inputs:
        if not (n.op == "call_function" and (is_view_op(n) or n.target is operator.getitem)) \
                or not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return True


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
