"""ShardedStore: one rank's chunks under ZeRO data parallelism by chunk (PatrickStar section 6.2).

The layout's unit is a *communication group* of ``world`` chunks: a group of ``world * s``
elements whose r-th shard of ``s`` elements (chunk ``g * world + r``) is owned by rank r. A rank
keeps, for every group, only its own shard: the compute-dtype home on the host and the fp32
master, exp_avg and exp_avg_sq, which it alone updates. On the device a group exists only whole,
gathered into one slot of ``world * s`` elements:

    fetch(g)            allgather: own shard host -> slot[r], the other shards from their owners
    drop(g)             release_remote: the slot goes back (every shard still has its home)
    reduce_scatter(g)   the group's gradients (written into the slot) summed over ranks; the
                        rank's shard of the sum goes to its host home (or is added into its fp32
                        accumulation shard), and the slot is released

A gathered group holding gradients cannot be evicted: its remote shards have no home here, so it
stays until ``reduce_scatter`` (the planners keep it resident from its first gradient to its last).

Device homes: the first groups (per chunk: the first chunks a rank owns) whose model data the
rank's host cannot hold keep their home on its device (``os_on_device``): the fp32 master and Adam
states of the shard, and an fp32 gradient buffer. Their shard is gathered as the cast of the
master and their reduced gradient lands in that buffer, so neither crosses the link, and their
update runs on the device. The gathered group itself comes and goes like any other.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from pscompile.dist.comm import Comm
from pscompile.memory import nf4
from pscompile.memory.layout import ChunkLayout, TensorEntry
from pscompile.memory.copies import CopyEngine
from pscompile.memory.store import BufferKind, ChunkStore
from pscompile.memory.tiers import Link, Tier

def own_pieces(entry: TensorEntry, shard: int, rank: int, *,
               per_chunk_world: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """(group, offset in the rank's shard, offset in the flat tensor, numel) of the parts of
    ``entry`` that rank ``rank`` owns, shards being ``shard`` elements. ``per_chunk_world``: ZeRO
    per chunk over that many ranks -- rank r owns whole chunks c with c % world == r."""
    if per_chunk_world:
        for p in entry.pieces:
            if p.chunk % per_chunk_world == rank:
                yield p.chunk, p.chunk_offset, p.tensor_offset, p.numel
        return
    lo, hi = rank * shard, (rank + 1) * shard
    for p in entry.pieces:
        a, b = max(p.chunk_offset, lo), min(p.chunk_offset + p.numel, hi)
        if a < b:
            yield p.chunk, a - lo, p.tensor_offset + (a - p.chunk_offset), b - a


class _ZeroStore(ChunkStore):
    """What both ZeRO stores share: a chunk (or group) arrives on the device by a collective
    (``gather_into``), leaves by a release that copies nothing, and, once it holds all its
    gradients, sends them to their owners by a collective reduction (``reduce_into_home``). A
    rank keeps homes only for what it owns (``_pieces``: the parts of a tensor it owns)."""

    comm: Comm

    def _pieces(self, entry: TensorEntry) -> Iterator[tuple[int, int, int, int]]:
        raise NotImplementedError

    # ---- device homes (the module docstring) --------------------------------------------------
    def _make_device_grads(self) -> None:
        """An fp32 gradient buffer on the device for every shard homed there."""
        self._dev_grad = {c: self.dev_os_pool.acquire(zero=True) for c in range(self.layout.num_chunks)
                          if self.shard_on_device(c)}

    def shard_on_device(self, c: int) -> bool:
        """This rank's shard of group ``c`` has its home on the device."""
        return self.os_tier[c] is Tier.DEVICE

    def device_homed(self, c: int) -> bool:
        return False          # (a gathered group never is: only this rank's shard may be)

    def place_optimizer_states(self, on_device) -> None:
        """Nothing moves: under ZeRO the homes are placed once, when the store is made."""

    def _own_shard(self, c: int, dst: torch.Tensor, copy) -> None:
        """This rank's shard of ``c`` into the device buffer ``dst``: the cast of a device home's
        master (no link bytes), else its host home over the link."""
        if self.shard_on_device(c):
            dst.copy_(self.master[c])
        else:
            self._copy("h2d", copy)(dst, self.host_param[c])

    def bring_to_os_tier(self, c: int) -> torch.Tensor:
        if self.shard_on_device(c):
            return self._dev_grad[c]          # the reduced gradient; the update's cast lands there too
        return super().bring_to_os_tier(c)

    def mark_updated(self, c: int) -> None:
        if not self.shard_on_device(c):      # (a device home's next gather casts the new master)
            super().mark_updated(c)

    def restore_from_master(self, c: int) -> None:
        if self.shard_on_device(c):          # the gathered copy may hold gradients; the home is the master
            self.dirty[c] = False
            self.drop(c)
            return
        super().restore_from_master(c)

    def gather_into(self, c: int, buf: torch.Tensor, *, async_op: bool = False, copy=None):
        """Chunk ``c`` into the device buffer ``buf`` on every rank (``copy(dst, src)`` moves this
        rank's part over its link; default the link itself); the handle of an asynchronous one."""
        raise NotImplementedError

    def reduce_into_home(self, c: int, buf: torch.Tensor, acc: torch.Tensor | None = None, copy=None) -> None:
        """Sum chunk ``c``'s gradients in ``buf`` over ranks into their owners' homes (or add them,
        fp32, into the accumulation buffer ``acc``)."""
        raise NotImplementedError

    def _copy(self, direction: str, copy):
        return copy or (lambda dst, src: self.copies.move(dst, src, direction))

    def _to_home(self, c: int, part: torch.Tensor, acc: torch.Tensor | None, copy) -> None:
        if acc is None and self.shard_on_device(c):
            self._dev_grad[c].copy_(part)
        elif acc is None:
            self._copy("d2h", copy)(self.host_param[c], part)
        else:
            host = torch.empty(part.numel(), dtype=part.dtype)
            self._copy("d2h", copy)(host, part)
            acc.add_(host)

    # ---- filling -------------------------------------------------------------------------
    def load_params(self, params: Mapping[str, torch.Tensor], *, flush: bool = True) -> None:
        for fqn, value in params.items():
            flat = value if isinstance(value, nf4.Quantized) else value.detach().reshape(-1)
            for c, off, to, n in self._pieces(self.layout.entry(fqn)):
                if not self.kind(c).master:                     # (no master: the weight's home is its copy)
                    self._load_frozen(c, off, flat, to, n)
                    continue
                master = self._states(c, write=True)[0]        # (a disk home's through the cache)
                if self.shard_on_device(c):
                    self.copies.move(master[off:off + n], flat[to:to + n], "h2d")
                    continue
                master[off:off + n].copy_(flat[to:to + n])
                self.host_param[c][off:off + n].copy_(master[off:off + n])
        if flush:
            self.flush_disk()

    def _load_frozen(self, c: int, off: int, flat, to: int, n: int) -> None:
        """Elements ``[to, to + n)`` of a frozen tensor into this rank's home of ``c`` at ``off``:
        4-bit codes as they are (``nf4.Quantized``: loaded in 4 bits), quantized into an NF4 home,
        or copied into a compute-dtype one."""
        if isinstance(flat, nf4.Quantized):
            nf4.copy_piece(self.host_param[c], self.home_numel, off, flat, to, n)
        elif self.packed(c):
            nf4.write_piece(self.host_param[c], self.home_numel, off, flat[to:to + n])
        else:
            self.host_param[c][off:off + n].copy_(flat[to:to + n])

    # ---- residency (hooks mode drives these) ---------------------------------------------
    def _fill(self, c: int, buf: torch.Tensor) -> bool:
        self.gather_into(c, buf)
        self.land(c, buf)
        return True

    def evict(self, c: int) -> None:
        assert not self.dirty[c], f"chunk {c} holds gradients not yet sent to their owners; it cannot leave"
        self.link.traffic.num_evictions += 1
        self.drop(c)

    def reduce_scatter(self, c: int, acc: torch.Tensor | None = None) -> None:
        """The chunk's gradients are complete: send them to their owners and release the chunk."""
        self.reduce_into_home(c, self.dev_param[c], acc)
        self.dirty[c] = False
        self.link.traffic.num_evictions += 1
        self.drop(c)

    def current(self, c: int) -> torch.Tensor:
        assert self.owns(c) and not self.dirty[c], f"chunk {c} is not this rank's, or holds unreduced gradients"
        return self.host_param[c]

    def gradient(self, c: int) -> torch.Tensor:
        if self.shard_on_device(c):
            return self._dev_grad[c]
        return self.current(c)          # reduced into this rank's home, over the parameters

    def write_piece(self, c: int, offset: int, src: torch.Tensor) -> None:
        assert self.resident(c), f"a gradient for chunk {c} arrived while it is not on the device"
        super().write_piece(c, offset, src)

    # ---- state ---------------------------------------------------------------------------
    def gather(self, which: BufferKind, fqn: str) -> torch.Tensor:
        raise AssertionError("a sharded store holds parts of each tensor; use pscompile.dist.checkpoint")

    def scatter(self, which: BufferKind, fqn: str, value: torch.Tensor) -> None:
        """Write this rank's parts of one full tensor into an optimizer-state list."""
        i = ("master", "exp_avg", "exp_avg_sq").index(which)
        flat = value.detach().reshape(-1)
        for c, off, to, n in self._pieces(self.layout.entry(fqn)):
            dst = self._states(c, write=True)[i][off:off + n]
            if self.shard_on_device(c):
                self.copies.move(dst, flat[to:to + n], "h2d")
            else:
                dst.copy_(flat[to:to + n])


class ShardedStore(_ZeroStore):
    """ZeRO by group (``collectives="group"``): see the module docstring."""

    def __init__(self, layout: ChunkLayout, *, device: torch.device, dtype: torch.dtype, link: Link, comm: Comm,
                 copies: CopyEngine | None = None, **tiers):
        """``tiers``: ``os_on_disk`` and ``disk``, as ``ChunkStore`` takes them (this rank's file)."""
        if layout.chunk_size % comm.world:
            raise ValueError(f"a group of {layout.chunk_size} elements does not split into {comm.world} shards")
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.shard = layout.chunk_size // comm.world
        self.packed_shards = comm.world       # (an NF4 group lands as its ranks' packed shards)
        super().__init__(layout, device=device, dtype=dtype, link=link, home_numel=self.shard, copies=copies,
                         **tiers)
        self._make_device_grads()

    def _mine(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.rank * self.shard:(self.rank + 1) * self.shard]

    def _pieces(self, entry: TensorEntry) -> Iterator[tuple[int, int, int, int]]:
        return own_pieces(entry, self.shard, self.rank)

    def home_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        out = []
        for off, n in ranges:
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((a - lo, b - a))
        return out

    def gather_into(self, c: int, buf: torch.Tensor, *, async_op: bool = False, copy=None):
        """All-gather group ``c`` in place into ``buf``: this rank's shard crosses its link first.
        An NF4 group's shards are packed bytes, gathered one after another at the start of ``buf``
        (``land`` dequantizes them)."""
        if self.packed(c):
            each = self.host_packed_pool.slot_bytes
            out = buf.view(torch.uint8)[:self.world * each]
            self._copy("h2d", copy)(out[self.rank * each:(self.rank + 1) * each], self.host_param[c])
            return self.comm.all_gather(out, async_op=async_op)
        self._own_shard(c, self._mine(buf), copy)
        return self.comm.all_gather(buf, async_op=async_op)

    def reduce_into_home(self, c: int, buf: torch.Tensor, acc: torch.Tensor | None = None, copy=None) -> None:
        """Reduce-scatter group ``c`` in place (the sum of this rank's shard lands on its part of
        ``buf``), then that shard goes home."""
        mine = self._mine(buf)
        self.comm.reduce_scatter(mine, buf)
        self._to_home(c, mine, acc, copy)


class OwnedChunkStore(_ZeroStore):
    """ZeRO with per-chunk collectives (PatrickStar's memory-saving choice for many ranks): the unit
    is one chunk, owned by rank ``c % world``, which alone keeps its home (host copy, fp32 master,
    Adam states) and updates it. Fetching a chunk broadcasts it from its owner (only the owner's
    link carries it); its gradients are reduced to the owner, which writes them home. The device
    never holds more than the chunks in use: no group-sized buffer."""

    def __init__(self, layout: ChunkLayout, *, device: torch.device, dtype: torch.dtype, link: Link, comm: Comm,
                 copies: CopyEngine | None = None, **tiers):
        """``tiers``: ``os_on_disk`` (chunks this rank owns) and ``disk``, as ``ChunkStore`` takes them."""
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.shard = layout.chunk_size
        super().__init__(layout, device=device, dtype=dtype, link=link, copies=copies,
                         homes=frozenset(c for c in range(layout.num_chunks) if c % comm.world == comm.rank),
                         **tiers)
        self._make_device_grads()

    def owner(self, c: int) -> int:
        return c % self.world

    def _pieces(self, entry: TensorEntry) -> Iterator[tuple[int, int, int, int]]:
        return own_pieces(entry, 0, self.rank, per_chunk_world=self.world)

    def gather_into(self, c: int, buf: torch.Tensor, *, async_op: bool = False, copy=None):
        """Broadcast chunk ``c`` from its owner, which fills ``buf`` from its home first (an NF4
        chunk: its packed bytes, at the start of ``buf``)."""
        target = self.fetch_target(c, buf)
        if self.owner(c) == self.rank:
            self._own_shard(c, target, copy)
        return self.comm.broadcast(target, self.owner(c), async_op=async_op)

    def reduce_into_home(self, c: int, buf: torch.Tensor, acc: torch.Tensor | None = None, copy=None) -> None:
        """Reduce chunk ``c`` to its owner, which sends the sum home."""
        self.comm.reduce(buf, self.owner(c))
        if self.owner(c) == self.rank:
            self._to_home(c, buf, acc, copy)

    def restore_from_master(self, c: int) -> None:
        if self.owns(c):
            super().restore_from_master(c)
        else:
            self.dirty[c] = False
            self.drop(c)
