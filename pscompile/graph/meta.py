"""pscompile's metadata on FX nodes, and the conventions of the captured and scheduled graphs.

All pscompile metadata lives in ``node.meta["pscompile"]`` (a dict) and is read and written only
through the accessors below; nothing is set as an attribute on nodes, parameters or modules.

**Captured (joint) graph** — ``capture.capture_joint`` returns a ``CapturedGraph`` whose
``gm.graph`` has flat placeholders in this order: the parameters (``param_fqns``, canonical names,
tied parameters once), the buffers (``buffer_fqns``), then the batch's tensor leaves. It returns
one flat tuple ``(loss, *grads)`` with one gradient per *trainable* parameter in ``param_fqns``
order (``grad_fqns``). Every node has ``meta["val"]`` (a FakeTensor or a tuple of them).

Keys written by the analysis passes:

- ``phase``: ``Phase.FWD`` (computes the loss) or ``Phase.BWD`` (everything after);
- ``param``: on a parameter placeholder and on every view of one, the fqn it aliases;
- ``reads``: on a compute node, the fqns of the parameters whose memory it reads (through views);
- ``last_use``: on a parameter placeholder, the index of the last node that reads it (view-aware);
- ``nonmodel``: on every node, non-model bytes live while it runs (static estimate or measured).

**Scheduled graph** (after ``insert_memory_ops``): parameter placeholders are gone; the graph
takes the device slot buffers ``slot_0 .. slot_{S-1}`` and the host chunk buffers ``host_0 ..
host_{C-1}`` as placeholders, every parameter read is a view of the slot that holds its chunk at
that moment, and memory nodes (``torch.ops.pscompile.*``) move data between them. Their
``mem`` metadata is a ``MemOp``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

KEY = "pscompile"


def graph_module(root: torch.nn.Module | dict, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of ``graph`` that generates its Python code only when it is first run or
    printed (torch's lazy GraphModule; ``recompile()`` on it only marks the code stale). The
    passes build many graphs that are planned and verified but never run: at a sweep's 30 budgets
    code generation was a quarter of the planning time."""
    return _LazyGraphModule(root, graph)


def meta(node: fx.Node) -> dict[str, Any]:
    """The pscompile metadata dict of ``node`` (created on first use)."""
    return node.meta.setdefault(KEY, {})


def get(node: fx.Node, key: str, default: Any = None) -> Any:
    return node.meta.get(KEY, {}).get(key, default)


def put(node: fx.Node, key: str, value: Any) -> None:
    meta(node)[key] = value


def storage_bytes(node: fx.Node) -> int | None:
    """Bytes of the storage ``node``'s value keeps alive (a view keeps all of it), from its
    ``meta["val"]``; None when the value is not one tensor."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return val.untyped_storage().nbytes()


def held_grad_bytes(pages: Iterable[tuple[fx.Node, int]]) -> int:
    """Device bytes the gradients of ``pages`` ((gradient node, page bytes) of the asynchronous
    accumulate_grads still in flight) keep alive: each gradient's storage once, or its pages'
    bytes where the storage is not known."""
    by_grad: dict[fx.Node, int] = {}
    for g, nbytes in pages:
        by_grad[g] = by_grad.get(g, 0) + nbytes
    return sum(storage_bytes(g) or b for g, b in by_grad.items())
