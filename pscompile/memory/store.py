"""ChunkStore: the four chunk lists of a model and where each chunk lives right now.

- param chunks (compute dtype): a chunk's home is on the HOST tier, and the DEVICE tier holds a
  cached copy while the chunk is resident -- except for chunks whose optimizer states live on the
  device: their home is the device (no host copy at all, so the device adds capacity for model
  data), and their param chunk is the compute-dtype cast of the fp32 master there, made again from
  it whenever it is needed (``fetch`` costs no link bytes). ``dirty`` marks a device copy that is newer
  than the host copy (gradients were written into it, or the optimizer updated it there); evicting
  a clean chunk costs no copy. After a parameter's last backward use its gradient overwrites it in
  place (PatrickStar's grad-reuses-param-chunk trick).
- optimizer-state chunks (fp32 master, exp_avg, exp_avg_sq): each chunk's three buffers live on
  one tier for the whole run (device-aware placement), where that chunk's update runs. With a
  disk tier, the chunks the host cannot hold keep them on disk (``memory/disk_states.py``) and
  update on the host, staged in and written back around their update.

With fp32 compute on one process (``master_is_param``) a host-homed chunk's param chunk *is* its
fp32 master (the same values, so one buffer), and its gradients go home into a buffer of their own
(``grad_home``) instead of over the parameters: the update writes the new parameters where it
writes the new master and leaves no cast to copy back. Host bytes are the same (16 B/param).

What a chunk holds is its kind's (``kind(c)``, declared in ``memory/chunk_kinds.py``). Frozen
chunks (parameters with ``requires_grad=False``) hold their compute-dtype copy only: no master, no
moments, no gradient; their home is the host (or the disk), fetched like any chunk and never
written back. A trainable chunk's states cover its state extent
(``state_numel``), not the padding after its last trainable piece.

Every copy between tiers goes through the copy engine (``memory/copies.py``) and is counted by the ``Link``.
"""

from __future__ import annotations


import torch

from pscompile.memory import nf4
from pscompile.memory.disk import DiskQueue
from pscompile.memory.disk_homes import ACC_BUFFERS, DiskHomes
from pscompile.memory.disk_states import DiskStates
from pscompile.memory.chunk_kinds import ChunkKind
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.store_values import BufferKind, StoreValues  # noqa: F401 -- (BufferKind: callers import it here)
from pscompile.memory.copies import CopyEngine, ThreadCopies
from pscompile.memory.tiers import HostMeter, Link, SlotPool, Tier

_HOST = torch.device("cpu")




class ChunkStore(StoreValues):
    packed_shards = 1      # the shards a landing NF4 slot's packed bytes come in (ZeRO by group: its ranks)
    def __init__(self, layout: ChunkLayout, *, device: torch.device, dtype: torch.dtype, link: Link,
                 os_on_device: frozenset[int] = frozenset(), home_numel: int | None = None,
                 homes: frozenset[int] | None = None, os_on_disk: frozenset[int] = frozenset(),
                 disk: DiskQueue | None = None, params_on_disk: frozenset[int] = frozenset(), acc_on_disk: bool = False,
                 master_is_param: bool = False, copies: CopyEngine | None = None):
        """``home_numel``: elements of a chunk's home buffers (host copy and optimizer states); a
        ZeRO store keeps only its shard of each chunk, or (``homes``) homes for the chunks it owns
        only, the others getting empty placeholders (``pscompile.dist.store``). ``os_on_disk``:
        chunks whose optimizer states live in ``disk``'s file; ``params_on_disk`` (a subset): chunks
        whose compute-dtype home is there too (``memory/disk_homes.py``). ``master_is_param`` (float32
        only): host-homed chunks share one buffer for their param chunk and master. ``copies``: the
        copy engine its moves go through (default: the CPU's, over ``link``)."""
        stateless = frozenset(c for c in range(layout.num_chunks) if not layout.kind(c).has_states)
        os_on_device, os_on_disk = os_on_device - stateless, os_on_disk - stateless     # (nothing to place)
        if not params_on_disk <= os_on_disk | stateless:
            raise ValueError("a chunk whose parameters live on disk keeps its optimizer states there too")
        if master_is_param and dtype != torch.float32:
            raise ValueError(f"master_is_param needs float32 chunks, not {dtype}")
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.link = link
        self.copies = copies if copies is not None else ThreadCopies(link)
        cs = layout.chunk_size
        self.home_numel = hs = cs if home_numel is None else home_numel
        pin = self.copies.pins_host
        self.dev_param_pool = SlotPool(Tier.DEVICE, device, dtype, cs)
        self.host_meter = HostMeter()       # host bytes of model data now, and their peak
        self.host_param_pool = SlotPool(Tier.HOST, _HOST, dtype, hs, pin=pin, meter=self.host_meter)
        self.dev_os_pool = SlotPool(Tier.DEVICE, device, torch.float32, hs)
        self.host_os_pool = SlotPool(Tier.HOST, _HOST, torch.float32, hs, pin=pin, meter=self.host_meter)
        n = layout.num_chunks
        self.homes = frozenset(range(n)) if homes is None else homes
        # NF4 chunks (``FROZEN_NF4``): packed bytes at home (``memory/nf4.py``; on disk too)
        self.host_packed_pool = SlotPool(Tier.HOST, _HOST, torch.uint8, nf4.packed_bytes(hs), pin=pin,
                                         meter=self.host_meter)
        none = torch.empty(0, dtype=dtype)
        self.host_param = [(self.host_packed_pool if layout.kind(c).packed else self.host_param_pool)
                           .acquire(zero=True)
                           if c in self.homes and c not in os_on_device and c not in params_on_disk
                           else none for c in range(n)]
        self.dev_param: list[torch.Tensor | None] = [None] * n
        self.dirty = [False] * n
        self.os_tier = [Tier.DEVICE if c in os_on_device else Tier.DISK if c in os_on_disk else Tier.HOST
                        for c in range(n)]
        self.disk = DiskStates(disk, sorted(os_on_disk), self.host_os_pool) if os_on_disk else None
        # the disk homes' slots follow the three state slots of every disk chunk
        self.param_disk = (DiskHomes(disk, {c: 3 * len(os_on_disk) + i for i, c in enumerate(sorted(params_on_disk))},
                                     self.host_param_pool, packed={c: self.host_packed_pool.slot_bytes
                                                                   for c in params_on_disk if layout.kind(c).packed})
                           if params_on_disk else None)
        # ``acc_on_disk``: gradient accumulation's fp32 buffers too, one slot per chunk after those
        base = 3 * len(os_on_disk) + len(params_on_disk)
        self.acc_disk = (DiskHomes(disk, {c: base + c for c in range(n)}, self.host_os_pool, capacity=ACC_BUFFERS)
                         if acc_on_disk else None)
        self.master, self.exp_avg, self.exp_avg_sq = [], [], []
        for c in range(n):
            if c not in self.homes or self.os_tier[c] is Tier.DISK:     # (disk: staged when needed)
                for lst in (self.master, self.exp_avg, self.exp_avg_sq):
                    lst.append(torch.empty(0))
                continue
            pool = self.dev_os_pool if self.os_tier[c] is Tier.DEVICE else self.host_os_pool
            numel = self.state_numel(c)
            for lst in (self.master, self.exp_avg, self.exp_avg_sq):
                lst.append(pool.acquire(zero=True, numel=numel) if numel else torch.empty(0))
        self._slot_chunk: dict[int, int] = {}   # device buffer storage ptr -> chunk id
        self.landing_bytes = 0                  # the workspace of an NF4 chunk's landing, until sampled
        self._attached: set[int] = set()        # chunks whose device buffer belongs to the caller
        self.master_is_param = master_is_param
        self._grad_home: dict[int, torch.Tensor] = {}   # shared chunks: where their gradients go home
        self._home_copy: set[int] = set()    # shared chunks whose gradient buffer is their home copy now
        for c in range(n):
            self._share_master(c)

    def state_numel(self, c: int) -> int:
        """Elements of chunk ``c``'s master and moments here: its state extent (0: a frozen chunk,
        or one another rank owns); a ZeRO shard keeps its whole shard for a trainable chunk."""
        extent = self.layout.state_extent(c)
        if c not in self.homes or extent == 0:
            return 0
        return extent if self.home_numel == self.layout.chunk_size else self.home_numel

    def kind(self, c: int) -> ChunkKind:
        """Chunk ``c``'s kind (``memory/chunk_kinds.py``): what it holds besides its compute copy."""
        return self.layout.kind(c)

    # ---- one buffer for the param chunk and the master (fp32) ------------------------------
    def shares_master(self, c: int) -> bool:
        """Chunk ``c``'s host param chunk is its fp32 master (its gradients have a home of their own)."""
        return c in self._grad_home

    def _share_master(self, c: int) -> None:
        """Make the host param chunk the master (where the store shares them and ``c`` is host-homed)."""
        if not self.master_is_param or self.os_tier[c] is not Tier.HOST or c not in self.homes \
                or self.shares_master(c) or not self.kind(c).master:
            return
        self.host_param[c][:self.master[c].numel()].copy_(self.master[c])   # (equal already: its cast)
        self.host_os_pool.release(self.master[c])
        self.master[c] = self.host_param[c]
        self._grad_home[c] = self.host_param_pool.acquire(zero=True)

    def _unshare_master(self, c: int) -> None:
        """Give chunk ``c`` a master of its own again (before its optimizer states move)."""
        if not self.shares_master(c):
            return
        self._home_copy.discard(c)
        self.host_param_pool.release(self._grad_home.pop(c))
        numel = self.exp_avg[c].numel()
        self.master[c] = self.host_os_pool.acquire(numel=numel)
        self.master[c].copy_(self.host_param[c][:numel])

    def disk_homed(self, c: int) -> bool:
        """Chunk ``c``'s home (compute-dtype or packed) is on disk: reached through ``open_home``."""
        return self.param_disk is not None and c in self.param_disk

    def grad_home(self, c: int) -> torch.Tensor:
        """Where chunk ``c``'s gradient is at home: its own buffer for a shared chunk, else over the
        parameters in the host param chunk (a disk home: opened, ``close_home`` after use)."""
        if self.disk_homed(c):
            return self.param_disk.open(c)
        buf = self._grad_home.get(c)
        return self.host_param[c] if buf is None else buf

    def home_for_device_data(self, c: int, *, whole: bool) -> torch.Tensor:
        """Where chunk ``c``'s device data goes home during a backward (a dirty chunk, ``whole``, or
        one gradient). Without sharing, that is over the parameters, and a later fetch of ``c``
        brings the gradients back with the parameters still live. With sharing it is the gradient
        buffer, which from then on is ``c``'s home copy: a gradient alone first copies the
        parameters in beside it, and ``fetch_source`` reads from there until the update. A disk
        home is opened (not read first when ``whole``): ``close_home(c, dirty=True)`` after writing."""
        if self.disk_homed(c):
            return self.param_disk.open(c, read=not whole)
        buf = self._grad_home.get(c)
        if buf is None:
            return self.host_param[c]
        if c not in self._home_copy:
            if not whole:
                buf.copy_(self.host_param[c])
            self._home_copy.add(c)
        return buf

    def fetch_source(self, c: int) -> torch.Tensor:
        """The host buffer a fetch of chunk ``c`` copies from (see ``home_for_device_data``; a disk
        home is opened: ``close_home(c, copy=...)`` once the copy is submitted)."""
        if self.disk_homed(c):
            return self.param_disk.open(c)
        return self._grad_home[c] if c in self._home_copy else self.host_param[c]

    def close_home(self, c: int, *, dirty: bool = False, copy=None) -> None:
        """Done with the buffer ``fetch_source``, ``home_for_device_data`` or ``grad_home`` gave
        for chunk ``c`` (``dirty``: written; ``copy``: a copy still using it). Host homes: nothing."""
        if self.disk_homed(c):
            self.param_disk.close(c, dirty=dirty, copy=copy)

    def read_ahead(self, c: int) -> None:
        """A ``disk_read`` node: start reading disk home ``c`` into a staging buffer."""
        self.param_disk.prefetch(c)

    def expect_fetches(self, order) -> None:
        """The chunks this run fetches, in order: the disk homes among them are read ahead."""
        if self.param_disk is not None:
            self.param_disk.expect(order, skip=self.resident)

    def forget_home_copies(self) -> None:
        """A new step: every shared chunk's home copy is its parameters again."""
        self._home_copy.clear()

    def place_optimizer_states(self, on_device) -> None:
        """Device-aware placement: the optimizer states of the chunks in ``on_device`` live on the
        device, the rest on the host. Moves happen here only (placement time, not in a step)."""
        on_device = set(on_device)
        for c in range(self.layout.num_chunks):
            want = Tier.DEVICE if c in on_device and self.kind(c).has_states else Tier.HOST
            if self.os_tier[c] is want or self.os_tier[c] is Tier.DISK:    # disk homes stay
                continue
            self._unshare_master(c)
            self.drop(c)            # the param chunk is the master's cast: made again where it goes
            src_pool, dst_pool = ((self.host_os_pool, self.dev_os_pool) if want is Tier.DEVICE
                                  else (self.dev_os_pool, self.host_os_pool))
            for lst in (self.master, self.exp_avg, self.exp_avg_sq):
                buf = dst_pool.acquire(numel=lst[c].numel())
                self.copies.move(buf, lst[c], "h2d" if want is Tier.DEVICE else "d2h")
                src_pool.release(lst[c])
                lst[c] = buf
            self.os_tier[c] = want
            if want is Tier.DEVICE:              # the device is the chunk's home now
                self.host_param_pool.release(self.host_param[c])
                self.host_param[c] = torch.empty(0, dtype=self.dtype)
            else:                                # a host home again, from the master that came over
                self.host_param[c] = self.host_param_pool.acquire(zero=True)
                self.host_param[c][:self.master[c].numel()].copy_(self.master[c])
                self._share_master(c)

    def state_shape(self, c: int) -> tuple[int, ...]:
        """The shape of chunk ``c``'s master and Adam states here (``(0,)``: another rank owns it,
        or it is frozen)."""
        return (self.state_numel(c),)

    def _states(self, c: int, *, write: bool = False) -> list[torch.Tensor]:
        """Chunk ``c``'s master, exp_avg and exp_avg_sq buffers, a disk home's through its cache
        (``write``: the caller changes them)."""
        if self.os_tier[c] is not Tier.DISK:
            return [self.master[c], self.exp_avg[c], self.exp_avg_sq[c]]
        bufs = self.disk.buffers(c)
        if write:
            self.disk.mark_dirty(c)
        n = self.state_numel(c)               # (a disk slot is a whole chunk; the states, its extent)
        return [b[:n] for b in bufs]

    # ---- residency -----------------------------------------------------------------------
    def resident(self, c: int) -> bool:
        return self.dev_param[c] is not None

    def resident_chunks(self) -> list[int]:
        return [c for c, b in enumerate(self.dev_param) if b is not None]

    def device_homed(self, c: int) -> bool:
        """Chunk ``c`` lives on the device (its optimizer states do): no host copy."""
        return self.os_tier[c] is Tier.DEVICE

    def fetch(self, c: int) -> torch.Tensor:
        """Copy chunk ``c`` host -> device (it must not be resident); a device-homed chunk is cast
        from its fp32 master on the device instead (no bytes cross the link)."""
        assert self.dev_param[c] is None, f"chunk {c} is already on the device"
        buf = self.dev_param_pool.acquire()
        if self._fill(c, buf):
            self.link.traffic.num_fetches += 1
        self.dev_param[c] = buf
        self.dirty[c] = False
        self._slot_chunk[buf.untyped_storage().data_ptr()] = c
        return buf

    def _fill(self, c: int, buf: torch.Tensor) -> bool:
        """Put chunk ``c``'s parameters into the device buffer ``buf``; True if they came over."""
        if self.device_homed(c):
            self.cast_master_into(c, buf)
            return False
        self.copies.move(self.fetch_target(c, buf), self.fetch_source(c), "h2d")
        self.close_home(c)
        self.land(c, buf)
        return True

    # ---- a chunk's format over the link (its kind's) ----------------------------------------
    def packed(self, c: int) -> bool:
        """Chunk ``c`` is kept in NF4: a fetch moves its packed bytes, ``land`` dequantizes them."""
        return self.kind(c).packed

    def fetch_bytes(self, c: int) -> int:
        """Bytes a fetch of chunk ``c`` moves over the link."""
        return self.kind(c).home_bytes(self.layout.chunk_size, self.dev_param_pool.slot_bytes // self.layout.chunk_size)

    def fetch_target(self, c: int, slot: torch.Tensor) -> torch.Tensor:
        """Where in device ``slot`` a fetch of chunk ``c`` copies ``fetch_source(c)``: the slot, or
        (NF4) its first bytes, which ``land`` turns into the compute-dtype chunk."""
        return slot.view(torch.uint8)[:self.host_packed_pool.slot_bytes] if self.packed(c) else slot

    def land(self, c: int, slot: torch.Tensor) -> None:
        """A fetch of chunk ``c`` into ``slot`` has landed (the compute side waited for it): an NF4
        chunk is dequantized in place (``nf4.dequantize_chunk``; its workspace is the device's
        fixed bytes, ``model_bytes.dequant_workspace``). Others: nothing to do."""
        if self.packed(c):
            self.landing_bytes = nf4.workspace_bytes(slot.numel())    # (until the engine sampled it: ``landed``)
            nf4.dequantize_chunk(slot, shards=self.packed_shards)

    def landed(self) -> None:
        """The engine sampled the device after a landing: its workspace is given back."""
        self.landing_bytes = 0

    def cast_master_into(self, c: int, buf: torch.Tensor) -> None:
        """A device-homed chunk's param chunk: the cast of its master (over its state extent; the
        padding after it zero)."""
        n = self.master[c].numel()
        buf[:n].copy_(self.master[c])
        buf[n:].zero_()

    def evict(self, c: int) -> None:
        """Give up the device copy of ``c``, copying it home first only if it is dirty (a
        device-homed chunk is never copied: it is made again from its master, so it must not hold
        gradients here -- both modes keep such chunks resident while they do)."""
        buf = self.dev_param[c]
        assert buf is not None, f"chunk {c} is not on the device"
        if self.dirty[c] and not self.device_homed(c):
            self.copies.move(self.home_for_device_data(c, whole=True), buf, "d2h")
            self.close_home(c, dirty=True)
        self.link.traffic.num_evictions += 1
        self.drop(c)

    def drop(self, c: int) -> None:
        """Forget the device copy without copying (the host copy is, or is made, the truth)."""
        buf = self.dev_param[c]
        if buf is not None:
            if c in self._attached:
                self.detach(c)
                return
            del self._slot_chunk[buf.untyped_storage().data_ptr()]
            self.dev_param_pool.release(buf)
            self.dev_param[c] = None
            self.dirty[c] = False

    def attach(self, c: int, buf: torch.Tensor) -> None:
        """Make ``buf`` (a device buffer the caller owns, e.g. a compiled schedule's slot) the
        device copy of chunk ``c``; the caller has filled it."""
        assert self.dev_param[c] is None, f"chunk {c} is already on the device"
        self.dev_param[c] = buf
        self.dirty[c] = False
        self._attached.add(c)
        self._slot_chunk[buf.untyped_storage().data_ptr()] = c

    def detach(self, c: int) -> None:
        """Forget an attached device copy (its buffer stays with its owner)."""
        buf = self.dev_param[c]
        assert c in self._attached and buf is not None
        del self._slot_chunk[buf.untyped_storage().data_ptr()]
        self._attached.discard(c)
        self.dev_param[c] = None
        self.dirty[c] = False

    def chunk_of_storage(self, storage_ptr: int) -> int | None:
        """Chunk id whose device buffer has this storage pointer (None if not a device chunk)."""
        return self._slot_chunk.get(storage_ptr)

    def owns(self, c: int) -> bool:
        """Whether this store keeps chunk ``c``'s home and updates it (always, on one rank)."""
        return c in self.homes

    def home_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``(offset, numel)`` ranges of a chunk, in the coordinates of its home buffers."""
        return ranges

    def is_model_storage(self, storage_ptr: int) -> bool:
        # (called for every tensor the tracker sees: four set lookups, no generator)
        return (self.dev_param_pool.owns(storage_ptr) or self.host_param_pool.owns(storage_ptr)
                or self.dev_os_pool.owns(storage_ptr) or self.host_os_pool.owns(storage_ptr)
                or self.host_packed_pool.owns(storage_ptr))

    @property
    def param_chunk_bytes(self) -> int:
        return self.dev_param_pool.slot_bytes

    @property
    def os_chunk_bytes(self) -> int:
        return 3 * self.dev_os_pool.slot_bytes

    def device_model_bytes(self) -> int:
        attached = len(self._attached) * self.dev_param_pool.slot_bytes
        return self.dev_param_pool.bytes_in_use + attached + self.dev_os_pool.bytes_in_use + self.landing_bytes

    def host_model_bytes(self) -> int:
        return self.host_param_pool.bytes_in_use + self.host_os_pool.bytes_in_use + self.host_packed_pool.bytes_in_use

    # ---- reading and writing parameters ----------------------------------------------------
    def current(self, c: int) -> torch.Tensor:
        """The authoritative copy of param chunk ``c`` (device copy if resident)."""
        buf = self.dev_param[c]
        assert buf is not None or not self.device_homed(c), f"device-homed chunk {c} is not on the device"
        return buf if buf is not None else self.host_param[c]

    def gradient(self, c: int) -> torch.Tensor:
        """Chunk ``c``'s gradient after a backward: the device copy if resident, else its home."""
        buf = self.dev_param[c]
        assert buf is not None or not self.device_homed(c), f"device-homed chunk {c} is not on the device"
        return buf if buf is not None else self.grad_home(c)

    def write_piece(self, c: int, offset: int, src: torch.Tensor) -> None:
        """Write ``src`` (flat, compute dtype, on the device) into chunk ``c`` where it lives."""
        buf = self.dev_param[c]
        if buf is not None:
            buf[offset:offset + src.numel()].copy_(src)
            self.dirty[c] = True
        else:
            assert not self.device_homed(c), f"device-homed chunk {c} is not on the device"
            self.copies.move(self.home_for_device_data(c, whole=False)[offset:offset + src.numel()], src, "d2h")
            self.close_home(c, dirty=True)

    def bring_to_os_tier(self, c: int) -> torch.Tensor:
        """Make the chunk's gradient available where its optimizer states live (a disk home's
        states staged on the host); return that buffer (the param chunk, unless ``shares_master``)."""
        if self.os_tier[c] is Tier.DEVICE:
            return self.dev_param[c] if self.resident(c) else self.fetch(c)
        if self.resident(c):
            self.evict(c)
        if self.os_tier[c] is Tier.DISK:
            self.master[c], self.exp_avg[c], self.exp_avg_sq[c] = self.disk.take(c)
        return self.grad_home(c)

    def stage(self, c: int) -> None:
        """Start bringing a disk home's optimizer states (and gradients) to the host (its update
        comes soon)."""
        if self.os_tier[c] is Tier.DISK:
            self.disk.stage(c)
            if self.disk_homed(c):
                self.param_disk.expect([c])

    def mark_updated(self, c: int) -> None:
        """The optimizer wrote new params into the copy ``bring_to_os_tier`` returned (and new
        states: a disk home's go back to its file)."""
        self._home_copy.discard(c)
        if self.os_tier[c] is Tier.DEVICE:
            self.dirty[c] = True
        elif self.os_tier[c] is Tier.DISK:
            self.disk.write_back(c, [self.master[c], self.exp_avg[c], self.exp_avg_sq[c]])
            self.master[c] = self.exp_avg[c] = self.exp_avg_sq[c] = torch.empty(0)
            self.close_home(c, dirty=True)          # (a disk home: the new parameters go back)

    def flush_disk(self) -> None:
        """Write back what the disk tier's caches changed (the file is the truth again)."""
        for homes in (self.param_disk, self.acc_disk):
            if homes is not None:
                homes.flush()
        if self.disk is not None:
            self.disk.flush()

    def settle_disk(self) -> None:
        """Wait for the disk tier's transfers and give its staging buffers back (the disk homes'
        dirty buffers written back first)."""
        if self.disk is not None:
            try:
                try:
                    for homes in (self.param_disk, self.acc_disk):
                        if homes is not None:
                            homes.flush()
                finally:
                    self.disk.settle()
            finally:                          # a failed update may have left staged buffers here
                for c in self.disk.slot_of:
                    self.master[c] = self.exp_avg[c] = self.exp_avg_sq[c] = torch.empty(0)

    def disk_model_bytes(self) -> int:
        states = 0 if self.disk is None else len(self.disk.slot_of) * self.os_chunk_bytes
        return states + (0 if self.param_disk is None else sum(self.fetch_bytes(c) for c in self.param_disk.slot_of))

    def restore_from_master(self, c: int) -> None:
        """Rewrite param chunk ``c`` from its fp32 master (undoes gradients written into it)."""
        self._home_copy.discard(c)
        if not self.kind(c).grad:          # (no gradient ever lands in it: its home is untouched)
            self.drop(c)
            return
        if self.os_tier[c] is Tier.DEVICE and self.resident(c):
            self.dev_param[c][:self.master[c].numel()].copy_(self.master[c])
            self.dirty[c] = True
            return
        self.drop(c)
        if self.disk_homed(c):
            master = self._states(c)[0]
            self.param_disk.open(c, read=master.numel() < self.home_numel)[:master.numel()].copy_(master)
            self.close_home(c, dirty=True)
        elif self.os_tier[c] is not Tier.DEVICE and not self.shares_master(c):   # (shared: never overwritten;
            master = self._states(c)[0]                                         # device-homed: made when needed)
            self.host_param[c][:master.numel()].copy_(master)
