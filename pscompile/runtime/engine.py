"""ChunkEngine: what every pscompile execution mode shares.

Parameters named and ordered (first use), packed into a ``ChunkLayout``, loaded into a ``ChunkStore`` (fp32 masters,
compute-dtype chunks, Adam states); the model keeps placeholders. The one ``step()`` loop (micro-batching, gradient
accumulation, the update, ``StepStats``), ``close`` and the learning rate live here; the optimizer step in
``runtime/update.py``, state dicts and export in ``runtime/state.py``. A mode (hooks, compiled) supplies how one forward+backward reaches the chunks::

    _prepare_step(batches)          before any run: plan what the batches need (hooks: trace)
    _run_micro(batch, ...)          one forward+backward -> MicroRun; on failure undo and raise
    _grad_divisor(scale, k)         what the summed gradients are divided by in the update
    _update(last, written, ...)     the optimizer step, after the mode's own preparation
    _after_step(runs)               bookkeeping once the step is done (compiled: re-measure)
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pscompile.config import AdamW, Config
from pscompile.dist.comm import resolve_comm
from pscompile.dist.store import OwnedChunkStore, ShardedStore
from pscompile.memory.disk import DiskQueue, SlotFile
from pscompile.memory.disk_homes import DiskAccumulation, zero_accumulation
from pscompile.memory.store import ChunkStore
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.copy_engines import make_copy_engine
from pscompile.memory.tiers import Link, Traffic
from pscompile.memory.tracker import NonModelTracker, warm_device_libraries
from pscompile.optim.adamw import ChunkAdamW, LossScaler
from pscompile.optim.host_kernel import HostKernels
from pscompile.runtime.early_update import EarlyUpdates
from pscompile.optim.groups import resolve_groups
from pscompile.runtime.groups import GroupControl
from pscompile.runtime.model_access import ModelAccess
from pscompile.profiling import Profiled
from pscompile.resolved import resolve
from pscompile.optim.lock_free import LockFreeUpdater
from pscompile.runtime.batching import (LossFn, as_batch, call_model, micro_batches, check_ranks_agree, structure,
                                        check_form, to_device)
from pscompile.runtime import bnb4bit
from pscompile.runtime.materialize import check_meta, materialize_module
from pscompile.runtime.notices import SetupNotices
from pscompile.runtime.rng import rng_state, set_rng_state
from pscompile.runtime.checkpoint_state import CheckpointState
from pscompile.runtime.state import EngineState
from pscompile.runtime.tiers import HostTiers
from pscompile.runtime.update import ChunkUpdate
from pscompile.runtime.params import ModelParams, check_frozen, choose_layout, collect_params
from pscompile.stats import StepStats
from pscompile.units import format_bytes
from pscompile.errors import closed_message
from pscompile.kinds import Collectives


@dataclass(frozen=True)
class MicroRun:
    """What one forward+backward (a batch, or one micro-batch of accumulation) did."""

    loss: float
    tracker: NonModelTracker       # its device-memory accounting (the update runs in the last one's)
    traffic: Traffic               # bytes and copies of this run
    forward_s: float
    backward_s: float
    written: frozenset[str]        # parameters whose gradients it produced
    context: Any = None            # the mode's own record (hooks: the pass; compiled: the schedule)
    ops: tuple[int, int] = (0, 0)  # compute operators run, and those inside compiled code (compiled mode)


class ChunkEngine(ChunkUpdate, EngineState, CheckpointState, HostTiers, GroupControl, ModelAccess, Profiled):
    def __init__(self, model: nn.Module, batch: Any, *, optimizer: AdamW, config: Config,
                 loss_fn: LossFn | None = None):
        self.config = config = resolve(config)       # (the record this engine runs by)
        self.hp = optimizer
        self.model = model
        self.loss_fn = loss_fn
        self.device = config.torch_device
        self.dtype = config.dtype
        self.budget: int | None = config.device_memory
        if self.budget is None and self.device.type == "cuda":
            self.budget = int(torch.cuda.mem_get_info(self.device)[0] * 0.9)     # (free bytes)
        warm_device_libraries(self.device, self.dtype)     # (CUDA: library workspaces made before any measurement)
        batch = to_device(as_batch(batch, "compile"), self.device)
        micro = micro_batches(batch)
        self.batch_structure = structure(batch if micro is None else micro[0])   # every step's batch has it
        # ZeRO: the ranks this engine shards its chunks over (None: one process, or opted out)
        self.comm = resolve_comm(config.process_group, bandwidth=config.link_bandwidth)
        self.world = self.comm.world if self.comm is not None else 1
        self.rank = self.comm.rank if self.comm is not None else 0
        self.per_chunk = self.comm is not None and config.collectives == Collectives.PER_CHUNK
        if self.comm is not None and self.budget is not None:
            # every rank plans with the smallest rank's budget: their gathers and releases must match
            self.budget = -self.comm.agree_max([-self.budget])[0]
        if config.lock_free and self.comm is not None:
            raise ValueError(f"lock_free=True is not supported under ZeRO yet ({self.world} ranks): every rank's "
                             "update would need its collectives ordered against the next step's; use "
                             "lock_free=False, or process_group=False to train one process")
        self.materialized = check_meta(model)      # (materialized module by module as the chunks fill)
        # optimizer states may move to the device only where the update can run there: not under
        # ZeRO (updates run on the host shards), not with lock-free updating (a host thread runs them)
        self.states_on_host_only = self.comm is not None or config.lock_free

        # -- parameters, names, first-use order, layout -------------------------------------
        mp = collect_params(model, self._run_model, batch)
        self.params: dict[str, nn.Parameter] = mp.params
        self.order_source = mp.order_source
        self._fqn_of: dict[int, str] = mp.fqn_of()
        self.groups = resolve_groups(optimizer, self.params, mp.aliases)
        self.layout = self._choose_layout(mp, batch if micro is None else micro[0])

        # -- host and disk tiers, copies, the chunk store -------------------------------------
        self._place_host_tiers(config)
        self._make_store(config)
        self._init_model_access()
        with torch.no_grad():
            self._load_into_chunks()
        self._make_update(config)
        self._make_optimizer()             # engine.optimizer: the groups for torch's LR schedulers
        self.scaler = LossScaler(config.initial_loss_scale, config.loss_scale_growth_interval) if self.dtype == torch.float16 else None
        self._move_buffers()
        self._acc: list[torch.Tensor] | None = None     # gradient accumulation chunks (fp32, host)
        self.stats = None
        self.eval_peak_device_bytes: int | None = None   # of the last evaluate()
        self.eval_bytes_moved: int | None = None
        self.closed = False
        self._go_on()                      # (a failure inside the update stops it: ``_stop``)
        # queue the next disk chunk's reads before this one's update, and read the disk homes ahead
        # of their fetches (False: read each when it is needed; bench/disk.py compares the two)
        self.disk_prefetch = True
        # lock-free updating: the update thread and the gradient buffer sets it reads
        self.updater = (LockFreeUpdater(staleness=config.staleness, run=self._run_update_job,
                                        publish=self._publish_update,
                                        sets=[[torch.zeros(self.store.home_numel if self.store.state_numel(c) else 0)
                                               for c in range(self.layout.num_chunks)]
                                              for _ in range(config.staleness + 1)])
                        if config.lock_free else None)
        if self.updater is not None:      # (its gradient buffer sets are host model data)
            self.store.host_meter.add(sum(b.numel() * 4 for s in self.updater.sets for b in s))
        self._init_update_state(config.lock_free)
        self._fresh_acc = False      # the gradient buffers are zero: the run copies into them, not adds
        self.notices = SetupNotices()      # a slow first step of a batch shape is said (pscompile/runtime/notices.py)
        self.steps_run = 0           # successful steps (lock-free jobs are numbered by them)
        self._lock, self._busy = threading.Lock(), ""   # one call at a time (``exclusive``)

    def _make_store(self, config: Config) -> None:
        """The link, the copy engine and the chunk store (one process, or a ZeRO store)."""
        self.link = Link(config.link_bandwidth)   # every copy goes through self.copies (docs/design.md, "The copy contract")
        self.copies = make_copy_engine(self.link, self.device, strict=config.strict_copies, pinned=config.pinned_host)
        # bytes moved outside the steps (placing optimizer states, filling slots, the hooks trace,
        # undoing a failed step, state dicts): every byte between tiers is counted somewhere
        self.setup_traffic = Traffic()
        # (parameters on disk: one more slot per chunk for its gradient accumulation buffer)
        acc_slots = self.layout.num_chunks if self.param_disk_chunks else 0
        disk = (DiskQueue(SlotFile(config.disk_dir, num_slots=3 * len(self.disk_chunks) + len(self.param_disk_chunks)
                                   + acc_slots, slot_bytes=4 * self.home_numel)) if self.disk_chunks else None)
        # (ZeRO: this rank's own file, and homes on its device for the shards its host cannot hold)
        tiers = dict(os_on_disk=self.disk_chunks, disk=disk, os_on_device=self.device_homes)
        self.store = (ChunkStore(self.layout, device=self.device, dtype=self.dtype, link=self.link,
                                 os_on_device=self.device_homes, os_on_disk=self.disk_chunks,
                                 disk=disk, params_on_disk=self.param_disk_chunks, acc_on_disk=bool(acc_slots),
                                 master_is_param=self.dtype == torch.float32 and not config.lock_free,
                                 copies=self.copies)
                      if self.comm is None else
                      OwnedChunkStore(self.layout, device=self.device, dtype=self.dtype, link=self.link, comm=self.comm,
                                      copies=self.copies, **tiers)
                      if self.per_chunk else
                      ShardedStore(self.layout, device=self.device, dtype=self.dtype, link=self.link, comm=self.comm,
                                   copies=self.copies, **tiers))
        # ZeRO: every rank plans its moves around the largest device-homes footprint of any rank
        # (ranks own different chunks), so all ranks make the same gathers and releases
        self._agree_home_bytes()
        # the copy threads, the disk tier's I/O thread and file: released by close(), or when the
        # engine is garbage-collected without it
        self._release = weakref.finalize(self, _release_resources, self.copies, self.store.param_disk, self.store.disk)

    def _make_update(self, config: Config) -> None:
        """The AdamW of the chunks, with its host kernels, and the chunk updates that start in the
        backward (compiled mode's ``update`` nodes) on a host thread: its pool lets the thread go
        when the engine is collected; ``close`` joins it."""
        self.adam = ChunkAdamW(list(self.groups.hps),
                               kernels=HostKernels(config.optimizer_kernel, config.optimizer_threads))
        self.early = EarlyUpdates(self.adam, self.store, update=self._early_update)
        self._clipped_last, self._norm = False, None   # the last step was clipped (no guess this step); its norm

    def _count_outside_steps(self) -> None:
        """Finish the disk tier's transfers (written back, staging buffers returned; not while a
        lock-free update job, which settles its own, uses the disk tier) and move what the link
        counted since the last reset into ``setup_traffic``."""
        updater = getattr(self, "updater", None)     # (set late in __init__)
        if updater is None or not updater.running:
            self.store.settle_disk()
        self.setup_traffic.add(self.link.reset())

    def _accumulation_chunks(self) -> list[torch.Tensor]:
        """fp32 host chunks for gradient accumulation (allocated on first use, 4 B/param)."""
        if self.store.acc_disk is not None:         # (parameters on disk: so are these, staged as used)
            return DiskAccumulation(self.store.acc_disk, self.layout.num_chunks)
        if self._acc is None:
            self._acc = [torch.zeros(self.store.home_numel if self.store.state_numel(c) else 0, dtype=torch.float32)
                         for c in range(self.layout.num_chunks)]
            self.store.host_meter.add(sum(a.numel() * 4 for a in self._acc))
        return self._acc

    def _choose_layout(self, mp: ModelParams, batch: Any) -> ChunkLayout:
        """The chunk layout (``runtime.params.choose_layout``); compiled mode weighs candidates."""
        return choose_layout(mp, self.config, self.budget, world=1 if self.per_chunk else self.world, host_staging=True)

    def _run_model(self, model: nn.Module, batch: Any) -> Any:
        return call_model(model, batch)

    def _load_into_chunks(self) -> None:
        """Each module's parameter values into the chunks, its own copies freed (meta: materialized first)."""
        loaded: set[str] = set()
        init_weights = getattr(self.model, "_init_weights", None)     # (the model's own initialisation)
        for mod in self.model.modules():
            packed = bnb4bit.take_packed(mod)     # (a layer loaded in 4 bits: its codes, not its meta weight)
            if not packed:
                materialize_module(mod, init_weights)
            values = {}
            for name, p in mod.named_parameters(recurse=False):
                fqn = self._fqn_of[id(p)]
                if fqn not in loaded:
                    values[fqn] = packed.get(name, p.detach())
                    loaded.add(fqn)
            if values:
                self.store.load_params(values, flush=False)
                for fqn in values:
                    self.params[fqn].data = self._released(self.params[fqn].shape)
        self.store.flush_disk()

    def _move_buffers(self) -> None:
        for mod in self.model.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                if buf.device != self.device:
                    persistent = name not in mod._non_persistent_buffers_set
                    mod.register_buffer(name, buf.to(self.device), persistent=persistent)

    def close(self) -> None:
        """Detach from the model (hooks removed) and give it its parameters back, holding the fp32
        master weights in each parameter's original dtype. The engine cannot step afterwards; the
        disk tier's file is gone. Lock-free: the queued updates are applied first. Idempotent."""
        if self.closed:
            return
        if self.updater is not None:
            try:
                self._apply_queued_updates()
            except BaseException:            # noqa: BLE001 -- closing goes on; the engine is broken
                pass
            self.updater.discard()           # (nothing left after a drain) no thread outlives close
        self.early.close()
        self._detach_from_model()
        self.closed = True
        try:
            self._give_back()
        finally:
            self._release()                  # (every copy landed: no copy or I/O thread outlives close)

    def _global_mean(self, value: float) -> float:
        """The mean of a per-rank value over the ranks (the loss, like DDP's)."""
        return value if self.comm is None else self.comm.sum(value) / self.world

    @contextlib.contextmanager
    def exclusive(self, call: str):
        """``call`` runs alone on this engine: a second thread entering step, evaluate, state_dict,
        save or load while one runs is refused (an engine's chunks, slots and copies are one run's)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{call}() while this engine's {self._busy}() runs; an engine runs one call at a "
                               "time (inside a materialize() block: after it; from another thread: from one "
                               "thread, or give each thread its own engine)")
        self._busy = call
        try:
            yield
        finally:
            self._busy = ""
            self._lock.release()

    def evaluate(self, batch: Any) -> float:
        """The loss of ``batch`` from a forward pass only: no gradients, no update, under the same
        budget (hooks mode: its own trace per batch shape; compiled mode: its own forward-only
        schedule, captured, planned, measured and lowered like a training step's). Like plain
        PyTorch, dropout follows the model's train()/eval() mode. ``eval_peak_device_bytes`` and
        ``eval_bytes_moved`` then tell what it took."""
        with self.exclusive("evaluate"):
            self._check_open()
            batch = as_batch(batch, "evaluate")
            self._check_batch(batch, None, "evaluate")
            with self.notices.around(batch, "evaluate"):
                loss, self.eval_peak_device_bytes, self.eval_bytes_moved = self._proven(
                    lambda b=to_device(batch, self.device): self._evaluate(b))
            return self._global_mean(loss)

    def _evaluate(self, batch: Any) -> tuple[float, int, int]:
        """Mode-specific: (this rank's loss, peak device bytes, bytes moved) of a forward pass."""
        raise NotImplementedError

    def describe(self) -> str:
        """A few lines on how the model was laid out and placed."""
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        return "\n".join([
            f"{self._mode_title()} on {self.device}, compute dtype {str(self.dtype).replace('torch.', '')}, "
            f"device_memory {budget}",
            f"this layout and activation plan need {self._need()} (the least budget for "
            "this model and batch, over layouts: pscompile.min_device_memory)",
            f"layout: {self.layout.describe()}; order: {self.order_source}",
            *self._describe_lines(),
        ])

    def _mode_title(self) -> str:
        raise NotImplementedError

    def _need(self) -> str:
        """What describe() says this layout and activation plan need."""
        return format_bytes(self.min_device_memory)

    def _describe_lines(self) -> list[str]:
        """Mode-specific: the lines after the layout's."""
        return [self.describe_tiers()]

    def _detach_from_model(self) -> None:
        """Mode-specific: remove whatever the mode attached to the model."""

    def _check_batch(self, batch: Any, micro: list | None, call: str = "step") -> None:
        """A ``TypeError`` naming the argument when ``batch`` (or a micro-batch) is not of the form
        compiled for, a ``ValueError`` when ZeRO's ranks' batches differ in more than sizes; before anything
        changes. ZeRO: what the ranks agreed on is ``_agreed_shapes()`` (``batching.RanksShapes``)."""
        self._agree_shapes(check_form(self.batch_structure, batch, micro, call), call)

    def _agree_shapes(self, batches: list, call: str) -> None:
        """ZeRO: the ranks' batches this call (``batching.check_ranks_agree``, a ``ValueError`` where
        they differ in more than sizes)."""
        self._agreed = check_ranks_agree(batches, self.comm, call) if self.comm is not None else None

    def _agreed_shapes(self):
        """What the ranks agreed on at the last ``_agree_shapes`` (None: one process, or none yet)."""
        return getattr(self, "_agreed", None)

    def _acc_is_zero(self) -> bool:
        """The run now adds into zero gradient buffers (lock-free, its first micro-batch): it copies
        into them instead."""
        return self._fresh_acc

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(closed_message(self._busy))
        self._refuse_if_stopped()
        check_frozen(self.layout, self.params)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ================================================================ the step
    def step(self, batch: Any) -> float:
        """Forward, backward, gradient clipping/unscaling and the AdamW update; returns the loss.

        ``batch`` may be a list of micro-batches (tuples or dicts): their gradients accumulate in
        fp32 chunks on the host, then one update follows with the mean gradient (like
        ``(loss / k).backward()`` per micro-batch in plain PyTorch); the mean loss is returned.
        A failed step leaves the weights and optimizer states as they were."""
        with self.exclusive("step"):
            batch = as_batch(batch)
            with self.notices.around(batch, "step"):
                return self._proven(lambda: self._step(batch))

    def _step(self, batch: Any) -> float:
        """``step``, run alone. (Long on purpose where it is: the one step loop both modes share.)"""
        self._check_open()
        t_start = time.perf_counter()
        if self.device.type == "cuda":        # the allocator's peak over this step, beside ours
            torch.cuda.reset_peak_memory_stats(self.device)
        micro = micro_batches(batch)
        self._check_batch(batch, micro)
        self.optimizer.step()      # the groups' values (a scheduler's) for this step's update
        batches = [to_device(b, self.device) for b in (micro if micro is not None else [batch])]
        # lock-free: every step's gradients go to a free buffer set, which its queued update reads
        acc = (self.updater.free_set() if self.updater is not None else
               self._accumulation_chunks() if micro is not None else None)
        k = len(batches)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self.store.forget_home_copies()       # (each update or undo forgets its chunk's already)
        self._prepare_step(batches, accumulate=acc is not None)
        self._count_outside_steps()
        disk0 = self._disk_bytes()
        self.store.host_meter.reset_peak()
        if self.comm is not None:
            self.comm.reset()
        runs: list[MicroRun] = []
        rng = rng_state(self.device)          # a failed step leaves the random numbers where they were
        # the factor an early update (``update`` nodes) assumes: the loss-scale inverse, no clipping
        self.early.begin(1.0 / (self._grad_divisor(scale, k) * self.world)
                         if k == 1 and acc is None and self.updater is None and not self._clipped_last else None)
        try:
            for i, b in enumerate(batches):
                self._fresh_acc = self.updater is not None and i == 0    # (lock-free buffers are zero)
                runs.append(self._run_micro(b, acc=acc, scale=scale, k=k))
            self._fresh_acc = False
            t_opt = time.perf_counter()
            written = frozenset().union(*(r.written for r in runs))
            # ZeRO reduce-scatters sum over ranks: the mean gradient divides by the world size too
            skipped = self._update(runs[-1], written, self._grad_divisor(scale, k) * self.world, acc)
        except BaseException:
            try:
                self.early.undo()             # (the modes' recovery undid any already: then a no-op)
                set_rng_state(self.device, rng)
                if self.updater is not None:
                    self._abandon_step(acc)
            finally:
                self.early.release_interrupts()
            raise
        finally:
            if acc is not None and self.updater is None:
                zero_accumulation(acc)
        self.steps_run += 1
        loss = self._global_mean(sum(r.loss for r in runs) / k)
        disk1 = self._disk_bytes()
        t_end = time.perf_counter()
        opt = self.link.reset()
        comm = self.comm.reset() if self.comm is not None else None
        self._after_step(batches, runs, accumulate=acc is not None)
        self.stats = StepStats(
            loss=loss,
            h2d_bytes=sum(r.traffic.h2d_bytes for r in runs) + opt.h2d_bytes,
            d2h_bytes=sum(r.traffic.d2h_bytes for r in runs) + opt.d2h_bytes,
            disk_read_bytes=disk1[0] - disk0[0], disk_write_bytes=disk1[1] - disk0[1],
            peak_device_bytes=max(r.tracker.peak_total for r in runs),
            peak_device_model_bytes=max(r.tracker.peak_model for r in runs),
            peak_nonmodel_bytes=max(r.tracker.peak_nonmodel for r in runs),
            num_fetches=sum(r.traffic.num_fetches for r in runs) + opt.num_fetches,
            num_evictions=sum(r.traffic.num_evictions for r in runs) + opt.num_evictions,
            allgather_bytes=comm.allgather_bytes if comm else 0,
            reduce_scatter_bytes=comm.reduce_scatter_bytes if comm else 0, skipped=skipped, loss_scale=scale,
            time_s=t_end - t_start, forward_s=sum(r.forward_s for r in runs),
            backward_s=sum(r.backward_s for r in runs), optimizer_s=t_end - t_opt,
            transfer_s=sum(r.traffic.transfer_s for r in runs) + opt.transfer_s,
            offload_bytes=sum(r.traffic.offload_bytes for r in runs),
            reload_bytes=sum(r.traffic.reload_bytes for r in runs),
            allocator_peak_bytes=self._allocator_peak(runs), peak_host_bytes=self.store.host_meter.peak,
            compute_ops=sum(r.ops[0] for r in runs), compiled_ops=sum(r.ops[1] for r in runs), grad_norm=self._norm,
            device_memory=self.budget)
        return self.stats.loss

    def _allocator_peak(self, runs: list) -> int | None:
        """CUDA: the caching allocator's peak over the step less the bytes held outside it (the
        trackers' ``external_bytes``), the figure the budget bounds; None elsewhere."""
        return None if self.device.type != "cuda" else \
            torch.cuda.max_memory_allocated(self.device) - min(r.tracker.external_bytes for r in runs)

    def _prepare_step(self, batches: list, *, accumulate: bool) -> None:
        """Mode hook: before any run of a step (hooks mode traces new batch shapes here)."""

    def _run_micro(self, batch: Any, *, acc: list[torch.Tensor] | None, scale: float, k: int) -> MicroRun:
        """Mode hook: one forward+backward of ``batch`` (gradients into the param chunks, or added
        into ``acc``); on failure it undoes what it wrote and raises."""
        raise NotImplementedError

    def _grad_divisor(self, scale: float, k: int) -> float:
        """Mode hook: what the summed gradients of ``k`` runs at loss scale ``scale`` are divided by."""
        raise NotImplementedError

    def _update(self, last: MicroRun, written: frozenset[str], divisor: float,
                acc: list[torch.Tensor] | None) -> bool:
        """Mode hook: the optimizer step (``_optimizer_step``) inside ``last``'s accounting;
        returns True if it was skipped."""
        raise NotImplementedError

    def _after_step(self, batches: list, runs: list[MicroRun], *, accumulate: bool) -> None:
        """Mode hook: bookkeeping after a successful step."""

    def _undo_all(self, only: list[bool] | None = None) -> None:
        """Gradients written over parameter chunks are undone (each chunk ``only`` marks, or all):
        the chunk is made again from its fp32 master (a chunk updated early gets its master back
        first). Both modes undo a failed step with it."""
        self.early.undo()
        for c in range(self.layout.num_chunks):
            if only is None or only[c]:
                self.store.restore_from_master(c)


def _release_resources(copies, homes, disk) -> None:
    """Stop the copy engine's threads and close the disk tier (its thread, descriptor and file;
    the disk homes' dirty buffers written back first)."""
    try:
        copies.close()
    finally:
        try:
            if homes is not None:
                homes.flush()
        finally:
            if disk is not None:
                disk.close()

