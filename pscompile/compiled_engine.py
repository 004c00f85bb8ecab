"""Compiled mode: the whole iteration as one FX graph, every memory decision a node in it.

Pipeline (each step a pass in ``passes/``, see DESIGN.md)::

    capture_joint       forward + loss + backward as one graph (params, buffers, batch: placeholders)
    annotate_params     which node reads which parameter (through views); last uses; phases
    estimate_nonmodel   non-model bytes per node from FakeTensor metadata (measured in the warm-up step)
    plan_residency      Belady residency of every chunk at every node, static slot assignment
    insert_memory_ops   explicit fetch / writeback / drop / store_grad nodes; params become slot views
    verify_schedule     invariants replayed symbolically; raises naming the node

The scheduled graph runs in an executor that performs each memory node exactly as planned (and
checks that the bytes it moves are the planned bytes); compute nodes run eagerly
(``backend="eager"``). The optimizer runs after the graph, chunk by chunk, where each chunk's
optimizer states live (shared with hooks mode). The first step measures the non-model memory of
every node and, if it differs from the static estimate, the schedule is planned again with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from .batching import LossFn, signature, to_device
from .capture import CapturedGraph, capture_joint
from .config import AdamW, Config
from .engine_base import ChunkEngine
from .graph_meta import get, put
from .lowering import LoweredGraph, RegionCache
from .ops import is_memory_node
from .passes.annotate_params import annotate_params
from .passes.estimate_nonmodel import estimate_nonmodel
from .passes.insert_memory_ops import insert_memory_ops
from .passes.plan_residency import GradStore, ResidencyError, ResidencyPlan, plan_residency
from .passes.prefetch_fetches import prefetch_fetches
from .passes.verify_schedule import verify_schedule
from .schedule import Schedule, model_summary
from .stats import StepStats
from .tiers import Tier, TransferQueue
from .tracker import NonModelTracker
from .units import format_bytes

_OPT_TEMP_BYTES_PER_ELEMENT = 8


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float
    summary: str


@dataclass(frozen=True)
class Scheduled:
    """One batch signature's schedule: the plan, the rewritten graph, and how they were made."""

    captured: CapturedGraph
    plan: ResidencyPlan
    gm: fx.GraphModule
    nonmodel: tuple[int, ...]          # per node of the captured graph (measured after warm-up)
    measured: bool
    passes: tuple[PassTiming, ...]


class _Runner(fx.Interpreter):
    """Runs a scheduled graph: memory nodes through the engine, compute nodes eagerly."""

    def __init__(self, engine: "CompiledEngine", gm: fx.GraphModule, tracker: NonModelTracker, *,
                 measure: bool):
        super().__init__(gm, garbage_collect_values=True)
        self.engine = engine
        self.tracker = tracker
        self.measure = measure                 # record each node's non-model bytes (warm-up step)
        self.samples: dict[int, int] = {}      # captured-graph node index -> peak non-model bytes
        self.first_bwd_time: float | None = None

    def run_node(self, n: fx.Node) -> Any:
        if is_memory_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            with self.tracker.paused():
                self.engine._run_memory_node(get(n, "mem"), args)
            self.tracker.sample_now()
            return None
        if self.first_bwd_time is None and get(n, "phase") == "bwd":
            self.first_bwd_time = time.perf_counter()
        if not self.measure:
            return super().run_node(n)
        self.tracker.start_window()
        out = super().run_node(n)
        src = get(n, "src_index")
        if src is not None:
            self.samples[src] = max(self.samples.get(src, 0), self.tracker.window_peak)
        return out


class CompiledEngine(ChunkEngine):
    splits_large_tensors = False

    def __init__(self, model: nn.Module, batch: Any, *, optimizer: AdamW, config: Config,
                 loss_fn: LossFn | None = None):
        if config.dtype == torch.float16:
            raise NotImplementedError("dtype=torch.float16 (dynamic loss scaling) is not wired into compiled mode "
                                      "yet; use dtype=torch.bfloat16 or mode='hooks'")
        super().__init__(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
        self._schedules: dict[tuple, Scheduled] = {}
        self._slots: list[torch.Tensor] = []
        self._slot_chunk: dict[int, int] = {}      # slot index -> chunk held now
        self._os_placed = False
        self._queue = TransferQueue(self.link)     # the copy engine: transfers overlap compute
        self._in_flight: dict[int, Any] = {}       # slot -> future of its asynchronous fetch
        self._region_cache = RegionCache()         # compiled regions, shared by every schedule
        self._lowered: dict[int, LoweredGraph] = {}   # id(scheduled gm) -> its lowering
        try:
            self._schedule_for(to_device(batch, self.device))
        except BaseException:
            self.close()
            raise

    # ================================================================ planning
    def _schedule_for(self, batch: Any) -> Scheduled:
        sig = signature(batch)
        sched = self._schedules.get(sig)
        if sched is None:
            t0 = time.perf_counter()
            captured = capture_joint(self.model, batch, params=self.params, loss_fn=self.loss_fn,
                                     param_dtype=self.dtype)
            t1 = time.perf_counter()
            uses = annotate_params(captured)
            t2 = time.perf_counter()
            curve = estimate_nonmodel(captured, uses, grads_stored_at=self._grad_store_points(captured, uses))
            t3 = time.perf_counter()
            timings = (PassTiming("capture_joint", t1 - t0, captured.summary),
                       PassTiming("annotate_params", t2 - t1, uses.summary),
                       PassTiming("estimate_nonmodel", t3 - t2, curve.summary))
            nonmodel = tuple(curve.without_outputs)    # each gradient dies at its store_grad
            if not self._os_placed:
                self._place_optimizer_states(max(nonmodel))
            sched = self._plan(captured, uses, nonmodel, measured=False, timings=timings)
            self._schedules[sig] = sched
        return sched

    def _place_optimizer_states(self, peak_nonmodel: int) -> None:
        """Device-aware placement from the peak non-model bytes. When a measurement leaves less
        margin than the estimate did, chunks whose states leave the device first write their
        (device-updated) parameters home and give up their fixed slots."""
        n = self.layout.num_chunks
        if self.budget is None:
            on_device = set(range(n))
        else:
            temp = _OPT_TEMP_BYTES_PER_ELEMENT * self.layout.chunk_size
            margin = self.budget - max(peak_nonmodel, temp) - n * self.store.param_chunk_bytes
            on_device = set(range(max(0, min(n, margin // self.store.os_chunk_bytes))))
        for k, c in list(self._slot_chunk.items()):
            if c not in on_device:
                if self.store.dirty[c]:
                    self.store.host_param[c].copy_(self._slots[k])
                self.store.detach(c)
                del self._slot_chunk[k]
        self.store.place_optimizer_states(on_device)
        self.link.reset()
        self._os_placed = True

    @staticmethod
    def _grad_store_points(captured: CapturedGraph, uses) -> dict[str, int]:
        """The node after which each gradient overwrites its parameter's chunk space: once the
        gradient exists and the parameter's last (view-aware) read is done."""
        nodes = list(captured.gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        out = {}
        for fqn, grad_node in zip(captured.grad_fqns, nodes[-1].args[0][1:]):
            last = uses[fqn].last_use
            out[fqn] = max(index[grad_node], last if last is not None else 0)
        return out

    def _plan(self, captured: CapturedGraph, uses, nonmodel: tuple[int, ...], *, measured: bool,
              timings: tuple[PassTiming, ...]) -> Scheduled:
        nodes = list(captured.gm.graph.nodes)
        reads = []
        for n in nodes:
            chunks = []
            for fqn in get(n, "reads", ()):
                for c in self.layout.entry(fqn).chunks:
                    if c not in chunks:
                        chunks.append(c)
            reads.append(chunks)
        elsize = torch.empty((), dtype=self.dtype).element_size()
        stores: dict[int, list[GradStore]] = {}
        for fqn, at in self._grad_store_points(captured, uses).items():
            e = self.layout.entry(fqn)
            stores.setdefault(at, []).append(GradStore(e.pieces[0].chunk, fqn, e.pieces[0].chunk_offset,
                                                       e.numel * elsize))
        os_dev = frozenset(c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE)
        os_bytes = self.store.dev_os_pool.bytes_in_use
        t0 = time.perf_counter()
        try:
            plan = plan_residency(reads, nonmodel, stores=stores, num_chunks=self.layout.num_chunks,
                                  slot_bytes=self.store.param_chunk_bytes, budget=self.budget,
                                  os_device_chunks=os_dev, os_device_bytes=os_bytes,
                                  describe_node=lambda i: _describe(nodes[i]))
        except ResidencyError as e:
            from .hooks_engine import BudgetError
            raise BudgetError(f"{e} (device_memory={format_bytes(self.budget)}; give device_memory >= "
                              f"{e.minimum}, a smaller batch or mode='hooks')") from e
        t1 = time.perf_counter()
        plan, prefetch = prefetch_fetches(plan, nonmodel, budget=self.budget, os_device_bytes=os_bytes)
        t1b = time.perf_counter()
        for i, n in enumerate(nodes):
            put(n, "src_index", i)
            put(n, "nonmodel", nonmodel[i])
        gm = insert_memory_ops(captured.gm, plan, self.layout, param_fqns=captured.param_fqns,
                               grad_fqns=captured.grad_fqns, compute_dtype=self.dtype)
        t2 = time.perf_counter()
        report = verify_schedule(gm, self.layout, slot_bytes=self.store.param_chunk_bytes, budget=self.budget,
                                 initial=dict(plan.initial), os_device_chunks=os_dev, os_device_bytes=os_bytes)
        t3 = time.perf_counter()
        timings = timings + (PassTiming("plan_residency", t1 - t0, plan.summary(self.budget)),
                             PassTiming("prefetch_fetches", t1b - t1, prefetch.summary),
                             PassTiming("insert_memory_ops", t2 - t1b,
                                        f"insert_memory_ops: {report.num_memory_nodes} memory nodes"),
                             PassTiming("verify_schedule", t3 - t2, report.summary(self.budget)))
        self._ensure_slots(plan)
        return Scheduled(captured, plan, gm, nonmodel, measured, timings)

    def _ensure_slots(self, plan: ResidencyPlan) -> None:
        cs = self.layout.chunk_size
        while len(self._slots) < plan.num_slots:
            self._slots.append(torch.empty(cs, dtype=self.dtype, device=self.device))
        self._slot_ptrs = {s.untyped_storage().data_ptr() for s in self._slots}
        for c, k in plan.initial:                  # device-updated chunks live in fixed slots
            if self._slot_chunk.get(k) != c:
                self._slots[k].copy_(self.store.host_param[c])
                self.store.attach(c, self._slots[k])
                self._slot_chunk[k] = c
        self.link.reset()

    # ================================================================ running
    def _run_memory_node(self, mem, args) -> None:
        """Perform one memory node. Copies go to the transfer queue (in order); only a fetch with
        a ``wait`` returns before its copy is done: everything else is waited for at once, except
        writebacks and host-side gradient stores, which nothing reads before the queue drains."""
        store, q = self.store, self._queue
        if mem.kind == "fetch":
            slot, host = args
            fut = q.submit(slot, host, "h2d")
            self.link.traffic.num_fetches += 1
            store.attach(mem.chunk, slot)
            self._slot_chunk[mem.slot] = mem.chunk
            if mem.asynchronous:
                self._in_flight[mem.slot] = fut
            else:
                fut.result()
        elif mem.kind == "wait":
            self._in_flight.pop(mem.slot).result()
        elif mem.kind == "writeback":
            host, slot = args
            q.submit(host, slot, "d2h")
            store.dirty[mem.chunk] = False
        elif mem.kind == "drop":
            store.detach(mem.chunk)
            self.link.traffic.num_evictions += 1
            del self._slot_chunk[mem.slot]
        else:
            dest, grad, offset = args
            target = dest[offset:offset + grad.numel()].view(grad.shape)   # strided grads: no temporary
            if mem.slot is not None:
                target.copy_(grad)
                store.dirty[mem.chunk] = True
            else:
                q.submit(target, grad, "d2h")
            self._written.add(mem.fqn)

    def _model_bytes(self) -> int:
        return len(self._slot_chunk) * self.store.param_chunk_bytes + self.store.dev_os_pool.bytes_in_use

    def _is_model_storage(self, ptr: int) -> bool:
        return ptr in self._slot_ptrs or self.store.is_model_storage(ptr)

    def step(self, batch: Any) -> float:
        """Run the scheduled graph, then the chunk-wise optimizer; returns the loss."""
        self._check_open()
        t_start = time.perf_counter()
        batch = to_device(batch, self.device)
        sched = self._schedule_for(batch)
        self.link.reset()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        tracker = NonModelTracker(self.device, self._is_model_storage, self._model_bytes,
                                  exact_windows=not sched.measured)
        inputs = [*self._slots[:sched.plan.num_slots], *self.store.host_param,
                  *[self._buffer(f) for f in sched.captured.buffer_fqns], *sched.captured.flatten_batch(batch)]
        for t in inputs[sched.plan.num_slots + self.layout.num_chunks:]:
            tracker.add_tensor(t)
        tracker.reset_peaks()
        self._written: set[str] = set()
        lowered = self._lowered_for(sched)       # None: the warm-up step (per-node memory) or backend eager
        runner = _Runner(self, sched.gm, tracker, measure=not sched.measured) if lowered is None else None
        first_bwd_time: list[float] = []
        try:
            with tracker:
                if runner is not None:
                    (loss,) = runner.run(*inputs)
                else:
                    bwd_mem = self._bwd_memory_nodes(sched.gm)

                    def run_memory(n: fx.Node, args: tuple) -> None:
                        if not first_bwd_time and n in bwd_mem:
                            first_bwd_time.append(time.perf_counter())
                        with tracker.paused():
                            self._run_memory_node(get(n, "mem"), args)
                        tracker.sample_now()
                    def count(values) -> None:   # compiled code allocates outside Python dispatch
                        for v in values:
                            if isinstance(v, torch.Tensor):
                                tracker.add_tensor(v)
                    (loss,) = lowered.run(inputs, run_memory, count)
            self._queue.flush()
        except BaseException:
            self._queue.flush()
            self._in_flight.clear()
            self._recover()
            raise
        moved = (self.link.traffic.h2d_bytes, self.link.traffic.d2h_bytes)
        if moved != (sched.plan.h2d_bytes, sched.plan.d2h_bytes):
            raise RuntimeError(f"executor: moved h2d/d2h {moved} bytes, the schedule planned "
                               f"{(sched.plan.h2d_bytes, sched.plan.d2h_bytes)}")
        t_graph = time.perf_counter()
        loss_value = float(loss.detach().float())
        with tracker:
            skipped = self._optimizer_step(self._written, scale, tracker)
        t_end = time.perf_counter()
        traffic = self.link.reset()
        if not sched.measured:
            self._remeasure(batch, sched, runner.samples)
        t_bwd = (runner.first_bwd_time if runner is not None else (first_bwd_time or [None])[0]) or t_graph
        self.stats = StepStats(
            loss=loss_value, h2d_bytes=traffic.h2d_bytes, d2h_bytes=traffic.d2h_bytes,
            disk_read_bytes=0, disk_write_bytes=0, peak_device_bytes=tracker.peak_total,
            peak_device_model_bytes=tracker.peak_model, peak_nonmodel_bytes=tracker.peak_nonmodel,
            num_fetches=traffic.num_fetches, num_evictions=traffic.num_evictions, allgather_bytes=0,
            reduce_scatter_bytes=0, skipped=skipped, loss_scale=scale, time_s=t_end - t_start,
            forward_s=t_bwd - t_start, backward_s=t_graph - t_bwd, optimizer_s=t_end - t_graph,
            transfer_s=traffic.transfer_s)
        self.last_plan = sched.plan
        return loss_value

    def _lowered_for(self, sched: Scheduled) -> LoweredGraph | None:
        """The Inductor lowering of a measured schedule (compiled once per schedule; regions are
        shared through the engine's RegionCache, so re-planned schedules reuse them)."""
        if self.config.backend != "inductor" or not sched.measured:
            return None
        lowered = self._lowered.get(id(sched.gm))
        if lowered is None or lowered.gm is not sched.gm:
            lowered = LoweredGraph(sched.gm, backend="inductor", cache=self._region_cache)
            self._lowered[id(sched.gm)] = lowered
        return lowered

    @staticmethod
    def _bwd_memory_nodes(gm: fx.GraphModule) -> frozenset:
        """Memory nodes after the first backward node (the forward/backward time split)."""
        out, bwd = set(), False
        for n in gm.graph.nodes:
            bwd = bwd or get(n, "phase") == "bwd"
            if bwd and is_memory_node(n):
                out.add(n)
        return frozenset(out)

    def _remeasure(self, batch: Any, sched: Scheduled, samples: dict[int, int]) -> None:
        """Replace the static non-model estimate by the measured one and plan again."""
        nodes = list(sched.captured.gm.graph.nodes)
        measured = tuple(samples.get(i, 0) for i in range(len(nodes)))
        uses = annotate_params(sched.captured)
        os_now = sum(t is Tier.DEVICE for t in self.store.os_tier)
        self._place_optimizer_states(max(measured))
        if sum(t is Tier.DEVICE for t in self.store.os_tier) > os_now:
            self.store.place_optimizer_states(range(os_now))   # never grow the device share here
        self._lowered.pop(id(sched.gm), None)
        self._schedules[signature(batch)] = new = self._plan(sched.captured, uses, measured, measured=True,
                                                             timings=sched.passes[:3])
        self._lowered_for(new)                   # compile the regions now, not inside the next step

    def _recover(self) -> None:
        """After a failed graph run: undo stored gradients, put slots back to the plan's start."""
        touched = {c for f in self._written for c in self.layout.entry(f).chunks}
        for k, c in list(self._slot_chunk.items()):
            if self.store.os_tier[c] is not Tier.DEVICE:
                self.store.detach(c)
                del self._slot_chunk[k]
        for c in sorted(touched):
            self.store.restore_from_master(c)
        self.link.reset()

    def _buffer(self, fqn: str) -> torch.Tensor:
        return self.model.get_buffer(fqn)

    @property
    def min_device_memory(self) -> int:
        """The smallest budget the current schedules fit in: at every node, the chunks it reads
        plus the larger of its and the next node's non-model bytes (optimizer states on the host)."""
        best = 0
        slot = self.store.param_chunk_bytes
        for sched in self._schedules.values():
            nodes = list(sched.captured.gm.graph.nodes)
            n = sched.nonmodel
            for i, node in enumerate(nodes):
                chunks = {c for f in get(node, "reads", ()) for c in self.layout.entry(f).chunks}
                need = len(chunks) * slot + max(n[i], n[i + 1] if i + 1 < len(n) else 0)
                best = max(best, need)
        return best

    @property
    def schedule(self) -> Schedule:
        """The schedule of the most recent batch shape: ``print`` it, ``.table()``, ``.save(folder)``."""
        sched = next(reversed(self._schedules.values()))
        return Schedule(sched, layout=self.layout, budget=self.budget, slot_bytes=self.store.param_chunk_bytes,
                        os_device_bytes=self.store.dev_os_pool.bytes_in_use, dtype=self.dtype,
                        model=model_summary(self.model))


def _describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    where = ""
    if stack:
        where = ", " + list(stack.values())[-1][0]
    return f"node {node.name} ({node.target}{where})"
