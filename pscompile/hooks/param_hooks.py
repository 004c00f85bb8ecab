"""The hooks of hooks mode: what a module's forward, an autograd node's unpacking of a saved
parameter and a parameter's accumulated gradient do to the chunks (PatrickStar's access and release
of parameters), and the state one forward+backward pass keeps between them.

``ParamHooks`` is a mixin of ``HooksEngine`` (``hooks/engine.py``), which owns the moments (what a
hook's access makes resident or evicts), the passes and the step; the hooks only name the chunks
they need and move gradients into their chunks.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pscompile.hooks.access_plan import AccessPlan, Moment
from pscompile.hooks.states import TensorState
from pscompile.kinds import MomentKind
from pscompile.memory.disk_homes import DiskAccumulation
from pscompile.memory.tracker import NonModelTracker


@dataclass(frozen=True)
class _ViewRef:
    """Where a saved-for-backward parameter view lies: what it is a view of, and its layout."""

    of: int | str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of_tensor(cls, of: int | str, t: torch.Tensor) -> "_ViewRef":
        return cls(of, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class _ChunkRef(_ViewRef):
    """A view of one chunk (``of``: the chunk), kept as a reference instead of the memory."""

    @property
    def chunk(self) -> int:
        return self.of


class _SpanRef(_ViewRef):
    """A view of a parameter that spans several chunks (``of``: its name; gathered again)."""

    @property
    def fqn(self) -> str:
        return self.of


class _Saved:
    """A non-parameter tensor an autograd node saved in a pass. Returned as the tensor itself, a
    node saving its own output would hold that output, whose ``grad_fn`` is the node: a cycle
    through C++ that the garbage collector cannot see, so a graph whose backward never ran (a
    loss that raised) would keep its activations and the engine alive for good. The pass clears
    every ``_Saved`` still alive when it ends, which breaks the cycle."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


def _weak(method):
    """A hook that calls ``method`` while its object lives: hooks stored on the model's tensors
    and modules must not keep the engine (and all its chunks) alive."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


@dataclass
class PassState:
    """Mutable state of one forward+backward pass (trace or run)."""

    tracing: bool
    tracker: NonModelTracker
    plan: AccessPlan | None = None
    moment: int = 0
    recorded: list[Moment] = field(default_factory=list)
    pins: Counter = field(default_factory=Counter)
    bwd_node: Any = None
    bwd_chunks: list[int] = field(default_factory=list)
    grad_written: set[str] = field(default_factory=set)
    acc: list[torch.Tensor] | None = None    # fp32 host chunks accumulating gradients (micro-batches)
    span_bufs: dict[int, str] = field(default_factory=dict)      # gathered buffer ptr -> fqn (forward)
    grads_left: dict[int, int] = field(default_factory=dict)     # ZeRO: group -> gradients still to come
    bwd_spans: dict[str, torch.Tensor] = field(default_factory=dict)  # re-gathered for this backward node
    saved: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the _Saved the graph still holds
    replay_node: Any = None          # the backward node whose unpacking replays a checkpointed forward
    replayed: list[tuple[tuple[int, ...], list[str]]] = field(default_factory=list)  # its (chunks, params) held



class ParamHooks:
    """Installs the hooks and handles them (see the module docstring)."""

    def _install_hooks(self) -> list:
        handles = []
        pre, post, grad = _weak(self._pre_forward), _weak(self._post_forward), _weak(self._grad_hook)
        for name, mod in self.model.named_modules(remove_duplicate=False):
            if name not in self._module_params:
                continue
            fqns = self._module_params[name]
            handles.append(mod.register_forward_pre_hook(lambda m, args, n=name, f=fqns: pre(n, f)))
            handles.append(mod.register_forward_hook(lambda m, args, out, n=name, f=fqns: post(n, f)))
        for p in self.params.values():
            if p.requires_grad:       # frozen parameters get no gradient and no update
                handles.append(p.register_post_accumulate_grad_hook(grad))
        return handles

    def _detach_from_model(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ================================================================ forward hooks
    def _materialize(self, fqn: str) -> torch.Tensor:
        e = self.layout.entry(fqn)
        if not e.spans:
            p = e.pieces[0]
            return self.store.dev_param[p.chunk][p.chunk_offset:p.chunk_offset + p.numel].view(e.shape)
        return torch.cat([self.store.dev_param[p.chunk][p.chunk_offset:p.chunk_offset + p.numel]
                          for p in e.pieces]).view(e.shape)

    def _pre_forward(self, name: str, fqns: list[str]) -> None:
        ps = self._pass
        if ps is None:
            return
        replay = torch._C._current_autograd_node()     # (set: activation checkpointing replays a forward)
        if replay is not None and replay is not ps.replay_node:
            self._release_replayed()
            ps.replay_node = replay
        need = self._chunks_of(fqns)
        self._moment(MomentKind.FWD, name, need)
        for c in need:
            ps.pins[c] += 1
        if replay is not None:
            ps.replayed.append((need, fqns))
        for f in fqns:
            self.states[f] = TensorState.COMPUTE
            value = self._materialize(f)
            if self.layout.entry(f).spans:
                ps.span_bufs[value.untyped_storage().data_ptr()] = f
            self.params[f].data = value

    def _post_forward(self, name: str, fqns: list[str]) -> None:
        ps = self._pass
        if ps is None:
            return
        if torch._C._current_autograd_node() is not None:     # a replay: held (``_release_replayed``)
            for f in fqns:
                self.states[f] = TensorState.HOLD_AFTER_FWD
            self._moment(MomentKind.FWD_RELEASE, name, ())
            return
        for f in fqns:
            if self.layout.entry(f).spans:
                ps.span_bufs.pop(self.params[f].untyped_storage().data_ptr(), None)
            self.params[f].data = self._released(self.params[f].shape)
            self.states[f] = TensorState.HOLD_AFTER_FWD
        for c in self._chunks_of(fqns):
            ps.pins[c] -= 1
        self._moment(MomentKind.FWD_RELEASE, name, ())

    # ================================================================ backward hooks
    def _pack(self, t: torch.Tensor):
        ps = self._pass
        if ps is None:
            return t
        if t.device == self.device:
            ptr = t.untyped_storage().data_ptr()
            c = self.store.chunk_of_storage(ptr)
            if c is not None:
                return _ChunkRef.of_tensor(c, t)
            fqn = ps.span_bufs.get(ptr)
            if fqn is not None:     # keep no gathered copy alive until backward: gather again there
                return _SpanRef.of_tensor(fqn, t)
        if t.grad_fn is None:       # (a leaf or a constant: no cycle through its node)
            return t
        saved = _Saved(t)
        ps.saved.add(saved)
        return saved

    def _unpack(self, ref):
        if isinstance(ref, _Saved):
            if ref.t is None:
                raise RuntimeError("hooks mode: a graph from a pass that has ended was run backward; call "
                                   "engine.step, which runs the forward and its backward in one pass")
            return ref.t
        if not isinstance(ref, (_ChunkRef, _SpanRef)):
            return ref
        ps = self._pass
        node = torch._C._current_autograd_node()
        if node is not ps.bwd_node:
            self._end_bwd_node()
            ps.bwd_node = node
        if isinstance(ref, _SpanRef):
            return self._unpack_span(ps, node, ref)
        if ref.chunk not in ps.bwd_chunks:
            self._moment(MomentKind.BWD, f"{type(node).__name__}:{ref.chunk}", (ref.chunk,))
            ps.bwd_chunks.append(ref.chunk)
            ps.pins[ref.chunk] += 1
        e = self.layout.entry_at(ref.chunk, ref.offset)
        if e is not None:
            self.states[e.fqn] = TensorState.COMPUTE
        buf = self.store.dev_param[ref.chunk]
        return buf.as_strided(ref.shape, ref.stride, ref.offset)

    def _unpack_span(self, ps: PassState, node, ref: _SpanRef) -> torch.Tensor:
        buf = ps.bwd_spans.get(ref.fqn)
        if buf is None:
            need = tuple(c for c in self.layout.entry(ref.fqn).chunks if c not in ps.bwd_chunks)
            if need:
                self._moment(MomentKind.BWD, f"{type(node).__name__}:{ref.fqn}", need)
                ps.bwd_chunks.extend(need)
                for c in need:
                    ps.pins[c] += 1
            self.states[ref.fqn] = TensorState.COMPUTE
            buf = ps.bwd_spans[ref.fqn] = self._materialize(ref.fqn).reshape(-1)
        return buf.as_strided(ref.shape, ref.stride, ref.offset)

    def _release_replayed(self) -> None:
        """Let go of the parameters a replayed forward used. Non-reentrant activation checkpointing
        (``torch.utils.checkpoint``) keeps what the replay saved for the region's backward nodes in
        its own hooks, not in ``_pack``'s references: a trainable parameter as a view of its chunk,
        a frozen one as the parameter itself, whatever its data is when the node runs. So a replay's
        parameters keep their data and their chunks stay pinned until the region's backward is
        over: the next event that is not the region's (a node unpacking through ``_unpack``, the
        replay of another region, the end of the backward). Nodes run one at a time in decreasing
        sequence number, so a node outside the region, created before it, runs after all of it."""
        ps = self._pass
        for need, fqns in ps.replayed:
            for c in need:
                ps.pins[c] -= 1
            for f in fqns:
                if self.layout.entry(f).spans:
                    ps.span_bufs.pop(self.params[f].untyped_storage().data_ptr(), None)
                self.params[f].data = self._released(self.params[f].shape)
                if self.states[f] is TensorState.COMPUTE:     # (a replay stopped early: no post-hook)
                    self.states[f] = TensorState.HOLD_AFTER_FWD
        ps.replayed = []
        ps.replay_node = None

    def _end_bwd_node(self) -> None:
        ps = self._pass
        self._release_replayed()
        ps.bwd_spans.clear()
        for c in ps.bwd_chunks:
            ps.pins[c] -= 1
            for e, _ in self.layout.chunk_members(c):
                if self.states[e.fqn] is TensorState.COMPUTE:
                    self.states[e.fqn] = TensorState.HOLD
        ps.bwd_chunks = []
        ps.bwd_node = None

    def _grad_hook(self, param: nn.Parameter) -> None:
        ps = self._pass
        if ps is None:
            return
        fqn = self._fqn_of[id(param)]
        if self.comm is not None:
            self._sharded_grad(ps, fqn, param)
            return
        self._take_grad(ps, fqn, param, lambda p, piece: self._home_grad_piece(ps, p, piece))
        self._moment(MomentKind.GRAD, fqn, ())

    def _take_grad(self, ps: PassState, fqn: str, param: nn.Parameter, write) -> None:
        """Hand each piece of ``param``'s gradient to ``write(piece_of_layout, values)`` (not while
        tracing), then forget the gradient."""
        grad = param.grad
        param.grad = None
        if grad is not None and not ps.tracing:
            flat = grad.reshape(-1)
            with ps.tracker.paused():
                for p in self.layout.entry(fqn).pieces:
                    write(p, flat[p.tensor_offset:p.tensor_offset + p.numel])
            ps.grad_written.add(fqn)
        del grad
        self.states[fqn] = TensorState.HOLD_AFTER_BWD

    def _home_grad_piece(self, ps: PassState, p, piece: torch.Tensor) -> None:
        if ps.acc is None:       # the gradient takes its parameter's place in the chunk
            self.store.write_piece(p.chunk, p.chunk_offset, piece)
        elif isinstance(ps.acc, DiskAccumulation):       # (parameters on disk: so is the buffer)
            host = self.copies.host_empty(p.numel, piece.dtype)
            self.copies.move(host, piece, "d2h")
            ps.acc.open(p.chunk)[p.chunk_offset:p.chunk_offset + p.numel].add_(host.float())
            ps.acc.close(p.chunk, dirty=True)
        elif self._acc_is_zero():    # a zero buffer (lock-free): 0 + g is g
            self.copies.move(ps.acc[p.chunk][p.chunk_offset:p.chunk_offset + p.numel], piece, "d2h")
        else:                    # accumulate in fp32 on the host; the parameter stays
            host = self.copies.host_empty(p.numel, piece.dtype)
            self.copies.move(host, piece, "d2h")
            ps.acc[p.chunk][p.chunk_offset:p.chunk_offset + p.numel].add_(host.float())

    def _grad_counts(self) -> dict[int, int]:
        """ZeRO: per group, the gradients it receives (one per trainable parameter in it)."""
        left: dict[int, int] = {}
        for f, p in self.params.items():
            if p.requires_grad:
                for c in self.layout.entry(f).chunks:
                    left[c] = left.get(c, 0) + 1
        return left

    def _sharded_grad(self, ps: PassState, fqn: str, param: nn.Parameter) -> None:
        """ZeRO: the parameter's groups are gathered (a moment that needs them) and pinned from
        their first gradient; the gradient goes into them; a group whose last gradient is in is
        reduce-scattered (into its owner's host home, or added into its fp32 accumulation shard)
        and released."""
        groups = self.layout.entry(fqn).chunks
        for c in groups:
            if ps.grads_left[c] == self._grad_total[c]:
                ps.pins[c] += 1                      # holds gradients from now on
        self._moment(MomentKind.GRAD, fqn, groups)
        self._take_grad(ps, fqn, param, lambda p, piece: self.store.write_piece(p.chunk, p.chunk_offset, piece))
        for c in groups:
            ps.grads_left[c] -= 1
            if ps.grads_left[c] == 0:
                self._complete_group(ps, c)

    def _complete_group(self, ps: PassState, c: int) -> None:
        ps.pins[c] -= 1
        if not ps.tracing and self.store.resident(c) and self.store.dirty[c]:
            with ps.tracker.paused():
                self.store.reduce_scatter(c, ps.acc[c] if ps.acc is not None else None)
