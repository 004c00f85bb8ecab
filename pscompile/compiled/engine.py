"""Compiled mode: the whole iteration as one FX graph, every memory decision a node in it.

The engine owns the chunks and the device slots and runs schedules; it plans nothing itself.
Planning is ``pscompile.graph.pipeline`` (see there and docs/design.md for the passes)::

    capture_and_analyze   capture_joint -> annotate_params -> estimate_nonmodel     once per capture
    build_schedule        plan_residency -> prefetch_fetches -> insert_memory_ops -> verify_schedule

Schedules are kept per ``ScheduleKey`` (run kind, train()/eval(), batch signature). The first run
of a schedule measures the non-model memory of every node (the executor runs node by node with
an observer); the schedules of that capture are then planned again with the measured curve, and
with ``backend="inductor"`` later runs execute one program Inductor compiled from the whole schedule,
memory nodes inside, checked against Inductor's own buffer plan before it runs
(``compiled/lowering.py`` tells a schedule's life, ``compiled/whole.py`` the program). Memory nodes
always run in ``compiled/moves.py`` (``ChunkMoves``, the part that owns the slots), through the copy engine, and the bytes a
run moved must equal the bytes its plan promised; what a checkpoint carries of compiled mode is
``compiled/state.py``. The optimizer runs after the graph, chunk by chunk, where
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

from pscompile.compiled.capture_life import CaptureBook, CaptureStatus
from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.choice_store import ChoiceStore
from pscompile.compiled.lowering import ScheduleLowering
from pscompile.compiled.moves import ChunkMoves
from pscompile.compiled.planning import CompiledPlanning
from pscompile.compiled.state import CompiledState
from pscompile.compiled.ranges import ShapeRanges
from pscompile.compiled.schedule import Schedule, model_summary
from pscompile.config import AdamW, Config
from pscompile.resolved import resolve
from pscompile.errors import BudgetError
from pscompile.graph.meta import get
from pscompile.graph.ops import activation_move, mem_op
from pscompile.graph.minimum import minimum_budget, program_least
from pscompile.graph.pipeline import Scheduled
from pscompile.kinds import Backend, MemKind, RunKind
from pscompile.memory.disk_homes import DiskAccumulation
from pscompile.memory.rates import Rates, measure_rates
from pscompile.memory.tracker import NonModelTracker
from pscompile.passes.plan_residency import ResidencyPlan
from pscompile.runtime.batching import LossFn, micro_batches, to_device
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


class CompiledEngine(CompiledPlanning, ScheduleLowering, CompiledState, ChunkEngine):
    def __init__(self, model: nn.Module, batch: Any, *, optimizer: AdamW, config: Config,
                 loss_fn: LossFn | None = None):
        config = resolve(config)
        if config.backend == Backend.INDUCTOR:
            try:
                importlib.import_module("torch._inductor.fx_passes.control_dependencies")
            except ImportError:
                raise ValueError(f"backend='inductor' needs Inductor's control_deps (torch._inductor.fx_passes."
                                 f"control_dependencies), which torch {torch.__version__} lacks (pscompile is "
                                 "tested with torch 2.13); use backend='eager' or a newer torch") from None
        self.ranges = ShapeRanges(config.dynamic is not False)      # batches whose sizes change
        self.choices_kept = ChoiceStore()         # layout and activation choices kept across processes
        super().__init__(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
        if self.world > 1:    # ZeRO: the ranges see only the sizes the ranks agree on (``_check_batch``),
            self.ranges.restart()                               # not a rank's own first batch
        # every capture's analysis, schedules (cold and warm variants) and life (``capture_life.py``)
        self.book = CaptureBook()
        self._last_key: ScheduleKey | None = None
        self._last_run: Scheduled | None = None        # the schedule the last step ran (cold or warm)
        self.moves = ChunkMoves(self.store, self.copies, self.link, device=self.device, dtype=self.dtype,
                                chunk_size=self.layout.chunk_size, start_update=self._start_update)
        self._os_placed = False
        self._check_moved: tuple[Scheduled, Any, bool] | None = None   # a run whose bytes are checked after its update
        self._init_lowering()
        self._sample_every_op = False      # regions too (tests: the boundary samples against every operator)
        self._restored: dict[str, dict] = {}      # CaptureKey.token -> what a loaded checkpoint measured
        self.last_plan: ResidencyPlan | None = None
        self.eval_plan: ResidencyPlan | None = None
        self._rates: Rates | None = None
        try:
            try:
                if self.comm is not None:
                    self._check_batch(batch, micro_batches(batch), "compile")
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
        return self.config.backend == Backend.INDUCTOR

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

    # ================================================================ running
    def _run_graph(self, key: ScheduleKey, sched: Scheduled, batch: Any,
                   acc: list[torch.Tensor] | None, loss_scale: float = 1.0) -> MicroRun:
        """Run one scheduled graph (memory nodes as planned) and check the bytes it moved against
        the plan. On failure, stored gradients are undone and slots reset to the plan's start.

        Long on purpose: its closures (around_region, run_memory, learn) share the run's tracker
        and what it is measuring; the steps before and after are methods of their own."""
        t_start = time.perf_counter()
        self._count_outside_steps()
        tracker = NonModelTracker(self.device, self.moves.is_model_storage, self.moves.model_bytes,
                                  exact_windows=not sched.measured)
        if self.book.life(key.capture).unproven and self.comm is None:   # stops at the first sample over
            tracker.limit = self.budget                            # (``_distrust_restored``)
        comm_before = self._comm_bytes()
        inputs = self._graph_inputs(sched, batch, acc, loss_scale, tracker)
        self.moves.begin_run(disk_acc=acc if isinstance(acc, DiskAccumulation) else None, fresh_acc=self._acc_is_zero(),
                             disk_prefetch=self.disk_prefetch)
        executor = self._executor_for(key, sched, inputs)
        observer = _NodeMemory(tracker) if not sched.measured else None
        t_bwd: list[float] = []

        # node by node, the tracker sees every operator (a dispatch mode); eager regions are sampled
        # at every step boundary instead: live storages plus what each region allocates inside (learned
        # by the tracker in the executor's first run, which samples every operator and records each
        # region's rise above its start); a compiled program at its memory nodes, with Inductor's
        # buffer plan (``compiled/whole.py``). Steps after measurement pay no per-operator cost.
        learning = executor.split == "regions" and not executor.learned
        extra = executor.region_extra if executor.split == "regions" else {}
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
                self.moves.mark_stored(mem_op(n))
            if learning and r.index not in extra:
                return learn(r)
            tracker.sample_with(extra.get(r.index, 0))
            return contextlib.nullcontext()

        dispatching = executor.split == "nodes" or self._sample_every_op or learning
        pause = tracker.paused if dispatching else contextlib.nullcontext
        overlapping = sched.kind is RunKind.TRAIN and self._overlaps_update and acc is None
        tail = self._tail(sched) if overlapping else frozenset()

        def run_memory(n: fx.Node, args: tuple) -> torch.Tensor | None:
            act = activation_move(n)
            with pause():
                if act is None:
                    mem = mem_op(n)
                    made = self.moves.run(mem, args, at_end=n in tail, node=n.name)
                else:
                    made = self.moves.move_activation(act, args, node=n.name)
            if act is not None and act.kind == MemKind.RELOAD:   # (in flight, but its memory is taken)
                if executor.split != "program":          # (there: one of Inductor's buffers, counted by them)
                    tracker.add_tensor(made)             # back on the device (the host copy is not)
            elif not dispatching and act is None and not mem.decl.arrives and not self.store.landing_bytes:
                return made       # no device memory was taken: the total cannot have risen here
            tracker.sample_now()
            self.store.landed()   # (an NF4 chunk's landing: its workspace counted in that sample)
            return made

        def count(values) -> None:   # compiled code allocates outside Python dispatch
            tracker.add_tensors(values)

        try:
            if executor.split == "program":     # one compiled program: Inductor's buffers are sampled
                (loss,) = executor.run(inputs, run_memory, sample=tracker.sample_with,    # at its memory nodes
                                       on_backward=lambda: t_bwd.append(time.perf_counter()))
            else:
                with tracker if dispatching else contextlib.nullcontext():
                    (loss,) = executor.run(inputs, run_memory, observer=observer,
                                           on_outputs=count if executor.split == "regions" else None,
                                           on_backward=lambda: t_bwd.append(time.perf_counter()),
                                           around_region=around_region if executor.split == "regions" else None)
            self.moves.end_run()
            if learning:                     # (a failed run learns nothing: its next run measures again)
                executor.learn(learned)
        except BaseException:
            self._abort_run(acc)
            raise
        traffic = self.link.reset()
        ranged = ShapeRanges.is_ranged(key.batch)
        if overlapping:                      # writebacks may still be landing: ``_update`` checks the bytes
            self._check_moved = (sched, traffic, ranged)
        else:
            self._check_traffic(sched, traffic, acc, ranged=ranged)
        self._check_comm(sched, comm_before, acc)
        t_end = time.perf_counter()
        t_back = t_bwd[0] if t_bwd else t_end
        record = _RunRecord(key, sched, observer.samples if observer is not None else None)
        value = float(loss.detach().float())
        self.copies.sync_compute()    # (reading the loss waited for compute already)
        compiled = executor.ops if executor.split == "program" else 0     # (Inductor's; compiled eager's are not)
        return MicroRun(value, tracker, traffic, t_back - t_start, t_end - t_back,
                        frozenset(self.moves.written), record, (executor.ops, compiled))

    def _graph_inputs(self, sched: Scheduled, batch: Any, acc: list[torch.Tensor] | None, loss_scale: float,
                      tracker: NonModelTracker) -> list:
        """The scheduled graph's inputs: slots, host chunks, the accumulation chunks it adds into,
        then buffers, the batch (and float16's loss scale), which ``tracker`` counts as non-model."""
        accs = acc if any(a.kind == MemKind.ACCUMULATE_GRAD or a.to_acc for a in sched.plan.actions) else []
        if isinstance(accs, DiskAccumulation):     # (on disk: the accumulate_grad nodes open them)
            accs = [torch.empty(0)] * len(accs)
        model_inputs = [*self.moves.slots[:sched.plan.num_slots], *self.store.host_param, *accs]
        rest = [*[self.model.get_buffer(f) for f in sched.captured.buffer_fqns],
                *sched.captured.flatten_batch(batch)]
        if self.scaler is not None and sched.kind.backward:        # float16: the graph's loss-scale input
            rest.append(torch.tensor(loss_scale, dtype=torch.float32, device=self.device))
        for t in rest:
            tracker.add_tensor(t)
        tracker.reset_peaks()
        return model_inputs + rest

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
        self.moves.settle()          # accumulation left clean chunks resident; updates need them home
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
        self.moves.ahead = list(sched.lookahead.fetches) if sched.measured and sched.lookahead is not None else []
        # a measured schedule's update allocates no device memory but 4-byte norms: no per-operator
        # dispatch mode (the fetches ahead, which take slots, are sampled where they start)
        try:
            with tracker if not sched.measured or self._sample_every_op else contextlib.nullcontext():
                skipped = self._optimizer_step(set(written), divisor, tracker, before_update=self.moves.land,
                                               norm_source=self._norm_source, order=self._update_order(),
                                               after_update=lambda c: self.moves.fetch_ahead(c, tracker))
                for c, _ in list(self.moves.ahead) if skipped else ():    # (a skipped step changed no chunk)
                    self.moves.fetch_ahead(c, tracker)
            self.moves.land()
        except BaseException:
            self.moves.land(errors=False)
            self.moves.settle()         # a failed step leaves no copy in flight: the chunks fetched ahead go
            raise
        finally:
            self.moves.ahead = []
        check, self._check_moved = self._check_moved, None
        if check is not None:
            run_sched, traffic, ranged = check
            tail = self.link.traffic                  # this step's bytes since the run's were read
            both = dataclasses.replace(traffic, h2d_bytes=traffic.h2d_bytes + tail.h2d_bytes,
                                       d2h_bytes=traffic.d2h_bytes + tail.d2h_bytes)
            self._check_traffic(run_sched, both, None, ranged=ranged)
        return skipped

    def _norm_source(self, c: int, gradless: list) -> torch.Tensor | None:
        """Chunk ``c``'s gradient for the norm: its device slot while its writeback lands (unless
        ranges of it got no gradient: those are zeroed at home, so it lands first)."""
        slot = self.moves.landing_slot(c)
        if slot is None:
            return None
        if gradless:
            self.moves.land(c)
            return None
        return self.moves.slots[slot]

    def _update_order(self):
        """Every chunk once: the next step's lookahead chunks first, then the others; a chunk whose
        writeback is still landing, or whose early update still runs, waits its turn while any
        ready one is left. When none is, the next is the one whose writeback was issued first
        (the link carries each direction in order, so it lands first), not the first in order,
        whose writeback may land last while the others could be updated and fetched ahead."""
        first = [c for c, _ in self.moves.ahead]
        todo = first + [c for c in range(self.layout.num_chunks) if c not in set(first)]
        while todo:
            landing = self.moves.still_landing() | self.early.running()
            c = next((c for c in todo if c not in landing), None)
            if c is None:                                        # all landing: the first issued
                c = min(todo, key=self.moves.issued)
            todo.remove(c)
            yield c

    def _undo_all(self, only=None) -> None:
        self.moves.land(errors=False)  # the homes being undone: no writeback still lands in them
        super()._undo_all(only)

    def _after_step(self, batches: list, runs: list[MicroRun], *, accumulate: bool) -> None:
        self._prove_restored(runs)
        measured: dict[CaptureKey, _RunRecord] = {}
        for r in runs:
            if r.context.samples is not None:
                measured.setdefault(r.context.key.capture, r.context)
        for rec in measured.values():
            self._remeasure(rec.key, rec.samples)
        self.last_plan = runs[-1].context.scheduled.plan
        self._last_key = runs[-1].context.key
        self._last_run = runs[-1].context.scheduled

    def _evaluate(self, batch: Any) -> tuple[float, int, int]:
        key, sched = self._runnable(batch, RunKind.EVAL)
        with torch.no_grad():
            run = self._run_graph(key, sched, batch, None)
        self._prove_restored([run])
        if run.context.samples is not None:
            self._remeasure(key, run.context.samples)
        self.eval_plan = sched.plan
        return run.loss, run.tracker.peak_total, run.traffic.h2d_bytes + run.traffic.d2h_bytes

    def _remeasure(self, key: ScheduleKey, samples: dict[int, int]) -> None:
        """Replace the static non-model estimate by the measured one and plan again (every
        schedule of the same capture: train and accumulation share it). A range's capture keeps the
        larger of the two at every node: the estimate is made at the bound and shown to grow with
        the sizes, and a measurement at one length only adds what the estimate missed (alone, one at
        the bound fell short of a shorter batch's needs on Hugging Face's GPT-2: 846,340 bytes
        against a budget of 813,431 planned from it)."""
        cap = key.capture
        static = self.book.analysis(cap).nonmodel     # kept where nothing runs: placeholders, output,
        measured = tuple(samples.get(i, est) for i, est in enumerate(static))   # parameter views
        if ShapeRanges.is_ranged(key.batch):    # the estimate at the bound is what grows with the sizes:
            measured = tuple(map(max, measured, static))   # a measurement (at any length) only adds to it
        if self.comm is not None:          # every rank plans from the same curve: the same collectives
            measured = self.comm.agree_max(measured)
        self.book.life(cap).measure(measured)
        self._fit_optimizer_states(max(measured))     # first: the new curve may leave less margin
        self._replan_capture(cap, measured, measured=True)
        if self._program_capture(key):   # compiled when a run of this key comes (``_runnable``): a batch of
            self._lower_when_run(key)    # another length may come first and make a range, whose program serves it
        else:
            self._lower(key)

    # ================================================================ inspection
    def _need(self) -> str:
        """With Inductor, both minima: its program's, and compiled eager's below it."""
        if self.config.backend != Backend.INDUCTOR:
            return super()._need()
        least = self.min_device_memory
        return (f"{format_bytes(program_least(least, self.config))} for Inductor's program ({format_bytes(least)} as compiled "
                "eager)")

    @property
    def min_device_memory(self) -> int:
        """The smallest budget every schedule planned so far fits in (``minimum.minimum_budget``:
        at every node, the chunks it reads next to its window of non-model bytes, optimizer states
        on the host), with the measured curve where there is one. It is the minimum of the graphs
        the activation policy chose for this budget; with more recomputation a smaller budget may
        work (``pscompile.min_device_memory`` says how small)."""
        slot = self.store.param_chunk_bytes
        return max(minimum_budget(self.book.analysis(key.capture), self.layout, nonmodel=self.book.cold(key).nonmodel,
                                  slot_bytes=slot, world=self.world, device_homes=self.min_device_homes,
                                  state_bytes=self.store.os_chunk_bytes).nbytes
                   for key in self.book.keys())

    def captures(self) -> list[CaptureStatus]:
        """What ran for each capture and why (``compiled/capture_life.py``): its stage (static,
        measured, restored from a checkpoint, or raised to Inductor's buffers), the re-plans
        Inductor's buffers caused, and why it runs as compiled eager (None where it runs one program)."""
        return self.book.status()

    def _mode_title(self) -> str:
        return f"compiled mode ({self.config.backend} backend)"

    def _describe_lines(self) -> list[str]:
        plan = self.schedule.scheduled.activations
        return [self.describe_tiers(), *([plan.describe()] if plan is not None else [])]

    @property
    def schedule(self) -> Schedule:
        """The training schedule most recently run by ``step`` (its warm variant when that ran; else
        the latest one planned):
        ``print`` it, ``.table()``, ``.save(folder)``. ``schedule_of(batch, kind)`` gives any other,
        e.g. the evaluation schedule."""
        key = self._last_key if self.book.cold(self._last_key) is not None else self.book.last_key()
        cold = self.book.cold(key)
        ran = self._last_run if self._last_run in (cold, self.book.warm(key)) else None
        return self._as_schedule(ran or cold)

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
