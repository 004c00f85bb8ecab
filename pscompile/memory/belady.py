"""Farthest-next-use eviction (Belady's OPT), the one victim rule of both modes.

Both modes know the future: compiled mode from the captured graph (the chunks each node reads),
hooks mode from the warm-up trace (the chunks each moment needs). ``NextUse`` indexes that
sequence; ``farthest`` picks the victim. With equal-size chunks and a known future, evicting the
chunk used farthest ahead gives the fewest fetches. Among equally far chunks a clean one goes
first (its host copy is valid, so evicting it copies nothing), then the higher chunk id, so the
choice is deterministic.

A sequence is *cyclic* when the iteration repeats: a chunk not used again in this iteration is
next used at its first use in the next one (``length + first use``); otherwise it is never used
again (``inf``).
"""

from __future__ import annotations

import bisect
from typing import Collection, Iterable, Sequence


class NextUse:
    """When each chunk is used next in a sequence of steps (nodes or moments)."""

    def __init__(self, uses_per_step: Sequence[Iterable[int]]):
        uses: dict[int, list[int]] = {}
        for i, chunks in enumerate(uses_per_step):
            for c in chunks:
                at = uses.setdefault(c, [])
                if not at or at[-1] != i:
                    at.append(i)
        self._uses = uses
        self.length = len(uses_per_step)

    def at_or_after(self, chunk: int, step: int, *, cyclic: bool) -> float:
        """The first step >= ``step`` that uses ``chunk``; past the end, see the module doc."""
        u = self._uses.get(chunk)
        if not u:
            return float("inf")
        k = bisect.bisect_left(u, step)
        if k < len(u):
            return u[k]
        return self.length + u[0] if cyclic else float("inf")


def farthest(candidates: Iterable[int], next_use: NextUse, step: int, *, cyclic: bool,
             dirty: Collection[int] = ()) -> int:
    """The victim among ``candidates``: used farthest from ``step`` on, clean before dirty, then
    the higher chunk id."""
    return max(candidates, key=lambda c: (next_use.at_or_after(c, step, cyclic=cyclic), c not in dirty, c))
