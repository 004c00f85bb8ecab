"""Which batches share a schedule when their sizes change: compiled mode's automatic dynamic.

``ShapeRanges`` keeps, per batch *family* (structure, dtypes and ranks: ``graph.dynamic.family``),
the first signature it saw. A later signature of the family whose sizes differ makes those
dimensions dynamic; from then on every signature of the family maps to one *ranged* signature
(``graph.dynamic.ranged``: those sizes None) and shares its capture and schedule, planned for the
range's upper bound, the largest size seen at each dynamic dimension. A size above the bound
raises it (the engine plans again, once). A signature the symbolic capture's guards refuse is
``refuse``d and keeps a schedule of its own. Plain data: the engine asks, this answers.
"""

from __future__ import annotations

from pscompile.graph import dynamic


class ShapeRanges:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._first: dict[tuple, tuple] = {}          # family -> its first signature
        self._dims: dict[tuple, dynamic.Dims] = {}    # family -> its dynamic dimensions
        self._bound: dict[tuple, tuple[int, ...]] = {}   # ranged signature -> its upper bound
        self._refused: set[tuple] = set()             # signatures the symbolic capture does not admit
        self._admitted: set[tuple] = set()            # (capture, signature) pairs whose guards held (checked once)

    def key(self, sig: tuple) -> tuple:
        """The signature ``sig`` is planned under: itself, or its family's ranged signature (which
        a first sight of a new size turns dynamic, and a size above the bound raises)."""
        if not self.enabled or sig in self._refused:
            return sig
        fam = dynamic.family(sig)
        first = self._first.setdefault(fam, sig)
        dims = tuple(sorted(set(self._dims.get(fam, ())) | set(dynamic.differing(first, sig))))
        if not dims:
            return sig
        if dims != self._dims.get(fam):
            self._dims[fam] = dims
            self._bound.setdefault(dynamic.ranged(sig, dims), dynamic.sizes_of(first, dims))
        key = dynamic.ranged(sig, dims)
        sizes = dynamic.sizes_of(sig, dims)
        old = self._bound.get(key, sizes)
        self._bound[key] = tuple(max(a, b) for a, b in zip(old, sizes))
        return key

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
