"""Memory operations as ``torch.library`` ops (namespace ``pscompile::``).

They take the buffers they read and write, declare what they mutate, have fake implementations,
and are registered with ``torch.fx.has_side_effect`` (they return nothing), so a scheduled graph
is an ordinary FX graph: it prints, runs eagerly, and passes to torch.compile.

    fetch(slot!, host)                 slot <- host            one chunk, host -> device
    writeback(host!, slot)             host <- slot            a dirty chunk goes home before its slot is reused
    drop(slot)                         (nothing moves)         the slot's chunk is no longer on the device
    disk_read(host)                    staging <- disk         a chunk homed on disk is read into a host
                                                               staging buffer, ahead of its fetch (the
                                                               fetch then copies from there)
    update(host)                       (on the host)           the chunk's gradients are final at home:
                                                               its AdamW update starts on a host thread
                                                               while the backward goes on
    store_grad(dest!, grad, offset, start=0, numel=-1)
                                       dest[offset:] <- grad   a gradient overwrites its parameter's chunk space
                                                               (a page: elements start.. of the flattened
                                                               gradient, ``numel`` of them, for a tensor
                                                               that spans chunks)
    wait(slot)                         (nothing moves)         an asynchronous fetch into slot has landed
    accumulate_grad(acc!, grad, offset, start=0, numel=-1)
                                       acc[offset:] += grad    a micro-batch's gradient (or one page of it)
                                                               is added into its chunk's fp32 accumulation
                                                               buffer on the host (asynchronous: the copy
                                                               runs on while compute goes on)
    wait_grad(grad)                    (nothing moves)         an asynchronous accumulate_grad of grad has
                                                               landed; grad lives until here

ZeRO (a slot holds a communication group of ``world`` chunks; rank r owns shard r):

    allgather(slot!, host, rank, world)          slot[r] <- host, slot[others] <- their owners
    release_remote(slot)                         (nothing moves)  the gathered group leaves the device
    reduce_scatter(dest!, slot, rank, world, accumulate)
                                                 dest (<- or +=) sum over ranks of slot[r]

ZeRO per chunk (a slot holds one chunk, owned by rank ``owner``):

    broadcast(slot!, host, owner, rank)          slot <- the owner's host copy, on every rank
    reduce(dest!, slot, owner, rank, accumulate) on the owner: dest (<- or +=) sum over ranks of slot

Activations (a saved forward value leaves the device and comes back for the backward):

    offload(value) -> host             a host copy of a saved activation; the device copy dies
    reload(host, device) -> value      a device copy of an offloaded activation, back for the backward
    wait_copy(copy, source=None)       an asynchronous offload or reload into ``copy`` has landed
                                       (``source``, an offload's device value, lives until here)

Unlike the chunk ops they return tensors (new buffers, never aliases), so they stay in the graph
while they have users; ``is_activation_node`` tells them apart and their ``moves`` metadata is an
``ActivationMove``.

Run eagerly, every op completes at once (``wait`` does nothing); the executor runs a fetch that
has a ``wait`` asynchronously (prefetch) and blocks at the ``wait``.

**Each op is declared once** (``declare``, an ``OpDecl`` in ``DECLS``): its eager body, from which
its schema is inferred, its fake, its kind, the link its bytes cross, what it does to residency
(arrives, leaves, reduces, waits), the engine's handler and the verifier's check that it names,
its listing (tier, comment, plot marker) and its Inductor properties (a side effect, or a new
buffer on the device or the host). The verifier, the engine, the listing, the planner's cost
model and the reader of Inductor's buffer plan all consult the declaration; adding an op means
declaring it here, naming its kind in ``MemKind``, and emitting it in the pass that inserts it
(plus, if it does something new, the handler and the check it names).

Each memory node carries a ``MemOp`` in its pscompile metadata (``mem``): which chunk, which slot,
the tiers, and the bytes it moves. The executor counts what actually moves against these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from pscompile.graph.declare import DECLS, OpDecl, declare, memory_runner  # noqa: F401 - memory_runner re-exported
from pscompile.graph.meta import get as get_meta
from pscompile.kinds import MemKind
from pscompile.units import format_bytes


def _early(mem) -> str:
    return ", started early (async)" if mem.asynchronous else ""


def _fetch_comment(mem, n) -> str:
    return (f"fetch chunk {mem.chunk} -> slot {mem.slot} ({mem.src}->{mem.dst}), "
            f"{format_bytes(mem.nbytes)}{_early(mem)}")


@declare("fetch", MemKind.FETCH, mutates=("slot",), handler="_mem_fetch", check="arrive", link="h2d",
         arrives=True, mark=("^", "tab:green", "fetch"), comment=_fetch_comment)
def fetch(slot: Tensor, host: Tensor) -> None:
    slot.copy_(host)


@declare("writeback", MemKind.WRITEBACK, mutates=("host",), handler="_mem_writeback", check="writeback",
         link="d2h", mark=("s", "tab:purple", "writeback"),
         comment=lambda mem, n: (f"writeback chunk {mem.chunk} <- slot {mem.slot} ({mem.src}->{mem.dst}), "
                                 f"{format_bytes(mem.nbytes)}"))
def writeback(host: Tensor, slot: Tensor) -> None:
    host.copy_(slot)


@declare("disk_read", MemKind.DISK_READ, handler="_mem_disk_read", check="disk_read", link="disk")
def disk_read(host: Tensor) -> None:
    return None               # (eager: the host chunk is the home; the engine reads a disk home ahead)


@declare("update", MemKind.UPDATE, handler="_mem_update", check="update",
         comment=lambda mem, n: (f"update chunk {mem.chunk}: its AdamW step starts on a host thread while "
                                 f"the backward goes on, {format_bytes(mem.nbytes)} moved"))
def update(host: Tensor) -> None:
    return None               # (eager: the engine starts the chunk's update on its host thread)


@declare("drop", MemKind.DROP, handler="_mem_leave", check="leave", leaves=True, tier="device (evict)",
         mark=("v", "tab:red", "evict (drop)"),
         comment=lambda mem, n: (f"evict chunk {mem.chunk} from slot {mem.slot} (device, slot freed), "
                                 f"{format_bytes(mem.nbytes)} moved"))
def drop(slot: Tensor) -> None:
    return None


def flat_pieces(t: Tensor, start: int = 0, numel: int = -1) -> list[tuple[Tensor, int]]:
    """Views of ``t`` that cover elements ``start .. start + numel`` of its row-major flattening,
    each with its offset inside that range (``numel=-1``: to the end). A strided tensor is covered
    without a temporary: a partial row, whole rows, a partial row, recursively by dimension."""
    total = t.numel()
    numel = total - start if numel < 0 else numel
    if numel == 0:
        return []
    if start == 0 and numel == total:
        return [(t, 0)]
    if t.dim() <= 1:
        return [(t.reshape(-1)[start:start + numel], 0)]
    row = total // t.shape[0]
    out: list[tuple[Tensor, int]] = []
    pos, end = start, start + numel
    while pos < end:
        r, inner = divmod(pos, row)
        if inner or end - pos < row:            # a part of one row
            take = min(row - inner, end - pos)
            out.extend((v, o + pos - start) for v, o in flat_pieces(t[r], inner, take))
        else:                                   # whole rows
            rows = (end - pos) // row
            out.append((t[r:r + rows], pos - start))
            take = rows * row
        pos += take
    return out


def _into(dest: Tensor, grad: Tensor, offset: int, start: int, numel: int, op: str) -> None:
    for piece, at in flat_pieces(grad, start, numel):    # strided grads: no temporary
        target = dest.narrow(0, offset + at, piece.numel()).view(piece.shape)
        getattr(target, op)(piece)


def copy_grad_into(dest: Tensor, grad: Tensor, offset: int, start: int = 0, numel: int = -1) -> None:
    """What ``store_grad`` does, as a plain function: an eager region calls it in place of the op
    (``folds_into_region``)."""
    _into(dest, grad, offset, start, numel, "copy_")


def _store_comment(mem, n) -> str:
    grad = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], torch.fx.Node) else None
    val = grad.meta.get("val") if grad is not None else None
    size = f"grad {format_bytes(val.numel() * val.element_size())}, " if isinstance(val, Tensor) else ""
    where = f"slot {mem.slot}" if mem.slot is not None else "its host copy"
    return (f"store_grad {mem.fqn} -> chunk {mem.chunk} in {where} ({mem.src}->{mem.dst}), "
            f"{size}{format_bytes(mem.nbytes)} moved")


@declare("store_grad", MemKind.STORE_GRAD, mutates=("dest",), handler="_mem_store_grad", check="store",
         link="d2h", comment=_store_comment)
def store_grad(dest: Tensor, grad: Tensor, offset: int, start: int = 0, numel: int = -1) -> None:
    copy_grad_into(dest, grad, offset, start, numel)


@declare("wait", MemKind.WAIT, handler="_mem_wait", check="wait", waits=True, tier="host->device (wait)",
         mark=("|", "tab:gray", "wait"),
         comment=lambda mem, n: (f"wait for {'group' if mem.world > 1 else 'chunk'} {mem.chunk} in slot "
                                 f"{mem.slot} (prefetched), 0 B"))
def wait(slot: Tensor) -> None:
    return None


@declare("wait_grad", MemKind.WAIT, handler="_mem_grad_landed", check="grad_landed", waits=True,
         tier="device->host (wait)", mark=("|", "tab:olive", "wait (gradient copy)"),
         comment=lambda mem, n: (f"wait for the copy of {mem.fqn}'s gradient to chunk {mem.chunk}'s "
                                 "accumulation buffer (then freed), 0 B"))
def wait_grad(grad: Tensor) -> None:
    """The copy of ``grad`` an asynchronous accumulate_grad started has landed (the executor
    waits); as an argument, the gradient stays alive until here."""
    return None


@declare("accumulate_grad", MemKind.ACCUMULATE_GRAD, mutates=("acc",), handler="_mem_accumulate",
         check="accumulate", link="d2h",
         comment=lambda mem, n: (f"accumulate_grad {mem.fqn} += into the fp32 accumulation buffer of chunk "
                                 f"{mem.chunk} ({mem.src}->{mem.dst}), {format_bytes(mem.nbytes)} moved"
                                 + (", async: the gradient lives until its wait" if mem.asynchronous else "")))
def accumulate_grad(acc: Tensor, grad: Tensor, offset: int, start: int = 0, numel: int = -1) -> None:
    _into(acc, grad, offset, start, numel, "add_")


def _shard(t: Tensor, rank: int, world: int) -> Tensor:
    n = t.numel() // world
    return t[rank * n:(rank + 1) * n]


def _distributed(world: int) -> bool:
    import torch.distributed as dist
    return world > 1 and dist.is_available() and dist.is_initialized()


@declare("allgather", MemKind.ALLGATHER, mutates=("slot",), handler="_mem_gather", check="arrive", link="h2d",
         comm="alongside", arrives=True, mark=("^", "tab:cyan", "allgather"),
         comment=lambda mem, n: (f"allgather group {mem.chunk} -> slot {mem.slot}: own shard host->device "
                                 f"{format_bytes(mem.nbytes)}, {format_bytes(mem.comm_bytes)} from ranks "
                                 f"0-{mem.world - 1}{_early(mem)}"))
def allgather(slot: Tensor, host: Tensor, rank: int, world: int) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    _shard(slot, rank, world).copy_(host)
    if _distributed(world):
        import torch.distributed as dist
        dist.all_gather_into_tensor(slot, _shard(slot, rank, world).clone())


@declare("release_remote", MemKind.RELEASE_REMOTE, handler="_mem_leave", check="leave", leaves=True,
         tier="device (release remote)", mark=("v", "tab:pink", "release_remote"),
         comment=lambda mem, n: (f"release group {mem.chunk} from slot {mem.slot} (remote shards dropped, "
                                 "slot freed), 0 B moved"))
def release_remote(slot: Tensor) -> None:
    return None


def _reduce_scatter_comment(mem, n) -> str:
    where = "added into its fp32 accumulation shard" if mem.dst == "acc" else "to its host shard"
    return (f"reduce_scatter group {mem.chunk} in slot {mem.slot}: sum over ranks 0-{mem.world - 1}, "
            f"{format_bytes(mem.comm_bytes)} sent, own shard {where}, {format_bytes(mem.nbytes)}")


@declare("reduce_scatter", MemKind.REDUCE_SCATTER, mutates=("dest", "slot"), handler="_mem_reduce",
         check="reduce", link="d2h", comm="before", reduces=True, mark=("D", "tab:olive", "reduce_scatter"),
         comment=_reduce_scatter_comment)
def reduce_scatter(dest: Tensor, slot: Tensor, rank: int, world: int, accumulate: bool) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    mine = _shard(slot, rank, world).clone()
    if _distributed(world):
        import torch.distributed as dist
        dist.reduce_scatter_tensor(mine, slot.clone())
    if accumulate:
        dest.add_(mine)
    else:
        dest.copy_(mine)


@declare("broadcast", MemKind.BROADCAST, mutates=("slot",), handler="_mem_gather", check="arrive", link="h2d",
         comm="alongside", arrives=True, mark=("^", "tab:blue", "broadcast"),
         comment=lambda mem, n: (f"broadcast chunk {mem.chunk} -> slot {mem.slot} from its owner rank "
                                 f"{mem.chunk % mem.world} ({mem.src}->device), link {format_bytes(mem.nbytes)}, "
                                 f"{format_bytes(mem.comm_bytes)} received{_early(mem)}"))
def broadcast(slot: Tensor, host: Tensor, owner: int, rank: int) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    if rank == owner:
        slot.copy_(host)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(slot, src=owner)


@declare("reduce", MemKind.REDUCE, mutates=("dest", "slot"), handler="_mem_reduce", check="reduce", link="d2h",
         comm="before", reduces=True, mark=("D", "tab:brown", "reduce"),
         comment=lambda mem, n: (f"reduce chunk {mem.chunk} in slot {mem.slot} to its owner rank "
                                 f"{mem.chunk % mem.world} (-> {mem.dst}), {format_bytes(mem.comm_bytes)} sent, "
                                 f"link {format_bytes(mem.nbytes)}"))
def reduce(dest: Tensor, slot: Tensor, owner: int, rank: int, accumulate: bool) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.reduce(slot, dst=owner)
    if rank == owner:
        dest.add_(slot) if accumulate else dest.copy_(slot)


def _host_like(value, *rest):
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")


@declare("offload", MemKind.OFFLOAD, fake=_host_like, handler="_offload", link="d2h", activation=True,
         returns="host")
def offload(value: Tensor) -> Tensor:
    return _host_like(value).copy_(value)


def _device_like(host, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@declare("reload", MemKind.RELOAD, fake=_device_like, handler="_reload", link="h2d", activation=True,
         returns="device")
def reload(host: Tensor, device: torch.device) -> Tensor:
    return _device_like(host, device).copy_(host)


@declare("wait_copy", MemKind.WAIT, handler="_copy_landed", waits=True, activation=True)
def wait_copy(copy: Tensor, source: Optional[Tensor] = None) -> None:
    return None


ACTIVATION_OPS = tuple(d.op for d in DECLS.values() if d.activation)
MEMORY_OPS = tuple(d.op for d in DECLS.values() if not d.activation)
_BY_OP = {d.op: d for d in DECLS.values()}


def decl_of(node: torch.fx.Node) -> OpDecl | None:
    """The declaration of the memory op ``node`` calls; None for any other node."""
    return _BY_OP.get(node.target) if node.op == "call_function" else None


def decl_for(kind: MemKind, *, slot: int | None = 0, activation: bool = False) -> OpDecl:
    """The declaration of the op that performs a plan action (or a node's MemOp / ActivationMove)
    of ``kind``: every kind but WAIT names its op; a WAIT waits for a fetch into a slot, a
    gradient's copy (no slot) or an activation's copy."""
    if kind is MemKind.WAIT:
        return DECLS["wait_copy" if activation else "wait" if slot is not None else "wait_grad"]
    return DECLS[kind.value]


@dataclass(frozen=True)
class MemOp:
    """What one memory node does, for printing, verification and accounting."""

    kind: MemKind
    chunk: int
    slot: int | None     # device slot index (None: store_grad into a chunk on the host, accumulate_grad)
    src: str             # tier read: "host" | "device" | "-"
    dst: str             # tier written
    nbytes: int          # bytes copied between tiers (0 for drop and device-side store_grad)
    fqn: str | None = None  # store_grad, accumulate_grad: the parameter
    asynchronous: bool = False  # fetch: started early (prefetch); a wait node marks where it must have landed
    comm_bytes: int = 0  # allgather: bytes received from the other ranks; reduce_scatter: bytes sent
    world: int = 1       # ranks the chunk (a communication group) is sharded over
    op: str = field(default="", compare=False, repr=False)   # the declared op's name (``decl_for``)

    def __post_init__(self):
        if not self.op:
            object.__setattr__(self, "op", decl_for(self.kind, slot=self.slot).name)

    @property
    def decl(self) -> OpDecl:
        return DECLS[self.op]

    def describe(self) -> str:
        if self.kind == MemKind.UPDATE:
            return f"update chunk {self.chunk} (its AdamW step starts on the host, the backward goes on)"
        where = f"slot {self.slot}" if self.slot is not None else "host"
        extra = f" {self.fqn}" if self.fqn else (" async" if self.asynchronous else "")
        unit = "group" if self.world > 1 else "chunk"
        comm = f", {self.comm_bytes} B with ranks 0-{self.world - 1}" if self.comm_bytes else ""
        return f"{self.kind} {unit} {self.chunk} ({self.src}->{self.dst}, {where}, {self.nbytes} B{comm}){extra}"


@dataclass(frozen=True)
class ActivationMove:
    """What one offload, reload or wait_copy node does: the saved value (by its captured name), its
    bytes, and whether the copy runs while compute goes on (a ``wait_copy`` marks where it must
    have landed)."""

    kind: MemKind        # OFFLOAD (device -> host), RELOAD (host -> device), or WAIT (a copy has landed)
    value: str           # the captured graph's node whose storage moves
    nbytes: int
    asynchronous: bool = False
    op: str = field(default="", compare=False, repr=False)   # the declared op's name (``decl_for``)

    def __post_init__(self):
        if not self.op:
            object.__setattr__(self, "op", decl_for(self.kind, activation=True).name)

    @property
    def decl(self) -> OpDecl:
        return DECLS[self.op]

    def describe(self) -> str:
        if self.kind == MemKind.WAIT:
            return f"wait: the copy of activation {self.value} has landed"
        way = "device->host" if self.kind == MemKind.OFFLOAD else "host->device"
        return f"{self.kind} activation {self.value} ({way}, {self.nbytes} B){' async' if self.asynchronous else ''}"


def is_memory_node(node: torch.fx.Node) -> bool:
    """A chunk memory node (fetch, writeback, drop, gradient stores, collectives)."""
    d = decl_of(node)
    return d is not None and not d.activation


def is_activation_node(node: torch.fx.Node) -> bool:
    """An offload or reload of a saved activation."""
    d = decl_of(node)
    return d is not None and d.activation


def mem_op(node: torch.fx.Node) -> MemOp | None:
    """What memory node ``node`` does (its ``mem`` metadata); None for any other node."""
    return get_meta(node, "mem")


def activation_move(node: torch.fx.Node) -> ActivationMove | None:
    """What offload, reload or wait_copy node ``node`` does (its ``moves`` metadata); None otherwise."""
    return get_meta(node, "moves")


def is_offload(node: torch.fx.Node) -> bool:
    """An offload: its value is a host copy (no device bytes)."""
    d = decl_of(node)
    return d is not None and d.returns == "host"


def folds_into_region(node: torch.fx.Node) -> bool:
    """A ``store_grad`` into a device slot: a copy inside device memory that moves no bytes, which
    an eager region can run in graph order (``copy_grad_into``) instead of the executor stopping
    for it. The engine still marks the chunk dirty and the parameter written."""
    if node.op != "call_function" or node.target is not torch.ops.pscompile.store_grad.default:
        return False
    mem = mem_op(node)
    return mem is not None and mem.slot is not None


def runs_as_transfer(node: torch.fx.Node) -> bool:
    """Memory and activation nodes: the executor hands them to the engine, never to a compiled region."""
    return decl_of(node) is not None
