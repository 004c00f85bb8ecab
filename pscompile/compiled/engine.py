"""Compiled mode: the whole iteration as one FX graph, every memory decision a node in it.

The engine owns the chunks and the device slots and runs schedules; it plans nothing itself.
Planning is ``pscompile.graph.pipeline`` (see there and docs/design.md for the passes)::

    capture_and_analyze   capture_joint -> annotate_params -> estimate_nonmodel     once per capture
    build_schedule        plan_residency -> prefetch_fetches -> insert_memory_ops -> verify_schedule

Schedules are kept per ``ScheduleKey`` (run kind, train()/eval(), batch signature). The first run
of a schedule measures the non-model memory of every node (the executor runs node by node with
an observer); the schedules of that capture are then planned again with the measured curve, and
with ``backend="inductor"`` later runs execute compute regions compiled by Inductor (the first run
of each such executor checks what its compiled regions receive and, for regions not measured yet,
runs them as eager code and keeps their real inputs to measure them on: ``compiled/probe.py``). Memory nodes
always run here, in ``_run_memory_node``, on a background copy queue, and the bytes a run moved
must equal the bytes its plan promised. The optimizer runs after the graph, chunk by chunk, where
each chunk's optimizer states live (``ChunkEngine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.lowering import RegionLowering
from pscompile.compiled.probe import Allocation, Probe
from pscompile.compiled.schedule import Schedule, model_summary
from pscompile.config import AdamW, Config
from pscompile.errors import BudgetError
from pscompile.graph.meta import get
from pscompile.graph.ops import ActivationMove, flat_pieces, is_memory_node
from pscompile.graph.pipeline import (AnalyzedGraph, DeviceMemory, Scheduled, build_schedule,
                                      capture_and_analyze, choose_activations, engine_layout, gather_bytes,
                                      minimum_budget, regather)
from pscompile.kinds import MemKind, RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.rates import Rates, measure_rates
from pscompile.memory.tiers import Tier
from pscompile.memory.tracker import NonModelTracker
from pscompile.memory.copies import Copy
from pscompile.optim.placement import device_state_chunks
from pscompile.passes.plan_residency import ResidencyPlan
from pscompile.runtime.batching import LossFn, to_device
from pscompile.runtime.params import ModelParams
from pscompile.runtime.engine import ChunkEngine, MicroRun
from pscompile.units import format_bytes

__all__ = ["CompiledEngine", "Scheduled"]


class _NodeMemory:
    """Executor observer of a measuring run: the non-model peak of every node of the captured
    graph (by ``src_index``). Parameter views allocate nothing and are rebuilt far from their
    captured place, so they are not sampled."""

    def __init__(self, tracker: NonModelTracker):
        self.tracker = tracker
        self.samples: dict[int, int] = {}

    def before(self, node: fx.Node) -> None:
        if get(node, "param") is None:
            self.tracker.start_window()

    def after(self, node: fx.Node) -> None:
        if get(node, "param") is not None:
            return
        src = get(node, "src_index")
        if src is not None:
            self.samples[src] = max(self.samples.get(src, 0), self.tracker.window_peak)


@dataclass(frozen=True)
class _RunRecord:
    """Compiled mode's context of a MicroRun: which schedule ran, and what it measured."""

    key: ScheduleKey
    scheduled: Scheduled
    samples: dict[int, int] | None      # measured non-model bytes per captured node (measuring run)
    probe: Probe | None = None          # a probing run's (its compiled regions are measured after the step)


def _add_landed(copies: list) -> None:
    """Wait (on the host, which reads them) for a gradient's copies to the host, ``(copy, fp32
    target, host copy or None)`` each, and add each host copy into its target (None: the copy went
    straight into a zero buffer)."""
    for copy, target, host in copies:
        copy.wait_host()
        if host is not None:
            target.add_(host)                    # fp32 += compute dtype, on the host


class CompiledEngine(RegionLowering, ChunkEngine):
    def __init__(self, model: nn.Module, batch: Any, *, optimizer: AdamW, config: Config,
                 loss_fn: LossFn | None = None):
        if config.backend == "inductor":
            if not hasattr(importlib.import_module("torch._inductor"), "standalone_compile"):
                raise ValueError(f"backend='inductor' needs torch._inductor.standalone_compile, which torch "
                                 f"{torch.__version__} lacks (pscompile is tested with torch 2.13); use "
                                 "backend='eager' or a newer torch")
        super().__init__(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
        self._captures: dict[CaptureKey, AnalyzedGraph] = {}
        self._measured: dict[CaptureKey, tuple[int, ...]] = {}    # measured non-model curve per capture
        self._schedules: dict[ScheduleKey, Scheduled] = {}
        self._warm: dict[ScheduleKey, Scheduled] = {}             # warm variants (accum, eval)
        self._last_key: ScheduleKey | None = None
        self._slots: list[torch.Tensor] = []
        self._slot_ptrs: set[int] = set()         # storages of the slots holding memory now
        self._slot_bytes_allocated = 0             # their bytes (the tracker reads it after every op)
        self._slot_chunk: dict[int, int] = {}      # slot index -> chunk held now
        self._os_placed = False
        self._in_flight: dict[int, Any] = {}       # slot -> future of its asynchronous fetch
        self._reading: dict[int, Any] = {}         # slot -> future of the writeback reading it
        self._homing: dict[int, Any] = {}          # chunk -> future of the writeback writing its home
        self._copying: dict[int, Any] = {}         # id(activation copy) -> future of its asynchronous copy
        # (parameter, chunk) -> [(future, fp32 target, host copy or None)] of an asynchronous accumulate_grad
        self._grad_copies: dict[tuple[str, int], list] = {}
        # the end of a training step (``_overlaps_update``): slot -> (chunk, its writeback still landing),
        # dropped by the plan but released only once landed, while the optimizer step starts
        self._deferred: dict[int, tuple[int, Copy]] = {}
        # id(scheduled gm) -> the memory nodes after its last compute node
        self._tails: dict[int, tuple[fx.GraphModule, frozenset[fx.Node]]] = {}
        self._ahead: list[tuple[int, int]] = []    # (chunk, slot) to fetch for the next step after its update
        self._check_moved: tuple[Scheduled, Any] | None = None   # a run whose bytes are checked after its update
        self._init_lowering()
        self._sample_every_op = False      # regions too (tests: the boundary samples against every operator)
        self._node_curves: dict[CaptureKey, tuple[int, ...]] = {}      # measured node by node
        self._restored: dict[str, dict] = {}      # repr(capture key) -> what a loaded checkpoint measured
        self._written: set[str] = set()            # parameters whose gradients the current run stored
        self.last_plan: ResidencyPlan | None = None
        self.eval_plan: ResidencyPlan | None = None
        self.eval_peak_device_bytes: int | None = None   # of the last evaluate()
        self.eval_bytes_moved: int | None = None
        self._rates: Rates | None = None
        try:
            try:
                self._schedule_for(to_device(batch, self.device), RunKind.TRAIN)
            except BudgetError as e:
                if not self.min_device_homes:
                    raise
                raise BudgetError(self._homes_note(str(e))) from e
        except BaseException:
            self.close()
            raise

    @property
    def _sources(self) -> bool:
        """Captures keep model source lines: messages about compiled regions name them."""
        return self.config.backend == "inductor"

    @property
    def rates(self) -> Rates:
        """The compute and link rates the activation planner weighs (measured once; every rank of
        a ZeRO run plans with the same, the largest measured)."""
        if self._rates is None:
            r = measure_rates(self.device, self.dtype, self.config.link_bandwidth)
            if self.comm is not None:
                flops, link = self.comm.agree_max((int(r.flops_per_s), int(r.link_bytes_per_s)))
                r = Rates(float(flops), float(link))
            self._rates = r
        return self._rates

    def _homes_note(self, why: str) -> str:
        n, k = self.layout.num_chunks, self.min_device_homes
        return (f"{why}; host_memory={format_bytes(self.config.host_memory)} holds only {n - k} of the {n} chunks "
                f"(fp32 master, Adam states and the compute-dtype copy: "
                f"{format_bytes(self.store.param_chunk_bytes + self.store.os_chunk_bytes)} each), so the other "
                f"{k} live on the device; give more host_memory or device_memory, or a smaller chunk_size")

    # ================================================================ planning
    def _choose_layout(self, mp: ModelParams, batch: Any) -> ChunkLayout:
        """With ``chunk_size="auto"`` and a budget, two layouts may differ: the paged one (least
        waste, at most an eighth of the budget; tensors larger than a chunk span several) and the
        one keeping every tensor whole. Each reader of a spanning tensor holds a gathered copy of it,
        so at a tight budget the whole one may fit where the paged one does not, and with room the
        paged one usually moves less. ``pipeline.engine_layout`` plans both on the first batch's
        capture (kept for the first schedule) and takes the one that moves the fewest bytes."""
        self._first_capture: tuple[CaptureKey, AnalyzedGraph] | None = None

        def analyze() -> AnalyzedGraph:
            analyzed = capture_and_analyze(self.model, batch, params=mp.params, loss_fn=self.loss_fn,
                                           dtype=self.dtype, sources=self._sources)
            self._first_capture = (self._key(batch, RunKind.TRAIN).capture, analyzed)
            return analyzed
        layout, self.layout_choices = engine_layout(mp, self.config, self.budget, analyze=analyze, world=self.world,
                                                    per_chunk=self.per_chunk)
        return layout

    def _key(self, batch: Any, kind: RunKind) -> ScheduleKey:
        return ScheduleKey.of(batch, kind, self.model.training)

    def _schedule_for(self, batch: Any, kind: RunKind) -> Scheduled:
        """The (cold) schedule of ``batch`` for ``kind``; captured and planned on first use."""
        key = self._key(batch, kind)
        sched = self._schedules.get(key)
        if sched is not None:
            return sched
        analyzed = self._captures.get(key.capture)
        if analyzed is None:
            first, self._first_capture = self._first_capture, None
            if first is not None and first[0] == key.capture:      # captured to choose the layout
                analyzed = regather(first[1], gather_bytes(self.layout, self.dtype))
            else:
                analyzed = capture_and_analyze(self.model, batch, params=self.params, loss_fn=self.loss_fn,
                                               dtype=self.dtype, backward=key.kind.backward,
                                               gathers=gather_bytes(self.layout, self.dtype),
                                               sources=self._sources)
            analyzed = choose_activations(analyzed, self.layout, policy=self.config.activations, budget=self.budget,
                                          slot_bytes=self.store.param_chunk_bytes, world=self.world,
                                          device_homes=self.min_device_homes, state_bytes=self.store.os_chunk_bytes,
                                          rates=self.rates if self.config.activations == "auto" else None,
                                          host_room=self.host_room)
            self._captures[key.capture] = analyzed
        self._install_restored(key.capture)
        measured = self._measured.get(key.capture)
        nonmodel = measured if measured is not None else analyzed.nonmodel
        self._fit_optimizer_states(max(nonmodel))
        sched = self._plan(analyzed, nonmodel, kind=key.kind, measured=measured is not None)
        self._schedules[key] = sched
        return sched

    def _device_memory(self) -> DeviceMemory:
        """The device as the pipeline sees it now."""
        os_dev = frozenset(c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE)
        return DeviceMemory(self.budget, self.store.param_chunk_bytes, os_dev, self.store.dev_os_pool.bytes_in_use,
                            world=self.world, rank=self.rank, per_chunk=self.per_chunk)

    def _plan(self, analyzed: AnalyzedGraph, nonmodel: tuple[int, ...], *, kind: RunKind, measured: bool,
              start: dict[int, int] | None = None) -> Scheduled:
        sched = build_schedule(analyzed, self.layout, nonmodel=nonmodel, memory=self._device_memory(),
                               dtype=self.dtype, kind=kind, measured=measured, start=start,
                               lookahead=self._overlaps_update and measured, planner=self.config.planner)
        self._ensure_slots(sched.plan)
        if sched.lookahead is not None:
            while len(self._slots) <= max((k for _, k in sched.lookahead.fetches), default=-1):
                self._slots.append(self._empty_slot())
        return sched

    @property
    def _overlaps_update(self) -> bool:
        """A training step ends while its optimizer step starts: the chunks' gradient norms are
        taken where they are (a writeback still landing: from the device), each chunk is updated as
        its writeback lands, and the next step's first chunks are fetched as soon as they are
        updated (``plan_lookahead``). For one rank whose chunks the host updates in place (not
        lock-free, no loss scaling, no optimizer states on disk); the others take the plain path."""
        return (self.world == 1 and self.updater is None and self.scaler is None
                and all(t is not Tier.DISK for t in self.store.os_tier))

    def _fit_optimizer_states(self, peak_nonmodel: int) -> None:
        """Device-aware optimizer-state placement (``pscompile.optim.placement``) for the largest
        non-model peak of every schedule and ``peak_nonmodel`` (a schedule about to be planned).
        The first placement decides; later ones only move states off the device (a measurement,
        or a new batch shape, that leaves less margin), and schedules planned for the old placement
        are planned again."""
        peak = max([peak_nonmodel] + [max(s.nonmodel) for s in self._schedules.values()])
        n = self.layout.num_chunks
        count = device_state_chunks(budget=self.budget, peak_nonmodel=peak, num_chunks=n,
                                    chunk_size=self.layout.chunk_size, param_chunk_bytes=self.store.param_chunk_bytes,
                                    state_chunk_bytes=self.store.os_chunk_bytes) if not self.states_on_host_only else 0
        count = max(count, self.min_device_homes)       # what the host cannot hold lives on the device
        now = sum(t is Tier.DEVICE for t in self.store.os_tier)
        if self._os_placed and count >= now:
            return
        self._place_states(set(range(count)))
        self._os_placed = True

    def _place_states(self, on_device: set[int]) -> None:
        """Put the optimizer states of ``on_device``'s chunks on the device, the others on the
        host, and plan every schedule again for the new placement."""
        for k, c in list(self._slot_chunk.items()):     # states leaving the device: between steps a
            if c not in on_device:                      # param chunk is its master's cast, which
                self._release_slot(k)                   # goes home with them (place_optimizer_states)
        self.store.place_optimizer_states(on_device)
        self._count_outside_steps()
        for key, s in list(self._schedules.items()):    # planned for the old placement
            self._replan(key, s.nonmodel, measured=s.measured)

    def _replan(self, key: ScheduleKey, nonmodel: tuple[int, ...], *, measured: bool) -> Scheduled:
        old = self._schedules[key]
        self._forget(old)
        warm = self._warm.pop(key, None)
        if warm is not None:
            self._forget(warm)
        self._schedules[key] = new = self._plan(self._captures[key.capture], nonmodel, kind=old.kind,
                                                measured=measured)
        return new

    def _forget(self, sched: Scheduled) -> None:
        """Drop what was made for a schedule that is being replaced."""
        self._forget_lowering(sched.gm)

    def _ensure_slots(self, plan: ResidencyPlan) -> None:
        """Slot tensors for ``plan`` (a slot holds memory only while it holds a chunk: a fetch
        allocates it, a drop gives it back), with the device-updated chunks in their fixed slots."""
        while len(self._slots) < plan.num_slots:
            self._slots.append(self._empty_slot())
        for c, k in plan.initial:                  # device-updated chunks live in fixed slots
            if self.store.os_tier[c] is not Tier.DEVICE:
                continue                           # a warm start: the previous run left it there
            if self._slot_chunk.get(k) != c:
                self._allocate_slot(k)
                self._slots[k].copy_(self.store.master[c])   # device-homed: the cast of its master
                self.store.attach(c, self._slots[k])
                self._slot_chunk[k] = c
        self._count_outside_steps()

    def _empty_slot(self) -> torch.Tensor:
        slot = torch.empty(self.layout.chunk_size, dtype=self.dtype, device=self.device)
        slot.untyped_storage().resize_(0)
        return slot

    def _allocate_slot(self, k: int) -> None:
        """Give slot ``k`` its chunk of device memory (a fetch into it is about to start)."""
        storage = self._slots[k].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.store.param_chunk_bytes)
            self._slot_ptrs.add(storage.data_ptr())
            self._slot_bytes_allocated += storage.nbytes()

    def _release_slot(self, k: int, node: str | None = None) -> None:
        """Slot ``k`` no longer holds its chunk: forget it and give its memory back (on CUDA to
        the caching allocator), so the bytes the plan lets activations use really are free."""
        self.store.detach(self._slot_chunk.pop(k))
        self._free_slot(k, node)

    def _free_slot(self, k: int, node: str | None = None) -> None:
        pending = self._in_flight.pop(k, None)      # a fetch for this step, issued by the last one
        if pending is not None:                     # (``plan_lookahead``): no copy into freed memory
            pending.wait()
        storage = self._slots[k].untyped_storage()
        if storage.nbytes():
            self.copies.check_free(self._slots[k], node)    # (the race checker: no copy still owns it)
            self._slot_ptrs.discard(storage.data_ptr())
            self._slot_bytes_allocated -= storage.nbytes()
            storage.resize_(0)

    def _runnable(self, batch: Any, kind: RunKind) -> tuple[ScheduleKey, Scheduled]:
        """The schedule to run now: the warm variant when the chunks resident now are the ones it
        starts from (the previous run of this loop left them), else the cold one, after dropping
        leftover chunks (clean: no bytes move)."""
        cold = self._schedule_for(batch, kind)
        key = self._key(batch, kind)
        warm = self._warm.get(key)
        if warm is None and cold.measured and len(cold.plan.final) > len(cold.os_device):
            warm = self._warm[key] = self._plan(self._captures[key.capture], cold.nonmodel, kind=kind,
                                                measured=True, start=dict(cold.plan.final))
        elif warm is None and cold.measured and cold.lookahead is not None and cold.lookahead.fetches:
            # a training step that starts with the chunks the previous one fetched for it
            start = dict(cold.lookahead.fetches)
            warm = self._warm[key] = self._plan(self._captures[key.capture], cold.nonmodel, kind=kind,
                                                measured=True, start=start)
        if warm is not None and self._residency() == dict(warm.plan.initial):
            return key, warm
        self._settle()
        return key, cold

    def _residency(self) -> dict[int, int]:
        """chunk -> slot of the chunks on the device now."""
        for k, c in list(self._slot_chunk.items()):
            if not self.store.resident(c):             # dropped behind our back (load_state_dict)
                del self._slot_chunk[k]
                self._free_slot(k)
        return {c: k for k, c in self._slot_chunk.items()}

    def _settle(self) -> None:
        """Back to the start of a cold run: only chunks whose optimizer states live on the device
        stay. The others are clean here (warm runs update nothing), so they are dropped, not copied."""
        for c, k in self._residency().items():
            if self.store.os_tier[c] is not Tier.DEVICE:
                assert not self.store.dirty[c], f"chunk {c} left dirty on the device by a warm run"
                self._release_slot(k)

    # ================================================================ running
    def _run_memory_node(self, mem, args, at_end: bool = False, node: str | None = None) -> None:
        """Perform one memory node. Copies go to the transfer queue (in order per direction); only a fetch with
        a ``wait`` and a writeback return before their copy is done (the drop after a writeback
        waits for it before giving the slot's memory back). Gradient stores to the host and a
        synchronous accumulate_grad wait for their copy, so the gradient dies where the plan says;
        an asynchronous accumulate_grad (``overlap_grad_copies``) is added into its buffer at its
        ``wait_grad``, which also keeps the gradient alive until then. ``at_end``
        (a training step's memory nodes after its last compute, ``_overlaps_update``): a drop whose
        chunk's writeback is still landing keeps the slot's memory until ``_land`` releases it.
        Every copy goes through the copy engine (``memory/copies.py``) and names ``node``; waits are
        compute-side, except where the host reads what landed (gradients it adds or updates from)."""
        store, q = self.store, self.copies
        if mem.kind == MemKind.FETCH:
            slot, _ = args                  # host_c: the chunk's home (store.fetch_source: which buffer)
            self._allocate_slot(mem.slot)
            # (the other copy engine may still be writing the chunk's home: a writeback earlier this run)
            fut = q.submit(slot, store.fetch_source(mem.chunk), "h2d", after=self._homing.get(mem.chunk), node=node)
            self.link.traffic.num_fetches += 1
            store.attach(mem.chunk, slot)
            self._slot_chunk[mem.slot] = mem.chunk
            if mem.asynchronous:
                self._in_flight[mem.slot] = fut
            else:
                fut.wait()
        elif mem.kind in (MemKind.ALLGATHER, MemKind.BROADCAST):    # ZeRO: the chunk/group arrives
            slot = args[0]
            self._allocate_slot(mem.slot)
            handle = store.gather_into(mem.chunk, slot, async_op=mem.asynchronous,
                                       copy=lambda d, s_: q.submit(d, s_, "h2d", node=node).wait())
            self.link.traffic.num_fetches += 1
            store.attach(mem.chunk, slot)
            self._slot_chunk[mem.slot] = mem.chunk
            if mem.asynchronous:
                self._in_flight[mem.slot] = handle
        elif mem.kind.reduces:                                      # ZeRO: gradients to their owners
            dest, slot, _, _, accumulate = args
            store.reduce_into_home(mem.chunk, slot, dest if accumulate else None,
                                   copy=lambda d, s_: q.submit(d, s_, "d2h", node=node).wait_host())
            store.dirty[mem.chunk] = False
        elif mem.kind == MemKind.WAIT and mem.slot is None:       # a gradient's copy (overlap_grad_copies)
            _add_landed(self._grad_copies.pop((mem.fqn, mem.chunk)))
        elif mem.kind == MemKind.WAIT:
            self._in_flight.pop(mem.slot).wait()          # a copy, or a collective's work
        elif mem.kind == MemKind.WRITEBACK:
            _, slot = args                  # host_c: the chunk's home; its gradient's own buffer there
            fetching = self._in_flight.get(mem.slot)        # (planned after its wait; kept safe anyway)
            self._reading[mem.slot] = self._homing[mem.chunk] = q.submit(
                store.home_for_device_data(mem.chunk, whole=True), slot, "d2h",
                after=fetching if isinstance(fetching, Copy) else None, node=node)
            store.dirty[mem.chunk] = False
        elif mem.kind.leaves:
            pending = self._reading.pop(mem.slot, None)
            if pending is not None and at_end:   # the optimizer step starts while it lands (_overlapped_update)
                chunk = self._slot_chunk.pop(mem.slot)
                store.detach(chunk)
                self._deferred[mem.slot] = (chunk, pending)
            else:
                if pending is not None:    # the slot's memory goes back only once its writeback has read it
                    pending.wait()
                self._release_slot(mem.slot, node)
            self.link.traffic.num_evictions += 1
        elif mem.kind == MemKind.ACCUMULATE_GRAD:
            acc, grad, offset, *page = args
            copies = []
            for piece, at in flat_pieces(grad, *page):                  # the gradient, or one page of it
                target = acc[offset + at:offset + at + piece.numel()].view(piece.shape)
                if self._fresh_acc:                                     # a zero buffer: 0 + g is g
                    copies.append((q.submit(target, piece, "d2h", node=node), target, None))
                    continue
                host = q.host_empty(piece.shape, piece.dtype)           # the gradient crosses the link
                copies.append((q.submit(host, piece, "d2h", node=node), target, host))
            if mem.asynchronous:          # its wait_grad adds it (the graph keeps the gradient alive until then)
                self._grad_copies[(mem.fqn, mem.chunk)] = copies
            else:
                _add_landed(copies)
            self._written.add(mem.fqn)
        else:
            dest, grad, offset, *page = args
            if mem.slot is None:                                        # home: the gradient's buffer there
                dest = store.home_for_device_data(mem.chunk, whole=False)
            for piece, at in flat_pieces(grad, *page):                  # strided grads: no temporary
                target = dest[offset + at:offset + at + piece.numel()].view(piece.shape)
                if mem.slot is not None:
                    target.copy_(piece)
                else:            # waited for: the gradient dies here, as the plan assumes (and the host
                    q.submit(target, piece, "d2h", node=node).wait_host()       # optimizer reads it)
            self._mark_stored(mem)

    def _mark_stored(self, mem) -> None:
        """The bookkeeping of a ``store_grad``: a slot's chunk is dirty, the parameter written. An
        eager region that runs stores itself has it done before it starts, so a region that fails
        part-way has its chunks restored (``_recover``) whether or not its copies ran."""
        if mem.slot is not None:
            self.store.dirty[mem.chunk] = True
        self._written.add(mem.fqn)

    def _move_activation(self, moves: ActivationMove, args: tuple, node: str | None = None) -> torch.Tensor | None:
        """Offload a saved activation into a new host buffer, or reload it into a new device
        tensor, on the transfer queue; waited for at once, or (asynchronous) at its ``wait_copy``."""
        src = args[0]
        if moves.kind == MemKind.WAIT:
            self._copying.pop(id(src)).wait()
            return None
        if moves.kind == MemKind.OFFLOAD:
            dst = self.copies.host_empty(src.shape, src.dtype, src.stride())
            fut = self.copies.submit(dst, src, "d2h", activation=True, node=node)
        else:
            dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device=self.device)
            fut = self.copies.submit(dst, src, "h2d", activation=True, node=node)
        if moves.asynchronous:
            self._copying[id(dst)] = fut          # a wait_copy of dst follows (the graph keeps src alive until it)
        else:
            fut.wait()
        return dst

    def _model_bytes(self) -> int:
        """Model bytes the device holds now: the memory of every slot (allocated, whether or not
        a chunk sits in it yet) and the optimizer states kept there."""
        return self._slot_bytes_allocated + self.store.dev_os_pool.bytes_in_use

    def _is_model_storage(self, ptr: int) -> bool:
        return ptr in self._slot_ptrs or self.store.is_model_storage(ptr)

    def _run_graph(self, key: ScheduleKey, sched: Scheduled, batch: Any,
                   acc: list[torch.Tensor] | None, loss_scale: float = 1.0) -> MicroRun:
        """Run one scheduled graph (memory nodes as planned) and check the bytes it moved against
        the plan. On failure, stored gradients are undone and slots reset to the plan's start."""
        t_start = time.perf_counter()
        self._count_outside_steps()
        tracker = NonModelTracker(self.device, self._is_model_storage, self._model_bytes,
                                  exact_windows=not sched.measured)
        accs = acc if any(a.kind == MemKind.ACCUMULATE_GRAD or a.to_acc for a in sched.plan.actions) else []
        comm_before = (self.comm.traffic.allgather_bytes, self.comm.traffic.reduce_scatter_bytes) \
            if self.comm is not None else (0, 0)
        model_inputs = [*self._slots[:sched.plan.num_slots], *self.store.host_param, *accs]
        rest = [*[self.model.get_buffer(f) for f in sched.captured.buffer_fqns],
                *sched.captured.flatten_batch(batch)]
        if self.scaler is not None and sched.kind.backward:        # float16: the graph's loss-scale input
            rest.append(torch.tensor(loss_scale, dtype=torch.float32, device=self.device))
        for t in rest:
            tracker.add_tensor(t)
        tracker.reset_peaks()
        inputs = model_inputs + rest
        self._written = set()
        executor = self._executor_for(key, sched)
        observer = _NodeMemory(tracker) if not sched.measured else None
        t_bwd: list[float] = []
        known = self._region_extra.get(id(sched.gm))
        extra = known[1] if known is not None and known[0] is sched.gm else {}

        # node by node, the tracker sees every operator (a dispatch mode); regions are sampled at
        # every step boundary instead: live storages plus what each region allocates inside, so steps
        # after measurement pay no per-operator cost. A compiled region's inside is measured once, on
        # the real inputs a probing run kept (``probe.measure``); an eager region's by the tracker in
        # the executor's first run, which samples every operator (exact windows) and records each
        # region's rise above its start. A probing run runs every region as eager code and learns all.
        probing = self._probing.get(id(sched.gm))
        probe = probing[1] if probing is not None and probing[0] is sched.gm and executor.split == "regions" else None
        learning = executor.split == "regions" and (self._unlearned.get(id(sched.gm)) is sched.gm or (
            probe is not None and probe.eager_all))
        learned: dict[int, int] = {}
        if learning:
            tracker.exact_windows = True

        @contextlib.contextmanager
        def learn(r):
            tracker.start_window()
            start = tracker.window_peak
            yield
            learned[r.index] = max(learned.get(r.index, 0), tracker.window_peak - start)

        def around_region(r) -> contextlib.AbstractContextManager:   # what the tracker cannot see inside
            for n in r.effects:
                self._mark_stored(get(n, "mem"))
            if learning and r.index not in extra:
                return learn(r)
            tracker.sample_with(extra.get(r.index, 0))
            return contextlib.nullcontext()

        dispatching = executor.split == "nodes" or self._sample_every_op or learning
        pause = tracker.paused if dispatching else contextlib.nullcontext
        if probe is not None:
            probe.quiet = pause          # its host copies of region inputs are not device memory
        overlapping = sched.kind is RunKind.TRAIN and self._overlaps_update and acc is None
        tail = self._tail(sched) if overlapping else frozenset()

        def run_memory(n: fx.Node, args: tuple) -> torch.Tensor | None:
            moves = get(n, "moves")
            with pause():
                if moves is None:
                    mem = get(n, "mem")
                    made = self._run_memory_node(mem, args, at_end=n in tail, node=n.name)
                else:
                    made = self._move_activation(moves, args, node=n.name)
            if moves is not None and moves.kind == MemKind.RELOAD:   # (in flight, but its memory is taken)
                tracker.add_tensor(made)                 # back on the device (the host copy is not)
            elif not dispatching and moves is None and not mem.kind.arrives:
                return made       # no device memory was taken: the total cannot have risen here
            tracker.sample_now()
            return made

        def count(values) -> None:   # compiled code allocates outside Python dispatch
            tracker.add_tensors(values)

        try:
            with tracker if dispatching else contextlib.nullcontext():
                (loss,) = executor.run(inputs, run_memory, observer=observer,
                                       on_outputs=count if executor.split == "regions" else None,
                                       on_backward=lambda: t_bwd.append(time.perf_counter()),
                                       around_region=around_region if executor.split == "regions" else None,
                                       call_region=probe.call if probe is not None else None)
            if not self._deferred:
                self.copies.flush()
            if probe is not None and probe.eager_all:   # settled after the step (``_settle_probe``)
                for i, v in learned.items():
                    probe.learned[i] = max(probe.learned.get(i, 0), v)
            elif learning:                   # (a failed run learns nothing: its next run measures again)
                extra.update(learned)
                del self._unlearned[id(sched.gm)]
            if probe is not None and not probe.eager_all:    # only checked layouts: settled now
                self._settle_probe(key, sched, probe)
            self._reading.clear()
            self._homing.clear()
        except BaseException:
            self.copies.drain()              # no copy is left running into memory the recovery frees
            self._land(errors=False)
            self._abandon_in_flight()
            self._grad_copies.clear()
            self._reading.clear()
            self._homing.clear()
            self._copying.clear()
            self._recover(restore=acc is None)
            raise
        traffic = self.link.reset()
        if overlapping:                      # writebacks may still be landing: ``_update`` checks the bytes
            self._check_moved = (sched, traffic)
        else:
            self._check_traffic(sched, traffic, acc)
        if self.comm is not None:
            comm = (self.comm.traffic.allgather_bytes - comm_before[0],
                    self.comm.traffic.reduce_scatter_bytes - comm_before[1])
            if comm != (sched.plan.allgather_bytes, sched.plan.reduce_scatter_bytes):
                self._recover(restore=acc is None)
                raise RuntimeError(f"executor: all-gathered/reduce-scattered {comm} bytes, the schedule planned "
                                   f"{(sched.plan.allgather_bytes, sched.plan.reduce_scatter_bytes)}")
        t_end = time.perf_counter()
        t_back = t_bwd[0] if t_bwd else t_end
        record = _RunRecord(key, sched, observer.samples if observer is not None else None,
                            probe if probe is not None and probe.eager_all else None)
        return MicroRun(float(loss.detach().float()), tracker, traffic, t_back - t_start, t_end - t_back,
                        frozenset(self._written), record)

    def _check_traffic(self, sched: Scheduled, traffic, acc: list[torch.Tensor] | None) -> None:
        """The bytes a run moved (a training run: with the fetches it issued for the next step,
        which its plan counts) must be the bytes its schedule planned; otherwise the run is undone
        and this raises."""
        moved = (traffic.h2d_bytes, traffic.d2h_bytes)
        planned = (sched.plan.h2d_bytes + sched.offload_bytes, sched.plan.d2h_bytes + sched.offload_bytes)
        if moved != planned or traffic.offload_bytes != sched.offload_bytes or traffic.reload_bytes != sched.offload_bytes:
            self._recover(restore=acc is None)
            raise RuntimeError(f"executor: moved h2d/d2h {moved} bytes (activations: {traffic.offload_bytes} offloaded, "
                               f"{traffic.reload_bytes} reloaded), the schedule planned {planned} "
                               f"({sched.offload_bytes} each way)")

    def _tail(self, sched: Scheduled) -> frozenset[fx.Node]:
        """The memory nodes of ``sched`` after its last compute node (the end of the step)."""
        known = self._tails.get(id(sched.gm))
        if known is None or known[0] is not sched.gm:
            tail = []
            for n in reversed(list(sched.gm.graph.nodes)):
                if n.op == "output":
                    continue
                if not is_memory_node(n):
                    break
                tail.append(n)
            known = self._tails[id(sched.gm)] = (sched.gm, frozenset(tail))
        return known[1]

    def _land(self, chunk: int | None = None, *, errors: bool = True) -> None:
        """Wait for the writebacks still landing (``chunk``'s, or all) and give their slots back;
        raise the first that failed (``errors``)."""
        failed = None
        for k, (c, fut) in list(self._deferred.items()):
            if chunk is None or c == chunk:
                del self._deferred[k]
                try:
                    fut.wait_host()             # the optimizer reads the home it writes
                except BaseException as e:      # noqa: BLE001 -- raised below, after every slot is back
                    failed = failed or e
                self._free_slot(k)
        if failed is not None and errors:
            raise failed

    # ---------------------------------------------------------------- the step (ChunkEngine.step)
    def _run_micro(self, batch: Any, *, acc: list[torch.Tensor] | None, scale: float, k: int) -> MicroRun:
        key, sched = self._runnable(batch, RunKind.TRAIN if acc is None else RunKind.ACCUM)
        return self._run_graph(key, sched, batch, acc, loss_scale=scale / k)

    def _grad_divisor(self, scale: float, k: int) -> float:
        if self.scaler is not None:
            return scale                # float16: each micro-batch's loss was scaled by scale / k in the graph
        return scale * k                # the graph sums unscaled gradients over k micro-batches

    def _update(self, last: MicroRun, written: frozenset[str], divisor: float,
                acc: list[torch.Tensor] | None) -> bool:
        self._settle()               # accumulation left clean chunks resident; updates need them home
        sched = last.context.scheduled
        if acc is not None or sched.kind is not RunKind.TRAIN or not self._overlaps_update:
            with last.tracker:
                return self._optimizer_step(set(written), divisor, last.tracker, grads=acc)
        return self._overlapped_update(last, sched, written, divisor)

    def _overlapped_update(self, last: MicroRun, sched: Scheduled, written: frozenset[str], divisor: float) -> bool:
        """The optimizer step of a training run whose last writebacks may still be landing
        (``_overlaps_update``). Each chunk's share of the gradient norm is read where it is now: a
        chunk still landing from its device slot (the same values; on the CPU the same bits), so
        the norm, the inf/NaN check and the clipping factor are known at once. Chunks are then
        updated as they land, the next step's lookahead chunks first, each fetched into its slot for
        the next step as soon as it is updated (``plan_lookahead``; bytes counted now). The bytes
        the run and these fetches moved are checked against the plan here, once all has landed."""
        tracker = last.tracker
        self._ahead = list(sched.lookahead.fetches) if sched.measured and sched.lookahead is not None else []
        # a measured schedule's update allocates no device memory but 4-byte norms: no per-operator
        # dispatch mode (the fetches ahead, which take slots, are sampled where they start)
        try:
            with tracker if not sched.measured or self._sample_every_op else contextlib.nullcontext():
                skipped = self._optimizer_step(set(written), divisor, tracker, before_update=self._land,
                                               norm_source=self._norm_source, order=self._update_order(),
                                               after_update=lambda c: self._fetch_ahead(c, tracker))
                for c, _ in list(self._ahead) if skipped else ():    # (a skipped step changed no chunk)
                    self._fetch_ahead(c, tracker)
            self._land()
        except BaseException:
            self._land(errors=False)
            self._settle()           # a failed step leaves no copy in flight: the chunks fetched ahead go
            raise
        finally:
            self._ahead = []
        check, self._check_moved = self._check_moved, None
        if check is not None:
            run_sched, traffic = check
            tail = self.link.traffic                  # this step's bytes since the run's were read
            both = dataclasses.replace(traffic, h2d_bytes=traffic.h2d_bytes + tail.h2d_bytes,
                                       d2h_bytes=traffic.d2h_bytes + tail.d2h_bytes)
            self._check_traffic(run_sched, both, None)
        return skipped

    def _norm_source(self, c: int, frozen: list) -> torch.Tensor | None:
        """Chunk ``c``'s gradient for the norm: its device slot while its writeback lands (unless
        ranges of it got no gradient: those are zeroed at home, so it lands first)."""
        slot = next((k for k, (chunk, _) in self._deferred.items() if chunk == c), None)
        if slot is None:
            return None
        if frozen:
            self._land(c)
            return None
        return self._slots[slot]

    def _update_order(self):
        """Every chunk once: the next step's lookahead chunks first, then the others; a chunk whose
        writeback is still landing waits its turn while any landed one is left."""
        first = [c for c, _ in self._ahead]
        todo = first + [c for c in range(self.layout.num_chunks) if c not in set(first)]
        while todo:
            landing = {c for c, fut in self._deferred.values() if not fut.done()}
            c = next((c for c in todo if c not in landing), todo[0])
            todo.remove(c)
            yield c

    def _fetch_ahead(self, c: int, tracker: NonModelTracker) -> None:
        """Chunk ``c`` is updated: if the next step starts with it, fetch it into its slot now."""
        slot = next((k for chunk, k in self._ahead if chunk == c), None)
        if slot is None:
            return
        held = self._deferred.get(slot)
        if held is not None:                      # (another chunk's writeback still reads the slot)
            self._land(held[0])
        self._allocate_slot(slot)
        self.link.count(self.store.param_chunk_bytes, "h2d")
        self._in_flight[slot] = self.copies.submit(self._slots[slot], self.store.fetch_source(c), "h2d",
                                                   counted=True, node=f"(the next step's fetch of chunk {c})")
        self.link.traffic.num_fetches += 1
        self.store.attach(c, self._slots[slot])
        self._slot_chunk[slot] = c
        tracker.sample_now()

    def _undo_all(self, only=None) -> None:
        self._land(errors=False)       # the homes being undone: no writeback still lands in them
        super()._undo_all(only)

    def _after_step(self, batches: list, runs: list[MicroRun], *, accumulate: bool) -> None:
        for r in runs:
            if r.context.probe is not None:
                self._settle_probe(r.context.key, r.context.scheduled, r.context.probe)
        measured: dict[CaptureKey, _RunRecord] = {}
        for r in runs:
            if r.context.samples is not None:
                measured.setdefault(r.context.key.capture, r.context)
        for rec in measured.values():
            self._remeasure(rec.key, rec.samples)
        self._adopt_pending_curves()
        self.last_plan = runs[-1].context.scheduled.plan
        self._last_key = runs[-1].context.key

    def evaluate(self, batch: Any) -> float:
        """The loss of ``batch`` from a forward pass only: no gradients, no update. It runs its own
        forward-only schedule (captured, planned, measured and lowered like a training step's, under
        the same budget). Like plain PyTorch, dropout follows the model's train()/eval() mode."""
        self._check_open()
        self._check_batch(batch, None, "evaluate")
        batch = to_device(batch, self.device)
        key, sched = self._runnable(batch, RunKind.EVAL)
        with torch.no_grad():
            run = self._run_graph(key, sched, batch, None)
        if run.context.probe is not None:
            self._settle_probe(key, sched, run.context.probe)
        if run.context.samples is not None:
            self._remeasure(key, run.context.samples)
        self._adopt_pending_curves()
        self.eval_peak_device_bytes = run.tracker.peak_total
        self.eval_bytes_moved = run.traffic.h2d_bytes + run.traffic.d2h_bytes
        self.eval_plan = sched.plan
        return self._global_mean(run.loss)

    def _remeasure(self, key: ScheduleKey, samples: dict[int, int]) -> None:
        """Replace the static non-model estimate by the measured one and plan again (every
        schedule of the same capture: train and accumulation share it)."""
        cap = key.capture
        static = self._captures[cap].nonmodel     # kept where nothing runs: placeholders, output,
        measured = tuple(samples.get(i, est) for i, est in enumerate(static))   # parameter views
        if self.comm is not None:          # every rank plans from the same curve: the same collectives
            measured = self.comm.agree_max(measured)
        self._measured[cap] = self._node_curves[cap] = measured
        self._fit_optimizer_states(max(measured))     # first: the new curve may leave less margin
        for other in list(self._schedules):
            if other.capture == cap:
                self._replan(other, measured, measured=True)
        self._lower(key)

    # ================================================================ checkpoints
    def _context(self) -> dict:
        """What the saved measurements are valid for."""
        return {"budget": self.budget, "world": self.world, "chunk_size": self.layout.chunk_size,
                "num_chunks": self.layout.num_chunks, "activations": self.config.activations,
                "backend": self.config.backend, "dtype": str(self.dtype)}

    def _mode_state(self) -> dict:
        """What this engine measured (per capture: the non-model curve it plans with, the one
        measured node by node, its region re-plans) and where the optimizer states live. A resumed
        engine plans, cuts and compiles exactly the regions this one runs, instead of measuring
        again in an eager run whose kernels round differently from Inductor's."""
        captures = {repr(cap): {"static": list(self._captures[cap].nonmodel), "measured": list(curve),
                                "node": list(self._node_curves.get(cap, curve)),
                                "rounds": self._region_rounds.get(cap, 0), "node_by_node": cap in self._node_by_node}
                    for cap, curve in self._measured.items() if cap in self._captures}
        rates = None if self._rates is None else [self._rates.flops_per_s, self._rates.link_bytes_per_s]
        regions = {"allocs": {k: [a.peak, a.excess] for k, a in self._allocs.items()},
                   "fallbacks": self._region_cache.failures(self.config.backend)}
        return {"compiled": {"context": self._context(), "captures": captures, "os_placed": self._os_placed,
                             "rates": rates, "regions": regions,
                             "os_device": [c for c in range(self.layout.num_chunks)
                                           if self.store.os_tier[c] is Tier.DEVICE]}}

    def _load_mode_state(self, sd: dict) -> None:
        saved = sd.get("compiled")
        if saved is None or saved.get("context") != self._context():
            return                         # another budget or layout: this engine measures its own
        self._restored = dict(saved["captures"])
        regions = saved.get("regions") or {}
        for k, (peak, excess) in regions.get("allocs", {}).items():   # what its compiled regions allocate
            self._allocs.setdefault(str(k), Allocation(int(peak), int(excess)))
        for k, why in regions.get("fallbacks", {}).items():           # and those it ran as eager code
            self._region_cache.fail((self.config.backend, str(k)), str(why))
        rates = saved.get("rates")
        if rates is not None and self.config.activations == "auto" and Rates(*rates) != self._rates:
            # the rates the saved run chose its activations with (a measurement on a busy machine
            # may choose otherwise, and recomputed or offloaded segments round differently)
            self._rates = Rates(*map(float, rates))
            for cap in list(self._captures):
                self._drop_capture(cap)
        now = [c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE]
        if saved["os_placed"] and list(saved["os_device"]) != now:
            self._place_states(set(saved["os_device"]))
        self._os_placed = self._os_placed or saved["os_placed"]
        for cap in list(self._captures):
            self._install_restored(cap)

    def _drop_capture(self, cap: CaptureKey) -> None:
        """Forget a capture and its schedules: captured and planned again at its next use."""
        for key in [k for k in self._schedules if k.capture == cap]:
            self._forget(self._schedules.pop(key))
            warm = self._warm.pop(key, None)
            if warm is not None:
                self._forget(warm)
        del self._captures[cap]
        for measured in (self._measured, self._node_curves, self._region_rounds):
            measured.pop(cap, None)
        self._node_by_node.discard(cap)

    def _install_restored(self, cap: CaptureKey) -> None:
        """Plan ``cap`` with a loaded checkpoint's measurements, if it has them for this graph."""
        entry = self._restored.pop(repr(cap), None)
        if entry is None or list(self._captures[cap].nonmodel) != list(entry["static"]):
            return
        self._measured[cap] = tuple(entry["measured"])
        self._node_curves[cap] = tuple(entry["node"])
        self._region_rounds[cap] = int(entry["rounds"])
        if entry["node_by_node"]:
            self._node_by_node.add(cap)
        for key in list(self._schedules):
            if key.capture == cap:
                self._replan(key, self._measured[cap], measured=True)

    def _abandon_in_flight(self) -> None:
        """After a failed run, collectives may still be running (a broken process group times out
        the queued ones one by one) and write into their slots: such a slot is not freed but
        replaced by a new empty one; the collective keeps the old memory until it ends."""
        for k, pending in self._in_flight.items():
            if getattr(pending, "running", lambda: False)():
                storage = self._slots[k].untyped_storage()
                self._slot_ptrs.discard(storage.data_ptr())
                self._slot_bytes_allocated -= storage.nbytes()
                self._slots[k] = self._empty_slot()
        self._in_flight.clear()

    def _recover(self, *, restore: bool = True) -> None:
        """After a failed graph run: undo stored gradients (``restore``; accumulation leaves the
        parameters intact), put slots back to the plan's start."""
        touched = {c for f in self._written for c in self.layout.entry(f).chunks} if restore else set()
        for k, c in list(self._slot_chunk.items()):
            if self.store.os_tier[c] is not Tier.DEVICE:
                self._release_slot(k)
        for c in sorted(touched):
            self.store.restore_from_master(c)
        self._count_outside_steps()

    # ================================================================ inspection
    @property
    def min_device_memory(self) -> int:
        """The smallest budget every schedule planned so far fits in (``pipeline.minimum_budget``:
        at every node, the chunks it reads next to its window of non-model bytes, optimizer states
        on the host), with the measured curve where there is one. It is the minimum of the graphs
        the activation policy chose for this budget; with more recomputation a smaller budget may
        work (``pscompile.min_device_memory`` says how small)."""
        slot = self.store.param_chunk_bytes
        return max(minimum_budget(self._captures[key.capture], self.layout, nonmodel=s.nonmodel,
                                  slot_bytes=slot, world=self.world, device_homes=self.min_device_homes,
                                  state_bytes=self.store.os_chunk_bytes).nbytes
                   for key, s in self._schedules.items())

    def describe(self) -> str:
        """A few lines on how the model was laid out and placed."""
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        return "\n".join([
            f"compiled mode ({self.config.backend} backend) on {self.device}, compute dtype "
            f"{str(self.dtype).replace('torch.', '')}, device_memory {budget} (minimum "
            f"{format_bytes(self.min_device_memory)})",
            f"layout: {self.layout.describe()}; order: {self.order_source}",
            self.describe_tiers(),
            *([plan.describe()] if (plan := self.schedule.scheduled.activations) is not None else []),
        ])

    @property
    def schedule(self) -> Schedule:
        """The training schedule most recently run by ``step`` (else the latest one planned):
        ``print`` it, ``.table()``, ``.save(folder)``. ``schedule_of(batch, kind)`` gives any other,
        e.g. the evaluation schedule."""
        key = self._last_key if self._last_key in self._schedules else next(reversed(self._schedules))
        return self._as_schedule(self._schedules[key])

    def schedule_of(self, batch: Any, kind: str = "train") -> Schedule:
        """The schedule for ``batch``: kind "train", "accum" (one micro-batch of gradient
        accumulation) or "eval" (forward only); planned now if it does not exist yet."""
        try:
            kind = RunKind(kind)
        except ValueError:
            raise ValueError(f"kind={kind!r}; use 'train', 'accum' or 'eval'") from None
        return self._as_schedule(self._schedule_for(to_device(batch, self.device), kind))

    def _as_schedule(self, sched: Scheduled) -> Schedule:
        return Schedule(sched, layout=self.layout, budget=self.budget, slot_bytes=self.store.param_chunk_bytes,
                        os_device_bytes=self.store.dev_os_pool.bytes_in_use, dtype=self.dtype,
                        model=model_summary(self.model))
