"""Batches whose lengths change: one symbolic capture, concretized at the range's upper bound.

A *family* of batches shares the structure, the dtypes and the rank of every tensor leaf; its
members differ only in sizes. When a second member of a family arrives whose sizes differ from the
first's, the dimensions that differ become *dynamic* (``torch.compile``'s automatic dynamic does the
same): the iteration is captured once more with those dimensions symbolic (``SymInt``), so the
graph's code reads every size from its inputs and runs any length. The plan, though, is made for
numbers: ``at_bound`` gives a copy of the symbolic graph whose fake values are those of the
*upper bound* of the range (the largest size seen), and every pass plans that copy as it plans any
capture. The schedule's chunk moves do not depend on the length; the non-model memory does, and
``monotone`` proves it grows with the length (every tensor's size a polynomial with non-negative
coefficients), so a schedule that keeps the budget at the bound keeps it at every length below.

The capture's shape guards (what tracing assumed about the sizes, e.g. ``s0 <= 1024`` from a model's
assertion, or two dimensions being equal) are checked for every batch (``SymbolicCapture.admits``);
a batch that breaks one gets a capture of its own, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from pscompile.runtime.batching import family  # noqa: F401 - a family's members share a schedule here

Dims = tuple[tuple[int, int], ...]      # (tensor leaf index, dimension) pairs, sorted


def tensor_shapes(sig: tuple) -> list[tuple[int | None, ...]]:
    """The shapes of a signature's tensor leaves, in order."""
    return [x[0] for x in sig[1:] if isinstance(x, tuple)]


def differing(a: tuple, b: tuple) -> Dims:
    """The (tensor leaf, dimension) pairs whose sizes differ between two signatures of one family."""
    return tuple((i, d) for i, (sa, sb) in enumerate(zip(tensor_shapes(a), tensor_shapes(b)))
                 for d, (x, y) in enumerate(zip(sa, sb)) if x != y)


def ranged(sig: tuple, dims: Dims) -> tuple:
    """``sig`` with the sizes of ``dims`` replaced by None: the key every member of the range shares."""
    spec, *leaves = sig
    out, t = [spec], 0
    for x in leaves:
        if isinstance(x, tuple):
            x = (tuple(None if (t, d) in dims else s for d, s in enumerate(x[0])), x[1])
            t += 1
        out.append(x)
    return tuple(out)


def sizes_of(sig: tuple, dims: Dims) -> tuple[int, ...]:
    """The sizes ``sig`` has at ``dims``."""
    shapes = tensor_shapes(sig)
    return tuple(shapes[i][d] for i, d in dims)


def symbolic_leaf(mode: FakeTensorMode, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  dynamic: set[int]) -> torch.Tensor:
    """A fake tensor in ``mode`` (which has a ``ShapeEnv``) whose ``dynamic`` dimensions are
    symbols and the others static, as ``torch._dynamo.mark_dynamic`` makes them."""
    if not dynamic:
        with mode:
            return torch.empty(shape, dtype=dtype, device=device)
    real = torch.empty(shape, dtype=dtype, device="meta")
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC
                                                      for d in range(len(shape))])
    fake = mode.from_tensor(real, symbolic_context=context)
    with mode:
        return torch.empty_strided(fake.shape, fake.stride(), dtype=dtype, device=device)


def symbolic_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


@dataclass(frozen=True)
class SymbolicCapture:
    """What the symbolic trace left besides its graph: the fake inputs it traced with (their
    symbols) and the shape environment holding its guards."""
    inputs: tuple[torch.Tensor, ...]       # the placeholders' fake values, in order
    shape_env: ShapeEnv
    dims: Dims

    def still_symbolic(self, batch_offset: int) -> bool:
        """Whether every dynamic dimension stayed a symbol (tracing may have specialized one)."""
        shapes = [t.shape for t in self.inputs[batch_offset:]]
        return all(isinstance(shapes[i][d], torch.SymInt) and _free(shapes[i][d]) for i, d in self.dims)

    def admits(self, batch: Sequence[torch.Tensor], batch_offset: int) -> bool:
        """Whether the capture's shape guards hold for a batch's tensor leaves (the parameters'
        and buffers' sizes are static: their own fake values stand for them)."""
        args = list(self.inputs)
        args[batch_offset:batch_offset + len(batch)] = list(batch)
        try:
            return bool(self.shape_env.evaluate_guards_for_args(list(self.inputs), args))
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated does not admit the batch
            return False

    def concrete_inputs(self, batch_offset: int, bound: tuple[int, ...]) -> list[torch.Tensor]:
        """Fake inputs of plain sizes: the symbols' values are those the dims take at ``bound``."""
        values: dict[sympy.Symbol, int] = {}
        shapes = [t.shape for t in self.inputs[batch_offset:]]
        for (i, d), size in zip(self.dims, bound):
            expr = shapes[i][d].node.expr
            if isinstance(expr, sympy.Symbol):
                values[expr] = size
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            return [torch.empty_strided(_ints(t.shape, values), _ints(t.stride(), values), dtype=t.dtype,
                                        device=t.device) for t in self.inputs]


def _free(s: torch.SymInt) -> bool:
    return bool(getattr(s.node.expr, "free_symbols", ()))


def _ints(sizes: Sequence, values: dict) -> list[int]:
    return [int(s.node.expr.xreplace(values)) if isinstance(s, torch.SymInt) else int(s) for s in sizes]


def at_bound(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """A copy of the symbolic ``gm`` (same code, so it runs any size) whose every node's
    ``meta["val"]`` is the fake value it takes on ``inputs`` (plain sizes): what the passes plan."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    new = fx.GraphModule(gm, graph)
    mode = next(t.fake_mode for t in inputs)
    with torch.random.fork_rng(devices=[]):
        FakeTensorProp(new, mode).propagate_dont_convert_inputs(*inputs)
    for old, n in zip(gm.graph.nodes, new.graph.nodes):
        if "stack_trace" in old.meta:
            n.meta["stack_trace"] = old.meta["stack_trace"]
    return new


def monotone(gm: fx.GraphModule, batch_offset: int, dims: Dims) -> str | None:
    """None when every tensor's size in the symbolic ``gm`` is a polynomial in the dynamic sizes
    with non-negative coefficients (so the memory of every node grows with the length and the
    bound's plan holds below it); else the first node where that cannot be shown."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        for t in val if isinstance(val, (tuple, list)) else (val,):
            if not isinstance(t, torch.Tensor):
                continue
            numel = t.numel()
            if isinstance(numel, torch.SymInt) and not _nonneg_poly(numel.node.expr):
                return f"{n.name} ({numel.node.expr} elements)"
    return None


def _nonneg_poly(expr: sympy.Expr) -> bool:
    try:
        poly = sympy.Poly(sympy.expand(expr), *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c >= 0 for c in poly.coeffs())
