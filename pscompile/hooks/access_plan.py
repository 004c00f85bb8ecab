"""The access plan of the hooks engine: the moments of one iteration, recorded in a trace pass.

A *moment* is a point where the runtime may move chunks: a module's pre-forward or post-forward
hook, the first use of a chunk by a backward node, a gradient being stored, an optimizer update.
The trace pass records, for every moment, the chunks that must be on the device and the largest
non-model footprint until the next moment. Later iterations replay the same moments and use the
plan to evict the resident chunk whose next use is farthest away (Belady's OPT), under the
capacity ``device_memory - nonmodel_peak`` of each moment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable


@dataclass(frozen=True)
class Moment:
    kind: str                 # "fwd" | "fwd_release" | "bwd" | "bwd_end" | "grad" | "opt"
    label: str                # module, backward node, parameter or chunk it belongs to
    need: tuple[int, ...]     # chunks that must be on the device from here on (pinned)
    nonmodel_peak: int        # largest non-model bytes from this moment to the next
    pinned_bytes: int         # chunk bytes pinned on the device during this window (trace pass)


@dataclass(frozen=True)
class AccessPlan:
    moments: tuple[Moment, ...]

    @cached_property
    def _uses(self) -> dict[int, list[int]]:
        uses: dict[int, list[int]] = {}
        for i, m in enumerate(self.moments):
            for c in m.need:
                uses.setdefault(c, []).append(i)
        return uses

    def next_use(self, chunk: int, after: int) -> float:
        """Index of the next moment (> ``after``) that needs ``chunk``; the next iteration's
        moments continue the count (cyclic); ``inf`` if no moment needs it."""
        uses = self._uses.get(chunk)
        if not uses:
            return float("inf")
        k = bisect.bisect_right(uses, after)
        if k < len(uses):
            return uses[k]
        return uses[0] + len(self.moments)

    def farthest(self, candidates: Iterable[int], after: int) -> int:
        """The candidate chunk used farthest in the future (ties: the higher chunk id)."""
        return max(candidates, key=lambda c: (self.next_use(c, after), c))

    @cached_property
    def peak_nonmodel(self) -> int:
        return max((m.nonmodel_peak for m in self.moments), default=0)

    def min_device_bytes(self) -> tuple[int, int]:
        """(bytes, moment index): the smallest budget this iteration can run in."""
        best = (0, -1)
        for i, m in enumerate(self.moments):
            need = m.pinned_bytes + m.nonmodel_peak
            if need > best[0]:
                best = (need, i)
        return best

    def describe(self, i: int) -> str:
        m = self.moments[i]
        return f"moment {i} ({m.kind} {m.label})"
