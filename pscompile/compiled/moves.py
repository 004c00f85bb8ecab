"""Compiled mode's device slots and memory nodes: ``ChunkMoves``, the part of ``CompiledEngine`` that
moves bytes. It owns every slot and every copy still in flight; the engine holds one and talks to it
through its public methods only.

A slot holds device memory only while it holds a chunk (``_allocate`` / ``_free``, so the bytes the
plan gives activations after a drop really are free). ``run`` performs one memory node of a schedule
through the copy engine (``memory/copies.py``): fetch, wait, writeback, drop, store_grad,
accumulate_grad and its wait, the ZeRO gathers and reductions; ``move_activation`` one offload,
reload or wait_copy. ``land`` and ``fetch_ahead`` serve the training step that overlaps its update
with the last writebacks and fetches for the next step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pscompile.graph.ops import DECLS, ActivationMove, flat_pieces
from pscompile.kinds import MemKind
from pscompile.memory.copies import Copy, Landed
from pscompile.memory.tiers import Tier
from pscompile.memory.tracker import NonModelTracker
from pscompile.passes.plan_residency import ResidencyPlan


def _add_landed(copies: list) -> None:
    """Wait (on the host, which reads them) for a gradient's copies to the host, ``(copy, fp32
    target, host copy or None)`` each, and add each host copy into its target (None: the copy went
    straight into a zero buffer)."""
    for copy, target, host in copies:
        copy.wait_host()
        if host is not None:
            target.add_(host)                    # fp32 += compute dtype, on the host


class ChunkMoves:
    """Compiled mode's device slots and the copies of its memory nodes (the module docstring).

    ``store``, ``copies`` and ``link`` are the engine's chunk store, copy engine and link;
    ``start_update(chunk, landed, written)`` starts a chunk's early update at its ``update`` node.
    A run is bracketed by ``begin_run`` and ``end_run`` (or ``abort``, after a failure)."""

    def __init__(self, store, copies, link, *, device: torch.device, dtype: torch.dtype, chunk_size: int,
                 start_update: Callable[[int, Copy | None, set[str]], None]):
        self.store, self.copies, self.link = store, copies, link
        self.device, self.dtype, self.chunk_size = device, dtype, chunk_size
        self._on_update = start_update
        self.slots: list[torch.Tensor] = []        # every slot tensor (without memory while it holds no chunk)
        self._slot_ptrs: set[int] = set()         # storages of the slots holding memory now
        self.slot_bytes = 0                        # their bytes (the tracker reads it after every op)
        self._slot_chunk: dict[int, int] = {}      # slot index -> chunk held now
        self._in_flight: dict[int, Any] = {}       # slot -> its asynchronous fetch (a Copy, or a collective's work)
        self._packed: dict[int, int] = {}          # slot -> the NF4 chunk whose fetch into it lands packed
        self._reading: dict[int, Copy] = {}        # slot -> the writeback reading it
        self._homing: dict[int, Copy] = {}         # chunk -> the writeback writing its home
        self._wb_seq: dict[int, int] = {}          # chunk -> when its last writeback was issued (a count)
        self._wb_count = 0
        self._copying: dict[int, Copy] = {}        # id(activation copy) -> its asynchronous copy
        # (parameter, chunk) -> [(copy, fp32 target, host copy or None)] of an asynchronous accumulate_grad
        self._grad_copies: dict[tuple[str, int], list] = {}
        # the end of a training step (the engine's ``_overlaps_update``): slot -> (chunk, its writeback
        # still landing), dropped by the plan but released only once landed, while the optimizer step starts
        self._deferred: dict[int, tuple[int, Copy]] = {}
        self.ahead: list[tuple[int, int]] = []     # (chunk, slot) to fetch for the next step after its update
        self._disk_acc = None                      # this run's accumulation buffers when they are on disk
        self._acc_zero = False                    # this run's accumulation buffers are zero: copied into
        self._disk_prefetch = True                 # disk_read nodes read ahead
        self.written: set[str] = set()             # parameters whose gradients the current run stored
        # each declared op's handler (``OpDecl.handler``): op name -> bound method
        self._handlers = {name: getattr(self, d.handler) for name, d in DECLS.items()}

    # ---------------------------------------------------------------- a run
    def begin_run(self, *, disk_acc=None, fresh_acc: bool = False, disk_prefetch: bool = True) -> None:
        """A run starts: ``disk_acc``, its accumulation buffers when they are on disk; ``fresh_acc``,
        they are zero (the run copies into them, not adds)."""
        self._disk_acc, self._acc_zero, self._disk_prefetch = disk_acc, fresh_acc, disk_prefetch
        self.written = set()

    def end_run(self) -> None:
        """A run ended well: its copies are flushed (unless writebacks still land, ``land`` waits)."""
        if not self._deferred:
            self.copies.flush()
        self._reading.clear()
        self._homing.clear()

    def abort(self) -> None:
        """After a failed run: no copy left running into memory the recovery frees, nothing in
        flight remembered."""
        self.copies.drain()
        self.land(errors=False)
        self._abandon_in_flight()
        self._grad_copies.clear()
        self._reading.clear()
        self._homing.clear()
        self._copying.clear()

    def idle(self) -> bool:
        """No copy of a memory node is in flight or remembered, and none of the copy engine's."""
        return not (self._in_flight or self._copying or self._reading or self._deferred) and self.copies.idle()

    # ---------------------------------------------------------------- slots
    def ensure(self, plan: ResidencyPlan, extra: int = 0) -> None:
        """Slot tensors for ``plan`` (and for slot indices below ``extra``: a lookahead's), with the
        device-updated chunks in their fixed slots."""
        while len(self.slots) < max(plan.num_slots, extra):
            self.slots.append(self._empty_slot())
        for c, k in plan.initial:                  # device-updated chunks live in fixed slots
            if self.store.os_tier[c] is not Tier.DEVICE:
                continue                           # a warm start: the previous run left it there
            if self._slot_chunk.get(k) != c:
                self._allocate(k)
                self.store.cast_master_into(c, self.slots[k])   # device-homed: the cast of its master
                self.store.attach(c, self.slots[k])
                self._slot_chunk[k] = c

    def _empty_slot(self) -> torch.Tensor:
        slot = torch.empty(self.chunk_size, dtype=self.dtype, device=self.device)
        slot.untyped_storage().resize_(0)
        return slot

    def _allocate(self, k: int) -> None:
        """Give slot ``k`` its chunk of device memory (a fetch into it is about to start)."""
        storage = self.slots[k].untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.store.param_chunk_bytes)
            self._slot_ptrs.add(storage.data_ptr())
            self.slot_bytes += storage.nbytes()

    def release(self, k: int, node: str | None = None) -> None:
        """Slot ``k`` no longer holds its chunk: forget it and give its memory back (on CUDA to
        the caching allocator), so the bytes the plan lets activations use really are free."""
        self.store.detach(self._slot_chunk.pop(k))
        self._free(k, node)

    def release_where(self, keep: Callable[[int], bool]) -> None:
        """Release every slot whose chunk ``keep`` says no to."""
        for k, c in list(self._slot_chunk.items()):
            if not keep(c):
                self.release(k)

    def _free(self, k: int, node: str | None = None) -> None:
        pending = self._in_flight.pop(k, None)      # a fetch for this step, issued by the last one
        self._packed.pop(k, None)
        if pending is not None:                     # (``plan_lookahead``): no copy into freed memory
            pending.wait()
        storage = self.slots[k].untyped_storage()
        if storage.nbytes():
            self.copies.check_free(self.slots[k], node)    # (the race checker: no copy still owns it)
            self._slot_ptrs.discard(storage.data_ptr())
            self.slot_bytes -= storage.nbytes()
            storage.resize_(0)

    def residency(self) -> dict[int, int]:
        """chunk -> slot of the chunks on the device now."""
        for k, c in list(self._slot_chunk.items()):
            if not self.store.resident(c):             # dropped behind our back (load_state_dict)
                del self._slot_chunk[k]
                self._free(k)
        return {c: k for k, c in self._slot_chunk.items()}

    def settle(self) -> None:
        """Back to the start of a cold run: only chunks whose optimizer states live on the device
        stay. The others are clean here (warm runs update nothing), so they are dropped, not copied."""
        for c, k in self.residency().items():
            if not self.store.device_homed(c):
                assert not self.store.dirty[c], f"chunk {c} left dirty on the device by a warm run"
                self.release(k)

    def model_bytes(self) -> int:
        """Model bytes the device holds now: the memory of every slot (allocated, whether or not
        a chunk sits in it yet) and the optimizer states kept there."""
        return self.slot_bytes + self.store.dev_os_pool.bytes_in_use + self.store.landing_bytes

    def is_model_storage(self, ptr: int) -> bool:
        return ptr in self._slot_ptrs or self.store.is_model_storage(ptr)

    # ---------------------------------------------------------------- memory nodes
    def run(self, mem, args, at_end: bool = False, node: str | None = None) -> None:
        """Perform one memory node. Copies go to the transfer queue (in order per direction); only a fetch with
        a ``wait`` and a writeback return before their copy is done (the drop after a writeback
        waits for it before giving the slot's memory back). Gradient stores to the host and a
        synchronous accumulate_grad wait for their copy, so the gradient dies where the plan says;
        an asynchronous accumulate_grad (``overlap_grad_copies``) is added into its buffer at its
        ``wait_grad``, which also keeps the gradient alive until then. ``at_end``
        (a training step's memory nodes after its last compute): a drop whose chunk's writeback is
        still landing keeps the slot's memory until ``land`` releases it.
        Every copy goes through the copy engine (``memory/copies.py``) and names ``node``; waits are
        compute-side, except where the host reads what landed (gradients it adds or updates from).
        Each op's declaration names its handler (``OpDecl.handler``), looked up once: a dictionary
        lookup, not a chain of comparisons, since it runs for every memory node of every step."""
        self._handlers[mem.op](mem, args, at_end, node)

    def _mem_disk_read(self, mem, args, at_end, node) -> None:
        if self._disk_prefetch:                  # (disk_prefetch False: each read when its fetch needs it)
            self.store.read_ahead(mem.chunk)

    def _mem_update(self, mem, args, at_end, node) -> None:
        """Its writeback was the chunk's last move: its update starts."""
        self._on_update(mem.chunk, self._homing.get(mem.chunk), self.written)

    def _mem_fetch(self, mem, args, at_end, node) -> None:
        store = self.store
        slot, _ = args                  # host_c: the chunk's home (store.fetch_source: which buffer)
        self._allocate(mem.slot)
        # (the other copy engine may still be writing the chunk's home: a writeback earlier this run)
        fut = self.copies.submit(store.fetch_target(mem.chunk, slot), store.fetch_source(mem.chunk), "h2d",
                                 after=self._homing.get(mem.chunk), node=node)
        store.close_home(mem.chunk, copy=fut)      # (a disk home's buffer is kept until the copy lands)
        self.link.traffic.num_fetches += 1
        store.attach(mem.chunk, slot)
        self._slot_chunk[mem.slot] = mem.chunk
        self._fetched(mem.slot, mem.chunk, fut, wait=not mem.asynchronous)

    def _fetched(self, k: int, c: int, fut, *, wait: bool) -> None:
        """Chunk ``c``'s fetch into slot ``k`` is submitted: waited for now (and landed), or kept in
        flight until its ``wait`` node."""
        if self.store.packed(c):
            self._packed[k] = c
        if wait:
            fut.wait()
            self._land(k)
        else:
            self._in_flight[k] = fut

    def _land(self, k: int) -> None:
        """Slot ``k``'s fetch was waited for: an NF4 chunk's packed bytes become its values."""
        c = self._packed.pop(k, None)
        if c is not None:
            self.store.land(c, self.slots[k])

    def _mem_gather(self, mem, args, at_end, node) -> None:
        """ZeRO: the chunk/group arrives (allgather, broadcast)."""
        slot, q = args[0], self.copies
        self._allocate(mem.slot)
        handle = self.store.gather_into(mem.chunk, slot, async_op=mem.asynchronous,
                                        copy=lambda d, s_: q.move(d, s_, "h2d", node=node))
        self.link.traffic.num_fetches += 1
        self.store.attach(mem.chunk, slot)
        self._slot_chunk[mem.slot] = mem.chunk
        if self.store.packed(mem.chunk):
            self._packed[mem.slot] = mem.chunk
        if mem.asynchronous:
            self._in_flight[mem.slot] = handle
        else:
            self._land(mem.slot)

    def _mem_reduce(self, mem, args, at_end, node) -> None:
        """ZeRO: gradients to their owners (reduce_scatter, reduce)."""
        dest, slot, _, _, accumulate = args
        q = self.copies
        self.store.reduce_into_home(mem.chunk, slot, dest if accumulate else None,
                                    copy=lambda d, s_: q.move(d, s_, "d2h", node=node))
        self.store.dirty[mem.chunk] = False

    def _mem_wait(self, mem, args, at_end, node) -> None:
        self._in_flight.pop(mem.slot).wait()          # a copy, or a collective's work
        self._land(mem.slot)

    def _mem_grad_landed(self, mem, args, at_end, node) -> None:
        """A gradient's copy (overlap_grad_copies; none: added at once, on disk)."""
        _add_landed(self._grad_copies.pop((mem.fqn, mem.chunk), []))

    def _mem_writeback(self, mem, args, at_end, node) -> None:
        store = self.store
        _, slot = args                  # host_c: the chunk's home; its gradient's own buffer there
        fetching = self._in_flight.get(mem.slot)        # (planned after its wait; kept safe anyway)
        self._wb_count += 1
        self._wb_seq[mem.chunk] = self._wb_count        # (the optimizer step updates them in landing order)
        self._reading[mem.slot] = self._homing[mem.chunk] = self.copies.submit(
            store.home_for_device_data(mem.chunk, whole=True), slot, "d2h",
            after=fetching if isinstance(fetching, Copy) else None, node=node)
        store.close_home(mem.chunk, dirty=True, copy=self._homing[mem.chunk])
        store.dirty[mem.chunk] = False

    def _mem_leave(self, mem, args, at_end, node) -> None:
        """drop, release_remote: the slot gives its chunk (group) up."""
        pending = self._reading.pop(mem.slot, None)
        if pending is not None and at_end:   # the optimizer step starts while it lands (_overlapped_update)
            chunk = self._slot_chunk.pop(mem.slot)
            self.store.detach(chunk)
            self._deferred[mem.slot] = (chunk, pending)
        else:
            if pending is not None:    # the slot's memory goes back only once its writeback has read it
                pending.wait()
            self.release(mem.slot, node)
        self.link.traffic.num_evictions += 1

    def _mem_accumulate(self, mem, args, at_end, node) -> None:
        acc, grad, offset, *page = args
        q = self.copies
        disk_acc = self._disk_acc                 # (on disk: its buffer is opened, added into, closed)
        if disk_acc is not None:
            acc = disk_acc.open(mem.chunk)
        copies = []
        for piece, at in flat_pieces(grad, *page):                  # the gradient, or one page of it
            target = acc[offset + at:offset + at + piece.numel()].view(piece.shape)
            if self._acc_zero:                                     # a zero buffer: 0 + g is g
                copies.append((q.submit(target, piece, "d2h", node=node), target, None))
                continue
            host = q.host_empty(piece.shape, piece.dtype)           # the gradient crosses the link
            copies.append((q.submit(host, piece, "d2h", node=node), target, host))
        if mem.asynchronous and disk_acc is None:   # its wait_grad adds it (the gradient lives until then)
            self._grad_copies[(mem.fqn, mem.chunk)] = copies
        else:
            _add_landed(copies)
            if disk_acc is not None:
                disk_acc.close(mem.chunk, dirty=True)
        self.written.add(mem.fqn)

    def _mem_store_grad(self, mem, args, at_end, node) -> None:
        dest, grad, offset, *page = args
        if mem.slot is None:                                        # home: the gradient's buffer there
            dest = self.store.home_for_device_data(mem.chunk, whole=False)
        for piece, at in flat_pieces(grad, *page):                  # strided grads: no temporary
            target = dest[offset + at:offset + at + piece.numel()].view(piece.shape)
            if mem.slot is not None:
                target.copy_(piece)
            else:            # waited for: the gradient dies here, as the plan assumes (and the host
                self.copies.move(target, piece, "d2h", node=node)           # optimizer reads it)
        if mem.slot is None:
            self.store.close_home(mem.chunk, dirty=True)
        self.mark_stored(mem)

    def mark_stored(self, mem) -> None:
        """The bookkeeping of a ``store_grad``: a slot's chunk is dirty, the parameter written. An
        eager region that runs stores itself has it done before it starts, so a region that fails
        part-way has its chunks restored (the engine's ``_recover``) whether or not its copies ran."""
        if mem.slot is not None:
            self.store.dirty[mem.chunk] = True
        self.written.add(mem.fqn)

    def move_activation(self, moves: ActivationMove, args: tuple, node: str | None = None) -> torch.Tensor | None:
        """Offload a saved activation into a new host buffer, or reload it into a new device
        tensor, on the transfer queue; waited for at once, or (asynchronous) at its ``wait_copy``."""
        return self._handlers[moves.op](moves, args[0], node)

    def _offload(self, moves: ActivationMove, src: torch.Tensor, node: str | None) -> torch.Tensor:
        dst = self.copies.host_empty(src.shape, src.dtype, src.stride())
        return self._activation_copy(moves, dst, self.copies.submit(dst, src, "d2h", activation=True, node=node))

    def _reload(self, moves: ActivationMove, src: torch.Tensor, node: str | None) -> torch.Tensor:
        dst = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device=self.device)
        return self._activation_copy(moves, dst, self.copies.submit(dst, src, "h2d", activation=True, node=node))

    def _copy_landed(self, moves: ActivationMove, copy: torch.Tensor, node: str | None) -> None:
        self._copying.pop(id(copy)).wait()

    def _activation_copy(self, moves: ActivationMove, dst: torch.Tensor, fut) -> torch.Tensor:
        if moves.asynchronous:
            self._copying[id(dst)] = fut          # a wait_copy of dst follows (the graph keeps src alive until it)
        else:
            fut.wait()
        return dst

    # ---------------------------------------------------------------- the end of a training step
    def landing_slot(self, c: int) -> int | None:
        """The slot chunk ``c``'s writeback still reads at the end of a step (None: not landing)."""
        return next((k for k, (chunk, _) in self._deferred.items() if chunk == c), None)

    def still_landing(self) -> set[int]:
        """The chunks whose writeback at the end of a step has not landed yet."""
        return {c for c, fut in self._deferred.values() if not fut.done()}

    def issued(self, c: int) -> int:
        """When chunk ``c``'s last writeback was issued (a count; 0: never)."""
        return self._wb_seq.get(c, 0)

    def land(self, chunk: int | None = None, *, errors: bool = True) -> None:
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
                self._free(k)
        if failed is not None and errors:
            raise failed

    def fetch_ahead(self, c: int, tracker: NonModelTracker) -> None:
        """Chunk ``c`` is updated: if the next step starts with it, fetch it into its slot now."""
        slot = next((k for chunk, k in self.ahead if chunk == c), None)
        if slot is None:
            return
        held = self._deferred.get(slot)
        if held is not None:                      # (another chunk's writeback still reads the slot)
            self.land(held[0])
        self._allocate(slot)
        self.link.count(self.store.fetch_bytes(c), "h2d")
        fut = self.copies.submit(self.store.fetch_target(c, self.slots[slot]), self.store.fetch_source(c), "h2d",
                                 counted=True, node=f"(the next step's fetch of chunk {c})")
        self._fetched(slot, c, fut, wait=False)
        self.store.close_home(c, copy=fut)
        self.link.traffic.num_fetches += 1
        self.store.attach(c, self.slots[slot])
        self._slot_chunk[slot] = c
        tracker.sample_now()

    def warm_start(self, plan: ResidencyPlan) -> None:
        """Fetch the chunks ``plan`` (a warm schedule's) starts with into their slots, outside any run
        (the link counts them as setup traffic, the engine's ``_count_outside_steps``), after ``settle``: the
        chunks a previous run of the loop would have left there. A chunk the plan waits for (it
        starts in flight: the previous step fetched it ahead) lands at that ``wait``; one already in
        its slot (another run left it there, not a fetch ahead) has landed (``Landed``)."""
        first: dict[int, MemKind] = {}
        for a in plan.actions:
            if a.slot is not None:
                first.setdefault(a.slot, a.kind)
        for c, k in plan.initial:
            if self._slot_chunk.get(k) == c:      # (left there by the last run: where the plan waits
                if first.get(k) == MemKind.WAIT and k not in self._in_flight:     # for it, it has landed)
                    self._in_flight[k] = Landed()
                continue
            self._allocate(k)
            self.link.count(self.store.fetch_bytes(c), "h2d")     # (now: before the run, setup traffic)
            fut = self.copies.submit(self.store.fetch_target(c, self.slots[k]), self.store.fetch_source(c), "h2d",
                                     counted=True, after=self._homing.get(c), node=f"(warm start: chunk {c})")
            self.store.close_home(c, copy=fut)
            self.store.attach(c, self.slots[k])
            self._slot_chunk[k] = c
            self._fetched(k, c, fut, wait=first.get(k) != MemKind.WAIT)

    def _abandon_in_flight(self) -> None:
        """After a failed run, collectives may still be running (a broken process group times out
        the queued ones one by one) and write into their slots: such a slot is not freed but
        replaced by a new empty one; the collective keeps the old memory until it ends."""
        for k, pending in self._in_flight.items():
            if getattr(pending, "running", lambda: False)():
                storage = self.slots[k].untyped_storage()
                self._slot_ptrs.discard(storage.data_ptr())
                self.slot_bytes -= storage.nbytes()
                self.slots[k] = self._empty_slot()
        self._in_flight.clear()
        self._packed.clear()
