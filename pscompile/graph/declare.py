"""How a memory op is declared: ``declare`` makes a ``pscompile::`` op from its eager body and records
its ``OpDecl`` in ``DECLS`` (the ops themselves are declared in ``graph/ops.py``), and
``memory_runner`` routes the ops' calls to the engine while a compiled program runs."""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

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


@dataclass(frozen=True)
class OpDecl:
    """One memory op, declared once: everything a pass, the verifier, the engine, the listing, the
    cost model and Inductor need to know of it. ``declare`` makes the op from its eager body (its
    schema inferred, its fake, its Functionalize kernel, its side effect) and records this.

    What the op *does* to state lives with that state's owner, named here: ``handler``, the method
    of ``compiled.moves.ChunkMoves`` that performs it on the slots and the copy engine, and
    ``check``, the method of ``verify_schedule``'s replay that checks it against the replayed
    residency. ``tests/test_memory_ops.py`` checks that both exist for every op."""

    name: str                    # pscompile::<name>
    kind: MemKind                # the kind of its plan action and of its node's MemOp / ActivationMove
    handler: str                 # ChunkMoves' method that performs it
    check: str = ""              # verify_schedule's replay method that checks it ("": an activation op,
                                 # which offload_activations places and the budget replay charges)
    link: str = ""               # the link its bytes cross: "h2d", "d2h", "disk"; "": it moves no bytes
    comm: str = ""               # bytes exchanged with other ranks: "alongside" its link copy, or "before" it
    arrives: bool = False        # a chunk (or gathered group) takes a slot
    leaves: bool = False         # a chunk (or gathered group) gives its slot up
    reduces: bool = False        # ZeRO: gradients go to their owners
    waits: bool = False          # marks where an asynchronous copy has landed
    activation: bool = False     # moves a saved activation (an ActivationMove), not a chunk (a MemOp)
    returns: str = "none"        # what a call gives back: "none" (a side effect only), "device" or "host" (a
                                 # new buffer: Inductor allocates it, and counts it only if on the device)
    tier: str = ""               # its listing's tier column ("": "<src>-><dst>")
    mark: tuple[str, str, str] | None = None   # its marker in Schedule.plot: (marker, colour, label)
    comment: Callable[[Any, torch.fx.Node], str] | None = None   # its listing's comment (None: describe())

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.pscompile, self.name).default


DECLS: dict[str, OpDecl] = {}      # op name -> its declaration, in declaration order


def declare(name: str, kind: MemKind, *, mutates: tuple[str, ...] = (), fake: Callable | None = None,
            **fields):
    """Decorator: ``fn`` is the eager body of memory op ``pscompile::name``, declared by ``fields``
    (``OpDecl``). The op is defined with ``Library.define`` (its schema inferred from ``fn``, as
    ``torch.library.custom_op`` would) and one CompositeExplicitAutograd kernel. Not ``custom_op``:
    a compiled program calls one op per memory node, and custom_op's autograd and ADInplaceOrView
    layers, run in Python, cost about ten times the dispatcher's own call (``docs/design.md``).
    The ops are never differentiated (the captured graph is already the joint graph) and nothing
    autograd saved reads the buffers they write. An op that returns nothing gets its fake here and
    is a side effect to FX; one that mutates keeps doing so under functionalization
    (``_in_place_under_functionalization``)."""
    def wrap(fn):
        decl = OpDecl(name, kind, **fields)
        if (decl.returns == "none") == (fake is not None):
            raise TypeError(f"memory op {name}: an op that returns a buffer needs a fake, one that returns none none")
        returns_none = inspect.signature(fn).return_annotation in (None, "None")
        if returns_none != (decl.returns == "none"):
            raise TypeError(f"memory op {name}: returns={decl.returns!r} disagrees with its body's annotation")
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        _LIB.impl(name, _routed(name)(fn), "CompositeExplicitAutograd")
        torch.library.register_fake(f"pscompile::{name}", fake or _no_value, lib=_LIB)
        if mutates:
            _LIB.impl(name, _in_place_under_functionalization(name), "Functionalize")
        if returns_none:
            torch.fx.has_side_effect(decl.op)
        DECLS[name] = decl
        return fn
    return wrap
