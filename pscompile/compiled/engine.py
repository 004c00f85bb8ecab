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

from pscompile.runtime.batching import LossFn, micro_batches, signature, to_device
from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.config import AdamW, Config
from pscompile.runtime.engine import ChunkEngine
from pscompile.graph.meta import get, put
from pscompile.compiled.executor import LoweredGraph, RegionCache
from pscompile.graph.ops import is_memory_node
from pscompile.passes.annotate_params import annotate_params
from pscompile.passes.estimate_nonmodel import estimate_nonmodel
from pscompile.passes.insert_memory_ops import insert_memory_ops
from pscompile.passes.plan_residency import GradStore, ResidencyError, ResidencyPlan, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from pscompile.passes.verify_schedule import verify_schedule
from pscompile.compiled.schedule import Schedule, model_summary
from pscompile.stats import StepStats
from pscompile.memory.tiers import Tier, TransferQueue
from pscompile.memory.tracker import NonModelTracker
from pscompile.units import format_bytes

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
    kind: str = "train"                # "train" | "accum" (a micro-batch of accumulation) | "eval"
    os_device: frozenset[int] = frozenset()   # chunks whose optimizer states were on the device


class _Runner(fx.Interpreter):
    """Runs a scheduled graph: memory nodes through the engine, compute nodes eagerly."""

    def __init__(self, engine: "CompiledEngine", gm: fx.GraphModule, tracker: NonModelTracker, *,
                 measure: bool):
        super().__init__(gm, garbage_collect_values=True)
        for n in gm.graph.nodes:          # a value nobody reads dies at once (fx keeps it to the end),
            if not n.users and n.op not in ("output", "placeholder"):   # as estimate_nonmodel assumes
                self.user_to_last_uses.setdefault(n, []).append(n)
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
        if not self.measure or get(n, "param") is not None:   # parameter views allocate nothing (and are
            return super().run_node(n)                         # rebuilt far from their captured place)
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
        self._captures: dict[tuple, _Captured] = {}   # (backward, training, signature) -> capture + analyses
        self._measured: dict[tuple, tuple[int, ...]] = {}   # same key -> measured non-model curve
        self._schedules: dict[tuple, Scheduled] = {}  # (kind, training, signature) -> schedule
        self._warm: dict[tuple, Scheduled] = {}       # same key -> its warm variant (accum, eval)
        self._last_key: tuple | None = None
        self._slots: list[torch.Tensor] = []
        self._slot_chunk: dict[int, int] = {}      # slot index -> chunk held now
        self._os_placed = False
        self._queue = TransferQueue(self.link)     # the copy engine: transfers overlap compute
        self._in_flight: dict[int, Any] = {}       # slot -> future of its asynchronous fetch
        self._region_cache = RegionCache()         # compiled regions, shared by every schedule
        self._lowered: dict[int, LoweredGraph] = {}   # id(scheduled gm) -> its lowering
        self.eval_peak_device_bytes: int | None = None   # of the last evaluate()
        self.eval_bytes_moved: int | None = None
        try:
            self._schedule_for(to_device(batch, self.device), "train")
        except BaseException:
            self.close()
            raise

    # ================================================================ planning
    def _keys(self, batch: Any, kind: str) -> tuple[tuple, tuple]:
        """(schedule key, capture key). Train and accumulation schedules share one joint capture;
        evaluation has a forward-only capture. The model's train()/eval() mode is part of both
        (dropout is captured as it is)."""
        sig = (self.model.training,) + signature(batch)
        return (kind,) + sig, (kind != "eval",) + sig

    @staticmethod
    def _capture_key(key: tuple) -> tuple:
        """The capture key of a schedule key (see ``_keys``)."""
        return (key[0] != "eval",) + key[1:]

    def _schedule_for(self, batch: Any, kind: str) -> Scheduled:
        """The schedule of ``batch`` for ``kind`` ("train", "accum": a micro-batch of gradient
        accumulation, "eval": forward only); captured and planned on first use."""
        key, cap_key = self._keys(batch, kind)
        sched = self._schedules.get(key)
        if sched is not None:
            return sched
        cap = self._captures.get(cap_key)
        if cap is None:
            cap = self._capture(batch, backward=kind != "eval")
            self._captures[cap_key] = cap
        measured = self._measured.get(cap_key)
        nonmodel = measured if measured is not None else cap.nonmodel
        self._fit_optimizer_states(max(nonmodel))
        sched = self._plan(cap, nonmodel, kind=kind, measured=measured is not None)
        self._schedules[key] = sched
        return sched

    def _capture(self, batch: Any, *, backward: bool) -> "_Captured":
        t0 = time.perf_counter()
        captured = capture_joint(self.model, batch, params=self.params, loss_fn=self.loss_fn,
                                 param_dtype=self.dtype, backward=backward)
        t1 = time.perf_counter()
        uses = annotate_params(captured)
        t2 = time.perf_counter()
        curve = estimate_nonmodel(captured, uses, grads_stored_at=self._grad_store_points(captured, uses))
        t3 = time.perf_counter()
        timings = (PassTiming("capture_joint" if backward else "capture_forward", t1 - t0, captured.summary),
                   PassTiming("annotate_params", t2 - t1, uses.summary),
                   PassTiming("estimate_nonmodel", t3 - t2, curve.summary))
        return _Captured(captured, uses, tuple(curve.without_outputs), timings)   # grads die at store_grad

    def _fit_optimizer_states(self, peak_nonmodel: int) -> None:
        """Device-aware optimizer-state placement for the largest non-model peak of every
        schedule (and ``peak_nonmodel``, a schedule about to be planned). The first placement
        decides; later ones only move states off the device (a measurement, or a new batch shape,
        that leaves less margin), and schedules planned for the old placement are planned again."""
        peak = max([peak_nonmodel] + [max(s.nonmodel) for s in self._schedules.values()])
        n = self.layout.num_chunks
        if self.budget is None:
            count = n
        else:
            temp = _OPT_TEMP_BYTES_PER_ELEMENT * self.layout.chunk_size
            margin = self.budget - max(peak, temp) - n * self.store.param_chunk_bytes
            count = max(0, min(n, margin // self.store.os_chunk_bytes))
        now = sum(t is Tier.DEVICE for t in self.store.os_tier)
        if self._os_placed and count >= now:
            return
        on_device = set(range(count))
        for k, c in list(self._slot_chunk.items()):     # states leaving the device: params go home
            if c not in on_device:
                if self.store.dirty[c]:
                    self.store.host_param[c].copy_(self._slots[k])
                self.store.detach(c)
                del self._slot_chunk[k]
        self.store.place_optimizer_states(on_device)
        self.link.reset()
        self._os_placed = True
        for key, s in list(self._schedules.items()):    # planned for the old placement
            self._replan(key, s.nonmodel, measured=s.measured)

    def _os_device_chunks(self) -> frozenset[int]:
        return frozenset(c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE)

    def _replan(self, key: tuple, nonmodel: tuple[int, ...], *, measured: bool) -> Scheduled:
        old = self._schedules[key]
        self._lowered.pop(id(old.gm), None)
        warm = self._warm.pop(key, None)
        if warm is not None:
            self._lowered.pop(id(warm.gm), None)
        cap = self._captures[self._capture_key(key)]
        self._schedules[key] = new = self._plan(cap, nonmodel, kind=old.kind, measured=measured)
        return new

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

    def _plan(self, cap: "_Captured", nonmodel: tuple[int, ...], *, kind: str, measured: bool,
              start: dict[int, int] | None = None) -> Scheduled:
        """Plan one schedule. Accumulation and evaluation runs update nothing, so they keep clean
        chunks resident at the end for the next run; ``start`` (chunk -> slot) plans the warm
        variant, which starts from that residency and ends with it again."""
        captured, uses = cap.captured, cap.uses
        warm_capable = kind in ("accum", "eval")
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
        os_dev = self._os_device_chunks()
        os_bytes = self.store.dev_os_pool.bytes_in_use
        t0 = time.perf_counter()
        try:
            plan = plan_residency(reads, nonmodel, stores=stores, num_chunks=self.layout.num_chunks,
                                  slot_bytes=self.store.param_chunk_bytes, budget=self.budget,
                                  os_device_chunks=os_dev, os_device_bytes=os_bytes,
                                  accumulate=kind == "accum", start=start, keep_at_end=warm_capable,
                                  end=start, describe_node=lambda i: _describe(nodes[i]))
        except ResidencyError as e:
            from pscompile.hooks.engine import BudgetError
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
                                 initial=dict(plan.initial), os_device_chunks=os_dev, os_device_bytes=os_bytes,
                                 final=dict(plan.final) if warm_capable else None)
        t3 = time.perf_counter()
        timings = cap.timings + (PassTiming("plan_residency", t1 - t0, plan.summary(self.budget)),
                                 PassTiming("prefetch_fetches", t1b - t1, prefetch.summary),
                                 PassTiming("insert_memory_ops", t2 - t1b,
                                            f"insert_memory_ops: {report.num_memory_nodes} memory nodes"),
                                 PassTiming("verify_schedule", t3 - t2, report.summary(self.budget)))
        self._ensure_slots(plan)
        return Scheduled(captured, plan, gm, nonmodel, measured, timings, kind, os_dev)

    def _ensure_slots(self, plan: ResidencyPlan) -> None:
        cs = self.layout.chunk_size
        while len(self._slots) < plan.num_slots:
            self._slots.append(torch.empty(cs, dtype=self.dtype, device=self.device))
        self._slot_ptrs = {s.untyped_storage().data_ptr() for s in self._slots}
        for c, k in plan.initial:                  # device-updated chunks live in fixed slots
            if self.store.os_tier[c] is not Tier.DEVICE:
                continue                           # a warm start: the previous run left it there
            if self._slot_chunk.get(k) != c:
                self._slots[k].copy_(self.store.host_param[c])
                self.store.attach(c, self._slots[k])
                self._slot_chunk[k] = c
        self.link.reset()

    def _runnable(self, batch: Any, kind: str) -> Scheduled:
        """The schedule to run now: the warm variant when the chunks resident now are the ones it
        starts from (the previous run of this loop left them), else the cold one, after dropping
        leftover chunks (clean: no bytes move)."""
        cold = self._schedule_for(batch, kind)
        key = self._keys(batch, kind)[0]
        warm = self._warm.get(key)
        if warm is None and cold.measured and len(cold.plan.final) > len(cold.os_device):
            cap = self._captures[self._capture_key(key)]
            warm = self._warm[key] = self._plan(cap, cold.nonmodel, kind=kind, measured=True,
                                                start=dict(cold.plan.final))
        if warm is not None and self._residency() == dict(warm.plan.initial):
            return warm
        self._settle()
        return cold

    def _residency(self) -> dict[int, int]:
        """chunk -> slot of the chunks on the device now."""
        for k, c in list(self._slot_chunk.items()):
            if not self.store.resident(c):             # dropped behind our back (load_state_dict)
                del self._slot_chunk[k]
        return {c: k for k, c in self._slot_chunk.items()}

    def _settle(self) -> None:
        """Back to the start of a cold run: only chunks whose optimizer states live on the device
        stay. The others are clean here (warm runs update nothing), so they are dropped, not copied."""
        for c, k in self._residency().items():
            if self.store.os_tier[c] is not Tier.DEVICE:
                assert not self.store.dirty[c], f"chunk {c} left dirty on the device by a warm run"
                self.store.detach(c)
                del self._slot_chunk[k]

    # ================================================================ running
    def _run_memory_node(self, mem, args) -> None:
        """Perform one memory node. Copies go to the transfer queue (in order); only a fetch with
        a ``wait`` returns before its copy is done: everything else is waited for at once, except
        writebacks and host-side gradient stores, which nothing reads before the queue drains.
        An accumulate_grad waits for its copy, so the gradient dies where the plan says."""
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
        elif mem.kind == "accumulate_grad":
            acc, grad, offset = args
            target = acc[offset:offset + grad.numel()].view(grad.shape)
            host = torch.empty(grad.shape, dtype=grad.dtype)            # the gradient crosses the link
            q.submit(host, grad, "d2h").result()
            target.add_(host)                                           # fp32 += compute dtype, on the host
            self._written.add(mem.fqn)
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

    def _run_graph(self, sched: Scheduled, batch: Any, acc: list[torch.Tensor] | None) -> "_GraphRun":
        """Run one scheduled graph (memory nodes as planned) and check the bytes it moved against
        the plan. On failure, stored gradients are undone and slots reset to the plan's start."""
        t_start = time.perf_counter()
        self.link.reset()
        tracker = NonModelTracker(self.device, self._is_model_storage, self._model_bytes,
                                  exact_windows=not sched.measured)
        accs = acc if any(a.kind == "accumulate_grad" for a in sched.plan.actions) else []
        model_inputs = [*self._slots[:sched.plan.num_slots], *self.store.host_param, *accs]
        rest = [*[self._buffer(f) for f in sched.captured.buffer_fqns], *sched.captured.flatten_batch(batch)]
        for t in rest:
            tracker.add_tensor(t)
        tracker.reset_peaks()
        inputs = model_inputs + rest
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
            self._recover(restore=acc is None)
            raise
        traffic = self.link.reset()
        moved = (traffic.h2d_bytes, traffic.d2h_bytes)
        if moved != (sched.plan.h2d_bytes, sched.plan.d2h_bytes):
            self._recover(restore=acc is None)
            raise RuntimeError(f"executor: moved h2d/d2h {moved} bytes, the schedule planned "
                               f"{(sched.plan.h2d_bytes, sched.plan.d2h_bytes)}")
        t_end = time.perf_counter()
        t_bwd = (runner.first_bwd_time if runner is not None else (first_bwd_time or [None])[0]) or t_end
        return _GraphRun(loss.detach(), tracker, traffic, t_bwd - t_start, t_end - t_bwd,
                         runner.samples if runner is not None and runner.measure else None)

    def step(self, batch: Any) -> float:
        """Run the scheduled graph, then the chunk-wise optimizer; returns the loss.

        ``batch`` may be a list of micro-batches (tuples or dicts): each runs its accumulation
        schedule, whose gradients are added into fp32 chunks on the host, then one update follows
        with the mean gradient (like ``(loss / k).backward()`` per micro-batch in plain PyTorch);
        the mean loss is returned."""
        self._check_open()
        t_start = time.perf_counter()
        micro = micro_batches(batch)
        batches = [to_device(b, self.device) for b in (micro if micro is not None else [batch])]
        acc = self._accumulation_chunks() if micro is not None else None
        kind = "train" if micro is None else "accum"
        k = len(batches)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        runs: list[_GraphRun] = []
        measured: dict[tuple, tuple[Any, Scheduled, dict[int, int]]] = {}
        written: set[str] = set()
        try:
            for b in batches:
                sched = self._runnable(b, kind)
                run = self._run_graph(sched, b, acc)
                runs.append(run)
                written |= self._written
                if run.samples is not None:
                    measured.setdefault(self._keys(b, kind)[0], (b, sched, run.samples))
            t_graph = time.perf_counter()
            self._settle()               # accumulation left clean chunks resident; updates need them home
            losses = [float(r.loss.float()) for r in runs]
            tracker = runs[-1].tracker
            with tracker:
                skipped = self._optimizer_step(written, scale * k, tracker, grads=acc)
        finally:
            if acc is not None:
                for a in acc:
                    a.zero_()
        t_end = time.perf_counter()
        opt_traffic = self.link.reset()
        for key, (b, sched, samples) in measured.items():
            self._remeasure(key, sched, samples)
        self.last_plan = sched.plan
        self._last_key = self._keys(batches[-1], kind)[0]
        self.stats = StepStats(
            loss=sum(losses) / k,
            h2d_bytes=sum(r.traffic.h2d_bytes for r in runs) + opt_traffic.h2d_bytes,
            d2h_bytes=sum(r.traffic.d2h_bytes for r in runs) + opt_traffic.d2h_bytes,
            disk_read_bytes=0, disk_write_bytes=0,
            peak_device_bytes=max(r.tracker.peak_total for r in runs),
            peak_device_model_bytes=max(r.tracker.peak_model for r in runs),
            peak_nonmodel_bytes=max(r.tracker.peak_nonmodel for r in runs),
            num_fetches=sum(r.traffic.num_fetches for r in runs) + opt_traffic.num_fetches,
            num_evictions=sum(r.traffic.num_evictions for r in runs) + opt_traffic.num_evictions,
            allgather_bytes=0, reduce_scatter_bytes=0, skipped=skipped, loss_scale=scale,
            time_s=t_end - t_start, forward_s=sum(r.forward_s for r in runs),
            backward_s=sum(r.backward_s for r in runs), optimizer_s=t_end - t_graph,
            transfer_s=sum(r.traffic.transfer_s for r in runs) + opt_traffic.transfer_s)
        return self.stats.loss

    def evaluate(self, batch: Any) -> float:
        """The loss of ``batch`` from a forward pass only: no gradients, no update. It runs its own
        forward-only schedule (captured, planned, measured and lowered like a training step's, under
        the same budget). Like plain PyTorch, dropout follows the model's train()/eval() mode."""
        self._check_open()
        batch = to_device(batch, self.device)
        sched = self._runnable(batch, "eval")
        with torch.no_grad():
            run = self._run_graph(sched, batch, None)
        value = float(run.loss.float())
        if run.samples is not None:
            self._remeasure(self._keys(batch, "eval")[0], sched, run.samples)
        self.eval_peak_device_bytes = run.tracker.peak_total
        self.eval_bytes_moved = run.traffic.h2d_bytes + run.traffic.d2h_bytes
        self.eval_plan = sched.plan
        return value

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

    def _remeasure(self, key: tuple, sched: Scheduled, samples: dict[int, int]) -> None:
        """Replace the static non-model estimate by the measured one and plan again (every
        schedule of the same capture: train and accumulation share it)."""
        cap_key = self._capture_key(key)
        static = self._captures[cap_key].nonmodel     # kept where nothing runs: placeholders, output,
        measured = tuple(samples.get(i, est) for i, est in enumerate(static))   # parameter views
        self._measured[cap_key] = measured
        self._fit_optimizer_states(max(measured))     # first: the new curve may leave less margin
        for other, s in list(self._schedules.items()):
            if self._capture_key(other) == cap_key:
                self._replan(other, measured, measured=True)
        self._lowered_for(self._schedules[key])   # compile the regions now, not inside the next step

    def _recover(self, *, restore: bool = True) -> None:
        """After a failed graph run: undo stored gradients (``restore``; accumulation leaves the
        parameters intact), put slots back to the plan's start."""
        touched = {c for f in self._written for c in self.layout.entry(f).chunks} if restore else set()
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
        """The training schedule most recently run by ``step`` (else the latest one planned):
        ``print`` it, ``.table()``, ``.save(folder)``. ``schedule_of(batch, kind)`` gives any other,
        e.g. the evaluation schedule."""
        key = self._last_key if self._last_key in self._schedules else next(reversed(self._schedules))
        return self._as_schedule(self._schedules[key])

    def schedule_of(self, batch: Any, kind: str = "train") -> Schedule:
        """The schedule for ``batch``: kind "train", "accum" (one micro-batch of gradient
        accumulation) or "eval" (forward only); planned now if it does not exist yet."""
        if kind not in ("train", "accum", "eval"):
            raise ValueError(f"kind={kind!r}; use 'train', 'accum' or 'eval'")
        return self._as_schedule(self._schedule_for(to_device(batch, self.device), kind))

    def _as_schedule(self, sched: Scheduled) -> Schedule:
        return Schedule(sched, layout=self.layout, budget=self.budget, slot_bytes=self.store.param_chunk_bytes,
                        os_device_bytes=self.store.dev_os_pool.bytes_in_use, dtype=self.dtype,
                        model=model_summary(self.model))


@dataclass(frozen=True)
class _Captured:
    """A captured graph with the analyses every schedule of it starts from."""

    captured: CapturedGraph
    uses: Any                           # annotate_params' ParamUses
    nonmodel: tuple[int, ...]           # static estimate, gradients dying at their store points
    timings: tuple[PassTiming, ...]


@dataclass(frozen=True)
class _GraphRun:
    loss: torch.Tensor
    tracker: NonModelTracker
    traffic: Any                        # tiers.Traffic of the graph run
    forward_s: float
    backward_s: float
    samples: dict[int, int] | None      # measured non-model bytes per captured node (warm-up run)


def _describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    where = ""
    if stack:
        where = ", " + list(stack.values())[-1][0]
    return f"node {node.name} ({node.target}{where})"
