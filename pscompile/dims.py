"""Sizes named up front: ``Dim`` and ``Config.dynamic``'s ``dynamic_shapes``-style spec.

Compiled mode's automatic dynamic (docs/dynamic-shapes.md) makes a size symbolic at its second
distinct value. A user who knows which sizes change, and how far, names them up front, in the form
``torch.export`` takes: a pytree with the batch's structure whose leaves are ``None`` (static) or a
dict ``{dim_index: Dim}``. The batch family is then ranged from its first batch, and its one
symbolic capture is planned at each ``Dim``'s ``max``.

``DynamicShapes`` is the spec normalized (hashable, as every ``Config`` field); ``resolve`` matches
it against a batch and gives the (tensor leaf, dimension) pairs and their maxima (``Declared``).
Pure data: nothing here traces or plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten, tree_flatten_with_path, tree_unflatten

_WHAT = "a pytree with the batch's structure whose leaves are None (static) or {dim_index: pscompile.Dim(...)}"


@dataclass(frozen=True)
class Dim:
    """A batch dimension whose size changes, named with its bounds (``torch.export.Dim``'s form).
    Leaves sharing one ``Dim`` (one name) have one size. ``min`` is at least 2: tracing always
    specializes a size of 1."""

    name: str
    max: int
    min: int = 2

    def __post_init__(self):
        where = f"Dim({self.name!r}, max={self.max!r}, min={self.min!r})"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"{where}: name must be an identifier string such as 'seq' (for Config.dynamic)")
        for field, value in (("min", self.min), ("max", self.max)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}: {field} must be an int (a size of the batch in Config.dynamic)")
        if self.min < 2:
            raise ValueError(f"{where}: min={self.min} must be >= 2 for Config.dynamic (tracing always specializes a "
                             "size of 1, so a range starts at 2); use min=2")
        if self.max < self.min:
            raise ValueError(f"{where}: max={self.max} must be >= min={self.min} (the largest size Config.dynamic plans "
                             "for)")


@dataclass(frozen=True)
class At:
    """A tensor leaf of the spec: its named dimensions, by index."""
    dims: tuple[tuple[int, Dim], ...]


@dataclass(frozen=True)
class Keyed:
    """A dict node of the spec (the batch has a dict there)."""
    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class Declared:
    """A spec resolved against a batch: its (tensor leaf, dimension) pairs, sorted, and each one's Dim."""
    dims: tuple[tuple[int, int], ...]
    named: tuple[Dim, ...]

    @property
    def maxes(self) -> tuple[int, ...]:
        return tuple(d.max for d in self.named)

    def at_max(self, batch: Any) -> Any:
        """``batch`` with zeros of each named dim's max size (for a capture: only the sizes count)."""
        leaves, spec = tree_flatten(batch)
        sizes = dict(zip(self.dims, self.maxes))
        out, t = [], 0
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.new_zeros([sizes.get((t, d), s) for d, s in enumerate(leaf.shape)])
                t += 1
            out.append(leaf)
        return tree_unflatten(out, spec)


@dataclass(frozen=True)
class DynamicShapes:
    """``Config.dynamic``'s spec, normalized: tuples for lists and tuples, ``Keyed`` for dicts of
    the batch, ``At`` for a tensor's dims, None for static."""
    tree: Any

    @classmethod
    def from_spec(cls, spec: Any) -> DynamicShapes:
        """``spec`` checked as far as it can be without a batch; ValueError naming ``Config.dynamic``."""
        if isinstance(spec, DynamicShapes):
            return spec
        tree = _normalize(spec, "dynamic")
        named = [dim for _, at in _leaves(tree) if isinstance(at, At) for _, dim in at.dims]
        if not named:
            raise ValueError(f"Config.dynamic={spec!r} names no dimension; give at least one "
                             "{dim_index: pscompile.Dim(...)}, or None (automatic dynamic)")
        by_name: dict[str, Dim] = {}
        for dim in named:
            if by_name.setdefault(dim.name, dim) != dim:
                raise ValueError(f"Config.dynamic: two Dims are named {dim.name!r} ({by_name[dim.name]} and {dim}); "
                                 "one name is one size: give them the same bounds or different names")
        return cls(tree)

    def resolve(self, batch: Any) -> Declared:
        """The named dims of ``batch``'s tensor leaves. ValueError naming ``Config.dynamic`` when the
        spec's structure is not the batch's, a dim is out of range, or a size is outside its Dim's
        bounds."""
        found, used = [], set()
        tensor = 0
        for path, leaf in tree_flatten_with_path(batch)[0]:
            keys = tuple(_key(k) for k in path)
            spec_path, node = _lookup(self.tree, keys)
            used.add(spec_path)
            where = "batch" + "".join(f"[{k!r}]" for k in keys)
            if node is not None and node.dims and not isinstance(leaf, torch.Tensor):
                raise ValueError(f"Config.dynamic names dims {dict(node.dims)} of {where}, which is a "
                                 f"{type(leaf).__name__}, not a tensor; give None there")
            if isinstance(leaf, torch.Tensor):
                for d, dim in (node.dims if node is not None else ()):
                    found.append(((tensor, d), dim))
                    _check_size(where, leaf, d, dim)
                tensor += 1
        extra = [p for p, _ in _leaves(self.tree) if p not in used]
        if extra:
            raise ValueError(f"Config.dynamic has entries at {['spec' + ''.join(f'[{k!r}]' for k in p) for p in extra]} "
                             f"that the batch does not have; give {_WHAT}")
        found.sort(key=lambda x: x[0])
        return Declared(tuple(p for p, _ in found), tuple(dim for _, dim in found))


def _normalize(spec: Any, where: str) -> Any:
    if spec is None:
        return None
    if isinstance(spec, (tuple, list)):
        return tuple(_normalize(s, f"{where}[{i}]") for i, s in enumerate(spec))
    if isinstance(spec, dict) and all(isinstance(k, int) and not isinstance(k, bool) for k in spec):
        for k, v in spec.items():
            if k < 0:
                raise ValueError(f"Config.{where}: dim index {k} must be >= 0 (count from the first dimension)")
            if not isinstance(v, Dim):
                raise ValueError(f"Config.{where}[{k}]={v!r} is not a pscompile.Dim; give Dim('name', max=...)")
        return At(tuple(sorted(spec.items())))
    if isinstance(spec, dict) and all(isinstance(k, str) for k in spec):
        return Keyed(tuple((k, _normalize(v, f"{where}[{k!r}]")) for k, v in spec.items()))
    raise ValueError(f"Config.{where}={spec!r} is not a dynamic_shapes spec; give {_WHAT}")


def _leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) of every None or ``At`` of a normalized spec."""
    if isinstance(tree, tuple):
        return [x for i, t in enumerate(tree) for x in _leaves(t, path + (i,))]
    if isinstance(tree, Keyed):
        return [x for k, t in tree.items for x in _leaves(t, path + (k,))]
    return [(path, tree)]


def _key(k) -> Any:
    if isinstance(k, SequenceKey):
        return k.idx
    if isinstance(k, MappingKey):
        return k.key
    if isinstance(k, GetAttrKey):
        return k.name
    return str(k)


def _lookup(tree: Any, keys: tuple) -> tuple[tuple, At | None]:
    """(the spec path, the ``At`` or None) serving the batch leaf at ``keys``; a None above the
    leaf covers the whole subtree."""
    node, path = tree, ()
    for k in keys:
        if node is None:
            return path, None
        where = "batch" + "".join(f"[{x!r}]" for x in path)
        if isinstance(node, tuple) and isinstance(k, int) and k < len(node):
            node = node[k]
        elif isinstance(node, Keyed) and k in dict(node.items):
            node = dict(node.items)[k]
        else:
            raise ValueError(f"Config.dynamic does not match the batch's structure at {where}: the batch has entry "
                             f"{k!r} there, the spec {_shape(node)}; give {_WHAT}")
        path += (k,)
    if not (node is None or isinstance(node, At)):
        where = "batch" + "".join(f"[{x!r}]" for x in path)
        raise ValueError(f"Config.dynamic has {_shape(node)} at {where}, where the batch has a leaf; give None or "
                         "{dim_index: Dim} there")
    return path, node


def _shape(node: Any) -> str:
    if isinstance(node, tuple):
        return f"a sequence of {len(node)}"
    if isinstance(node, Keyed):
        return f"a dict of keys {[k for k, _ in node.items]}"
    return "a leaf"


def _check_size(where: str, leaf: torch.Tensor, d: int, dim: Dim) -> None:
    if d >= leaf.dim():
        raise ValueError(f"Config.dynamic names dim {d} of {where}, which has {leaf.dim()} dims (0..{leaf.dim() - 1})")
    size = leaf.shape[d]
    if not dim.min <= size <= dim.max:
        raise ValueError(f"Config.dynamic: {where} has size {size} at dim {d}, outside {dim} (its first batch must "
                         f"be within the bounds); give Dim({dim.name!r}, min={min(dim.min, max(size, 2))}, "
                         f"max={max(dim.max, size)})" + (" (a size of 1 is always specialized)" if size < 2 else ""))
