"""Which batches share a schedule when their sizes change: compiled mode's automatic dynamic.

``ShapeRanges`` keeps, per batch *family* (structure, dtypes and ranks: ``graph.dynamic.family``),
the first signature it saw. A later signature of the family whose sizes differ makes those
dimensions dynamic; from then on every signature of the family maps to one *ranged* signature
(``graph.dynamic.ranged``: those sizes None) and shares its capture and schedule, planned for the
range's upper bound, the largest size seen at each dynamic dimension. A size above the bound
raises it (the engine plans again, once). A signature the symbolic capture's guards refuse is
``refuse``d and keeps a schedule of its own. It also keeps each ranged capture's symbolic capture
(``symbolic``; None once refused) and the bound its schedules were planned for (``planned``).
Plain data: the engine asks, this answers.
"""

from __future__ import annotations

from pscompile.dims import Declared
from pscompile.graph import dynamic
from pscompile.runtime.batching import with_sizes


class ShapeRanges:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._symbolic: dict = {}      # capture -> its symbolic capture (a CapturedGraph; None: refused)
        self._planned: dict = {}       # capture -> the bound its schedules are planned for
        self._clear_sizes()

    def restart(self) -> None:
        """Forget every size seen (ZeRO: the ranges are fed only the sizes the ranks agree on, not
        a rank's own first batch); the symbolic captures stay."""
        self._clear_sizes()

    def _clear_sizes(self) -> None:
        self._first: dict[tuple, tuple] = {}          # family -> its first signature
        self._dims: dict[tuple, dynamic.Dims] = {}    # family -> its dynamic dimensions
        self._bound: dict[tuple, tuple[int, ...]] = {}   # ranged signature -> its upper bound
        self._refused: set[tuple] = set()             # signatures the symbolic capture does not admit
        self._admitted: set[tuple] = set()            # (capture, signature) pairs whose guards held (checked once)
        self._declared: dict[tuple, Declared] = {}     # family -> the sizes Config.dynamic named up front
        self._saved: dict[str, dict] = {}             # repr(family) -> its range in a loaded checkpoint

    # a ranged capture's symbolic capture, and the bound its schedules are planned for

    def tried(self, capture) -> bool:
        """Whether ``capture``'s symbolic capture was made (or refused)."""
        return capture in self._symbolic

    def symbolic(self, capture):
        """``capture``'s symbolic capture; None if not made yet or refused."""
        return self._symbolic.get(capture)

    def set_symbolic(self, capture, sym) -> None:
        """``capture``'s symbolic capture (None: refused, a plan per shape from now on)."""
        self._symbolic[capture] = sym

    def symbolic_count(self) -> int:
        """How many symbolic captures serve ranges now."""
        return sum(s is not None for s in self._symbolic.values())

    def planned(self, capture) -> tuple[int, ...] | None:
        return self._planned.get(capture)

    def plan_at(self, capture, bound: tuple[int, ...]) -> None:
        self._planned[capture] = tuple(bound)

    def unplan(self, capture) -> None:
        """``capture``'s schedules are gone: planned again at the bound when next used."""
        self._planned.pop(capture, None)

    def key(self, sig: tuple) -> tuple:
        """The signature ``sig`` is planned under: itself, or its family's ranged signature (which
        a first sight of a new size turns dynamic, and a size above the bound raises)."""
        if not self.enabled or sig in self._refused:
            return sig
        fam = dynamic.family(sig)
        self._install(fam, sig)
        first = self._first.setdefault(fam, sig)
        dims = tuple(sorted(set(self._dims.get(fam, ())) | set(dynamic.differing(first, sig))))
        if not dims:
            return sig
        if dims != self._dims.get(fam):
            self._dims[fam] = dims
            self._bound.setdefault(dynamic.ranged(sig, dims), self._first_bound(fam, first, dims))
        key = dynamic.ranged(sig, dims)
        sizes = dynamic.sizes_of(sig, dims)
        old = self._bound.get(key, sizes)
        self._bound[key] = tuple(max(a, b) for a, b in zip(old, sizes))
        return key

    def agree(self, low: tuple, high: tuple) -> None:
        """ZeRO: a step whose ranks' signatures of one (micro-)batch lie between ``low`` and
        ``high`` (the smallest and the largest size over the ranks at every dimension, the same on
        every rank: ``batching.RanksShapes``). The dimensions where they differ are dynamic at once,
        and the range's bound covers ``high``: fed only these, every rank's ranges evolve alike,
        and each rank's own signature then maps to the same key (``key``) and bound."""
        if not self.enabled or high in self._refused:
            return
        fam = dynamic.family(high)
        self._install(fam, high)
        first = self._first.setdefault(fam, high)
        dims = tuple(sorted(set(self._dims.get(fam, ())) | set(dynamic.differing(low, high))
                            | set(dynamic.differing(first, high))))
        if dims and dims != self._dims.get(fam):     # (the bound from ``high``: ranks' firsts may differ)
            self._dims[fam] = dims
            self._bound.setdefault(dynamic.ranged(high, dims), self._first_bound(fam, high, dims))
        self.key(high)

    def refuse(self, sig: tuple) -> None:
        self._refused.add(sig)

    def admit(self, capture, sig: tuple) -> None:
        """``sig`` passed the shape guards of ``capture`` (a training and an evaluation capture have
        their own): they depend on sizes only, so it always will."""
        self._admitted.add((capture, sig))

    def admitted(self, capture, sig: tuple) -> bool:
        return (capture, sig) in self._admitted

    @staticmethod
    def is_ranged(key_sig: tuple) -> bool:
        return any(s is None for shape in dynamic.tensor_shapes(key_sig) for s in shape)

    def dims(self, key_sig: tuple) -> dynamic.Dims:
        """The dynamic (tensor leaf, dimension) pairs of a ranged signature."""
        return tuple((i, d) for i, shape in enumerate(dynamic.tensor_shapes(key_sig))
                     for d, s in enumerate(shape) if s is None)

    def bound(self, key_sig: tuple) -> tuple[int, ...]:
        return self._bound[key_sig]

    # sizes named up front (Config.dynamic's Dims, pscompile/dims.py)

    def declare(self, sig: tuple, declared: Declared) -> None:
        """``sig``'s family (``sig`` its first batch) is ranged from now on over ``declared.dims``
        (and any dims that differ later), its bound starting at the Dims' maxima."""
        fam = dynamic.family(sig)
        if not self.enabled or fam in self._declared:
            return
        self._install(fam, sig)
        self._declared[fam] = declared
        if not declared.dims:       # a family the spec does not describe: automatic dynamic
            return
        self._first.setdefault(fam, sig)
        self._dims[fam] = dims = tuple(sorted(set(self._dims.get(fam, ())) | set(declared.dims)))
        self._bound.setdefault(dynamic.ranged(sig, dims), self._first_bound(fam, self._first[fam], dims))

    def declared(self, sig: tuple | None = None) -> bool:
        """Whether ``sig``'s family was declared (``declare``); without ``sig``, whether any was."""
        return bool(self._declared) if sig is None else dynamic.family(sig) in self._declared

    def _first_bound(self, fam: tuple, first: tuple, dims: dynamic.Dims) -> tuple[int, ...]:
        """A new range's bound: the first signature's sizes, a declared Dim's max where larger."""
        named = dict(zip(self._declared[fam].dims, self._declared[fam].maxes)) if fam in self._declared else {}
        return tuple(max(s, named.get(p, 0)) for p, s in zip(dims, dynamic.sizes_of(first, dims)))

    def over_declared(self, key_sig: tuple) -> list[str]:
        """The declared Dims a ranged signature's bound is above: 'Dim(...) (batch tensor i dim d: size)'."""
        fam = dynamic.family(key_sig)
        if fam not in self._declared or key_sig not in self._bound:
            return []
        named = dict(zip(self._declared[fam].dims, self._declared[fam].named))
        return [f"{named[p]} (batch tensor {p[0]} dim {p[1]}: {size})"
                for p, size in zip(self.dims(key_sig), self._bound[key_sig]) if p in named and size > named[p].max]

    # a checkpoint's part (compiled/state.py): a resumed engine plans its ranges from its first batch

    def state(self) -> dict:
        """Per family that has a range (keyed by its ``repr``): the first signature's tensor shapes,
        the dynamic dimensions and the bound."""
        out = {}
        for fam, dims in self._dims.items():
            first = self._first[fam]
            bound = self._bound.get(dynamic.ranged(first, dims))
            if bound is not None:
                out[repr(fam)] = {"first": [list(shape) for shape in dynamic.tensor_shapes(first)],
                                  "dims": [list(p) for p in dims], "bound": list(bound)}
        return out

    def restore(self, state: dict) -> None:
        """A loaded checkpoint's ``state``: each family's range is taken up at its first batch."""
        self._saved = {str(k): v for k, v in state.items() if isinstance(v, dict)}

    def _install(self, fam: tuple, sig: tuple) -> None:
        """The saved range of ``fam`` (``sig`` its first batch since the checkpoint was loaded)."""
        entry = self._saved.pop(repr(fam), None) if fam not in self._dims else None
        if entry is None:
            return
        first = with_sizes(sig, iter(int(x) for shape in entry["first"] for x in shape))
        dims = tuple((int(i), int(d)) for i, d in entry["dims"])
        self._first[fam], self._dims[fam] = first, dims
        self._bound[dynamic.ranged(first, dims)] = tuple(int(b) for b in entry["bound"])
