"""Compiling one compute region with Inductor: for plain sizes, or once for a range's every length.

A region of a schedule planned for one batch shape is compiled for exactly the layouts it receives
(``TensorMeta``: shape, stride, dtype, device, alignment; fake tensors, no value read).

A region of a *range's* schedule (``compiled/ranges.py``, ``graph/dynamic.py``) receives tensors
whose sizes change with the batch. Each such input is described by a ``SymbolicMeta``: its fake
value in the range's symbolic capture (sizes such as ``4*s0``, strides such as ``64*s0``, or an
integer such as ``s0``) and its layout at the range's bound. The region is compiled once, for the
symbols (``standalone_compile`` with those fake inputs), so one compiled code serves every length.
What that compile assumed about the symbols lands in the capture's shape environment as guards;
a compile that adds any (Inductor specialised a size, or relied on a relation between sizes that
the capture did not) is refused and the region runs as eager code. The code is therefore valid for
every size the capture's own guards admit, which every batch of the range is checked against.

Such a region is checked for the layouts it receives at every new batch shape
(``SymbolicMeta.mismatch``, the symbols' values read off its inputs by ``bind``) and measured at
the bound (``grown``: its real inputs copied into zeros of the bound's layout; sizes only grow, so
indices stay in range and what compiled code allocates depends on the sizes alone).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
from torch import fx
from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from pscompile.compiled.regions import INDUCTOR_PATCHES, TensorMeta, boxed_inner

__all__ = ["SymbolicMeta", "compile_inductor", "bind", "grown"]


@dataclass(frozen=True, eq=False)
class SymbolicMeta:
    """A region input whose sizes change with the batch: its symbolic fake value and its layout at
    the range's bound (a ``TensorMeta``, or an int for a size passed as a number)."""

    val: Any
    bound: Any

    def exprs(self) -> tuple:
        """(shape, stride) as sympy expressions, or (expression,) for an integer."""
        if isinstance(self.val, torch.Tensor):
            return (tuple(_expr(s) for s in self.val.shape), tuple(_expr(s) for s in self.val.stride()))
        return (_expr(self.val),)

    def sig(self) -> tuple:
        bound = self.bound.sig() if isinstance(self.bound, TensorMeta) else ("C", "int", repr(self.bound))
        dtype = str(self.val.dtype) if isinstance(self.val, torch.Tensor) else "int"
        return ("S", repr(self.exprs()), dtype, bound)

    @staticmethod
    def bind(metas: Sequence[Any], args: Sequence[Any]) -> dict:
        """``bind`` (what ``regions.layout_mismatch`` calls, through the meta it holds)."""
        return bind(metas, args)

    def mismatch(self, v: Any, values: dict) -> str | None:
        """How ``v`` differs from what the region was compiled for, the symbols taking ``values``
        (None: it matches). A size whose symbols are not all bound is not compared."""
        if not isinstance(self.val, torch.Tensor):
            want = _value(self.exprs()[0], values)
            return None if want is None or want == int(v) else f"the size {int(v)}, compiled for {want}"
        if not isinstance(v, torch.Tensor):
            return f"a {type(v).__name__}, not a tensor"
        shape, stride = self.exprs()
        if len(v.shape) != len(shape):
            return f"rank {v.dim()}, compiled for {len(shape)}"
        for what, exprs, have in (("shape", shape, tuple(v.shape)), ("stride", stride, v.stride())):
            want = tuple(_value(e, values) for e in exprs)
            if any(w is not None and w != h for w, h in zip(want, have)):
                return f"{what} {have}, compiled for {tuple(exprs)} = {want}"
        if v.dtype != self.val.dtype or v.device.type != self.bound.device.type:
            return f"{v.dtype} on {v.device.type}, compiled for {self.val.dtype} on {self.bound.device.type}"
        if (v.storage_offset() * v.element_size()) % 16:
            return "a storage offset not 16-byte aligned, compiled for an aligned one"
        return None


def _expr(s: Any) -> sympy.Expr:
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def _value(e: sympy.Expr, values: dict) -> int | None:
    e = sympy.sympify(e.xreplace(values))
    return int(e) if not e.free_symbols else None


def bind(metas: Sequence[Any], args: Sequence[Any]) -> dict:
    """The symbols' values in one call of a region: read off the sizes of its inputs (a size that
    is a symbol gives it; one that is ``a*s + b`` in one unknown symbol gives it next)."""
    values: dict = {}
    pending = []
    for m, v in zip(metas, args):
        if not isinstance(m, SymbolicMeta):
            continue
        exprs = m.exprs()
        pairs = zip(exprs[0], v.shape) if isinstance(v, torch.Tensor) and len(exprs) == 2 else \
            [(exprs[0], v)] if len(exprs) == 1 and isinstance(v, int) else []
        for e, real in pairs:
            if isinstance(e, sympy.Symbol):
                values.setdefault(e, int(real))
            elif e.free_symbols:
                pending.append((e, int(real)))
    for e, real in pending:
        e = sympy.sympify(e.xreplace(values))
        if len(e.free_symbols) == 1:
            (s,) = e.free_symbols
            poly = sympy.Poly(e, s)
            if poly.degree() == 1:
                a, b = poly.all_coeffs()
                if (real - b) % a == 0:
                    values[s] = int((real - b) // a)
    return values


def compile_inductor(graph: fx.Graph, metas: Sequence[Any]) -> Callable[[list], Sequence[Any]]:
    """Inductor's code for a region graph: for exactly the layouts of ``metas`` (fake tensors: no
    value is read; each in its own storage), or, if some are ``SymbolicMeta``, for their symbols."""
    gm = fx.GraphModule({}, copy.deepcopy(graph))
    options = {"config_patches": dict(INDUCTOR_PATCHES)}
    if not any(isinstance(m, SymbolicMeta) for m in metas):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = [m.fake(mode) if isinstance(m, TensorMeta) else m for m in metas]
        return boxed_inner(torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_example_inputs",
                                                              options=options))
    return boxed_inner(_compile_symbolic(gm, metas, options))


def _compile_symbolic(gm: fx.GraphModule, metas: Sequence[Any], options: dict) -> Callable:
    """Compile for symbols of a shape environment of its own: each size of an input that changes
    with the batch (and each such number) is a fresh symbol standing for its expression in the
    range's capture (``4*s0``). Whatever the compile then assumes (a guard, a replacement) must
    hold for every size, the fresh symbols replaced by those expressions; else it is refused."""
    capture_env = next(m.val.fake_mode.shape_env if isinstance(m.val, torch.Tensor) else m.val.node.shape_env
                       for m in metas if isinstance(m, SymbolicMeta))
    env = ShapeEnv(duck_shape=False)       # (two sizes with one value are not assumed one size)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)
    stands_for: dict = {}
    inputs = [_example(m, i, mode, stands_for) if isinstance(m, SymbolicMeta)
              else m.fake(mode) if isinstance(m, TensorMeta) else m for i, m in enumerate(metas)]
    # not through Inductor's FX graph cache: its guards name the symbols by sources it cannot resolve
    # here; without it no artifact to save is made, which standalone_compile says at WARNING
    options = {"config_patches": {**options["config_patches"], "fx_graph_cache": False}}
    quiet = logging.getLogger("torch._inductor.standalone_compile")
    quiet.addFilter(_no_artifact)
    try:
        art = torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_example_inputs", options=options,
                                                 fake_mode=mode)
    finally:
        quiet.removeFilter(_no_artifact)
    assumed = [g.expr for g in env.guards] + [sympy.Eq(k, v) for k, v in env.replacements.items()]
    unproved = [a for a in assumed if capture_env._maybe_evaluate_static(
        sympy.sympify(a).xreplace(stands_for)) is not sympy.true]
    if unproved:
        raise RuntimeError("compiled for symbolic sizes, Inductor assumed " + ", ".join(
            f"{a} ({sympy.sympify(a).xreplace(stands_for)})" for a in unproved[:4]))
    return art


def _no_artifact(record: logging.LogRecord) -> bool:
    return "artifact generation failed" not in record.getMessage()


def _example(m: SymbolicMeta, i: int, mode: FakeTensorMode, stands_for: dict) -> Any:
    """The fake input ``m`` is compiled for: each of its sizes (and strides) that changes with the
    batch a fresh symbol of ``mode`` (one per capture symbol or expression), recorded in
    ``stands_for``; a stride that is a product of its sizes stays that product."""
    env = mode.shape_env
    base = LocalSource(f"pscompile_input_{i}")

    def fresh(expr: sympy.Expr, hint: int, source) -> sympy.Symbol:
        sym = env.create_symbol(hint, source, DimDynamic.DYNAMIC)
        stands_for[sym] = expr
        return sym

    if not isinstance(m.val, torch.Tensor):
        sym = fresh(_expr(m.val), int(m.bound), base)
        return env.create_symintnode(sym, hint=int(m.bound), source=base)
    b, (shape, stride) = m.bound, m.exprs()
    mine: dict = {}                   # capture expression -> its fresh symbol here
    for d, e in enumerate(shape):
        if e.free_symbols and e not in mine:
            mine[e] = fresh(e, b.shape[d], TensorPropertySource(base, TensorProperty.SIZE, d))
    bare = {e: u for e, u in mine.items() if isinstance(e, sympy.Symbol)}

    def as_int(e: sympy.Expr, hint: int, d: int, prop) -> Any:
        if not e.free_symbols:
            return int(e)
        e2 = mine[e] if e in mine else e.xreplace(bare)
        if e2.free_symbols - set(stands_for):      # (still a capture symbol: a symbol of its own)
            e2 = fresh(e, hint, TensorPropertySource(base, prop, d))
        return env.create_symintnode(e2, hint=hint)

    sizes = [as_int(e, b.shape[d], d, TensorProperty.SIZE) for d, e in enumerate(shape)]
    strides = [as_int(e, b.stride[d], d, TensorProperty.STRIDE) for d, e in enumerate(stride)]
    with mode:
        return torch.empty_strided(sizes, strides, dtype=b.dtype, device=b.device)


def grown(r: Any, snaps: Sequence[Any], snapshot: type) -> list:
    """A region's saved inputs (``probe.Snapshot``s and numbers) at the range's bound: a tensor's
    values copied into zeros of its bound layout (the sizes only grow, so an index stays in range),
    a size its bound value; inputs of plain sizes as they are."""
    out = []
    for m, s in zip(r.input_metas, snaps):
        if not isinstance(m, SymbolicMeta):
            out.append(s)
            continue
        if not isinstance(m.bound, TensorMeta):
            out.append(m.bound)
            continue
        b = m.bound
        host = torch.zeros(max(b.span, 1), dtype=b.dtype)
        real = s.span.as_strided(s.meta.shape, s.meta.stride, 0)
        host.as_strided(b.shape, b.stride, 0)[tuple(slice(0, n) for n in real.shape)].copy_(real)
        out.append(snapshot(host[:b.span], b, b.offset()))
    return out
