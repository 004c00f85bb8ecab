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

Each memory node carries a ``MemOp`` in its pscompile metadata (``mem``): which chunk, which slot,
the tiers, and the bytes it moves. The executor counts what actually moves against these numbers.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from pscompile.graph.meta import get as get_meta
from pscompile.kinds import MemKind

# The engine that performs memory ops called from compiled code (``memory_runner``): scoped to one
# call of a compiled program, like a dispatch mode, and empty otherwise (the ops then run as above).
_RUNNER: ContextVar[Optional[Callable[..., Any]]] = ContextVar("pscompile_memory_runner", default=None)


@contextmanager
def memory_runner(call: Callable[..., Any]):
    """Inside, every ``pscompile::`` memory op calls ``call(op, args)`` instead of its own body
    (``compiled/whole.py``: the compiled program's memory nodes go to the engine)."""
    token = _RUNNER.set(call)
    try:
        yield
    finally:
        _RUNNER.reset(token)


# The ops' library: each op defined with ``Library.define`` (its schema inferred from the function, as
# ``torch.library.custom_op`` would) and one CompositeExplicitAutograd kernel. Not ``custom_op``:
# a compiled program calls one op per memory node, and custom_op's autograd and ADInplaceOrView
# layers, run in Python, cost about ten times the dispatcher's own call (``docs/design.md``).
# The ops are never differentiated (the captured graph is already the joint graph) and nothing
# autograd saved reads the buffers they write, so those layers have nothing to do here.
_LIB = torch.library.Library("pscompile", "DEF")


def _no_value(*args, **kwargs) -> None:
    return None


def _op(name: str, mutates_args: tuple[str, ...] = ()):
    """Decorator: define ``pscompile::name`` from ``fn``'s signature, ``fn`` its routed body
    (``_routed``); an op that returns nothing gets its fake implementation here, and an op that
    mutates its own kernel under functionalization (``_in_place_under_functionalization``)."""
    def wrap(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, _routed(name)(fn), "CompositeExplicitAutograd")
        if inspect.signature(fn).return_annotation in (None, "None"):
            torch.library.register_fake(f"pscompile::{name}", _no_value, lib=_LIB)
        if mutates_args:
            _LIB.impl(name, _in_place_under_functionalization(name), "Functionalize")
        return fn
    return wrap


def _in_place_under_functionalization(op_name: str):
    """The op's Functionalize kernel: it stays an in-place call on the real buffers.

    A compiled program's compute is functionalized (``compiled/whole.py``: Inductor orders only
    what it sees as data flow, and an in-place op on an intermediate, such as dropout's
    ``bernoulli_``, can be read before it ran). The memory ops must still write the real slots and
    host chunks, not functional copies of them, so under functionalization they are performed on
    the unwrapped tensors (each synced first), as they were written: the traced graph keeps them
    as calls of these ops, with the mutations their schemas declare."""
    import torch.utils._pytree as pytree
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)

    def unwrap(t: Tensor) -> Tensor:
        if not torch._is_functional_tensor(t):
            return t
        torch._sync(t)
        return torch._from_functional_tensor(t)

    def kernel(*args, **kwargs):
        args, kwargs = pytree.tree_map_only(Tensor, unwrap, (args, kwargs))
        with torch._C._ExcludeDispatchKeyGuard(below):
            return getattr(torch.ops.pscompile, op_name).default(*args, **kwargs)
    return kernel


def _fake(name: str):
    """Decorator: ``fn`` is the fake implementation of ``pscompile::name`` (shapes, no data)."""
    def wrap(fn):
        torch.library.register_fake(f"pscompile::{name}", fn, lib=_LIB)
        return fn
    return wrap


def _routed(op_name: str):
    """Decorator: the op's body runs only when no runner is set; else the runner performs it."""
    def wrap(fn):
        sig = inspect.signature(fn)
        op: list = []            # the op's overload, looked up once (it exists only after registration)

        def body(*args, **kwargs):
            run = _RUNNER.get()
            if run is None:
                return fn(*args, **kwargs)
            if kwargs:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                args = bound.args
            if not op:
                op.append(getattr(torch.ops.pscompile, op_name).default)
            return run(op[0], args)
        functools.update_wrapper(body, fn)
        body.__signature__ = sig
        return body
    return wrap


@_op("fetch", mutates_args=("slot",))
def fetch(slot: Tensor, host: Tensor) -> None:
    slot.copy_(host)


@_op("writeback", mutates_args=("host",))
def writeback(host: Tensor, slot: Tensor) -> None:
    host.copy_(slot)


@_op("disk_read")
def disk_read(host: Tensor) -> None:
    return None               # (eager: the host chunk is the home; the engine reads a disk home ahead)


@_op("update")
def update(host: Tensor) -> None:
    return None               # (eager: the engine starts the chunk's update on its host thread)


@_op("drop")
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


@_op("store_grad", mutates_args=("dest",))
def store_grad(dest: Tensor, grad: Tensor, offset: int, start: int = 0, numel: int = -1) -> None:
    copy_grad_into(dest, grad, offset, start, numel)


@_op("wait")
def wait(slot: Tensor) -> None:
    return None


@_op("wait_grad")
def wait_grad(grad: Tensor) -> None:
    """The copy of ``grad`` an asynchronous accumulate_grad started has landed (the executor
    waits); as an argument, the gradient stays alive until here."""
    return None


@_op("accumulate_grad", mutates_args=("acc",))
def accumulate_grad(acc: Tensor, grad: Tensor, offset: int, start: int = 0, numel: int = -1) -> None:
    _into(acc, grad, offset, start, numel, "add_")


def _shard(t: Tensor, rank: int, world: int) -> Tensor:
    n = t.numel() // world
    return t[rank * n:(rank + 1) * n]


def _distributed(world: int) -> bool:
    import torch.distributed as dist
    return world > 1 and dist.is_available() and dist.is_initialized()


@_op("allgather", mutates_args=("slot",))
def allgather(slot: Tensor, host: Tensor, rank: int, world: int) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    _shard(slot, rank, world).copy_(host)
    if _distributed(world):
        import torch.distributed as dist
        dist.all_gather_into_tensor(slot, _shard(slot, rank, world).clone())


@_op("release_remote")
def release_remote(slot: Tensor) -> None:
    return None


@_op("reduce_scatter", mutates_args=("dest", "slot"))
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


@_op("broadcast", mutates_args=("slot",))
def broadcast(slot: Tensor, host: Tensor, owner: int, rank: int) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    if rank == owner:
        slot.copy_(host)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(slot, src=owner)


@_op("reduce", mutates_args=("dest", "slot"))
def reduce(dest: Tensor, slot: Tensor, owner: int, rank: int, accumulate: bool) -> None:
    """Eagerly on the default process group (the executor runs it on the engine's group)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.reduce(slot, dst=owner)
    if rank == owner:
        dest.add_(slot) if accumulate else dest.copy_(slot)


@_op("offload")
def offload(value: Tensor) -> Tensor:
    host = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")
    return host.copy_(value)


@_fake("offload")
def _(value):
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cpu")


@_op("reload")
def reload(host: Tensor, device: torch.device) -> Tensor:
    value = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return value.copy_(host)


@_fake("reload")
def _(host, device):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@_op("wait_copy")
def wait_copy(copy: Tensor, source: Optional[Tensor] = None) -> None:
    return None


ACTIVATION_OPS = (torch.ops.pscompile.offload.default, torch.ops.pscompile.reload.default,
                  torch.ops.pscompile.wait_copy.default)
torch.fx.has_side_effect(torch.ops.pscompile.wait_copy.default)

MEMORY_OPS = (torch.ops.pscompile.fetch.default, torch.ops.pscompile.writeback.default,
              torch.ops.pscompile.drop.default, torch.ops.pscompile.store_grad.default,
              torch.ops.pscompile.wait.default, torch.ops.pscompile.accumulate_grad.default,
              torch.ops.pscompile.allgather.default, torch.ops.pscompile.release_remote.default,
              torch.ops.pscompile.reduce_scatter.default, torch.ops.pscompile.broadcast.default,
              torch.ops.pscompile.reduce.default, torch.ops.pscompile.wait_grad.default,
              torch.ops.pscompile.disk_read.default, torch.ops.pscompile.update.default)
for _op in MEMORY_OPS:
    torch.fx.has_side_effect(_op)


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

    def describe(self) -> str:
        if self.kind == MemKind.WAIT:
            return f"wait: the copy of activation {self.value} has landed"
        way = "device->host" if self.kind == MemKind.OFFLOAD else "host->device"
        return f"{self.kind} activation {self.value} ({way}, {self.nbytes} B){' async' if self.asynchronous else ''}"


def is_memory_node(node: torch.fx.Node) -> bool:
    """A chunk memory node (fetch, writeback, drop, gradient stores, collectives)."""
    return node.op == "call_function" and node.target in MEMORY_OPS


def is_activation_node(node: torch.fx.Node) -> bool:
    """An offload or reload of a saved activation."""
    return node.op == "call_function" and node.target in ACTIVATION_OPS


def mem_op(node: torch.fx.Node) -> MemOp | None:
    """What memory node ``node`` does (its ``mem`` metadata); None for any other node."""
    return get_meta(node, "mem")


def activation_move(node: torch.fx.Node) -> ActivationMove | None:
    """What offload, reload or wait_copy node ``node`` does (its ``moves`` metadata); None otherwise."""
    return get_meta(node, "moves")


def is_offload(node: torch.fx.Node) -> bool:
    """An offload: its value is a host copy (no device bytes)."""
    return node.op == "call_function" and node.target is torch.ops.pscompile.offload.default


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
    return node.op == "call_function" and (node.target in MEMORY_OPS or node.target in ACTIVATION_OPS)
