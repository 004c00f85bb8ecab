"""The access plan of the hooks engine: the moments of one iteration, recorded in a trace pass.

A *moment* is a point where the runtime may move chunks: a module's pre-forward or post-forward
hook, the first use of a chunk by a backward node, a gradient being stored, an optimizer update.
The trace pass records, for every moment, the chunks that must be on the device and the largest
non-model footprint until the next moment. Later iterations replay the same moments and use the
plan to evict the resident chunk whose next use is farthest away (Belady's OPT), under the
capacity ``device_memory - nonmodel_peak`` of each moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Collection, Iterable

from pscompile.kinds import MomentKind
from pscompile.memory.belady import NextUse, farthest


@dataclass(frozen=True)
class Moment:
    kind: MomentKind
    label: str                # module, backward node, parameter or chunk it belongs to
    need: tuple[int, ...]     # chunks that must be on the device from here on (pinned)
    nonmodel_peak: int        # largest non-model bytes from this moment to the next
    pinned_bytes: int         # chunk bytes pinned on the device during this window (trace pass)
    pinned: tuple[int, ...] = ()  # those chunks


@dataclass(frozen=True)
class AccessPlan:
    moments: tuple[Moment, ...]

    @cached_property
    def _next(self) -> NextUse:
        return NextUse([m.need for m in self.moments])

    def next_use(self, chunk: int, after: int) -> float:
        """Index of the next moment (> ``after``) that needs ``chunk``; the next iteration's
        moments continue the count (cyclic); ``inf`` if no moment needs it."""
        return self._next.at_or_after(chunk, after + 1, cyclic=True)

    def farthest(self, candidates: Iterable[int], after: int, dirty: Collection[int] = ()) -> int:
        """The candidate chunk used farthest in the future (ties: a clean one, then the higher
        chunk id; see ``pscompile.memory.belady``)."""
        return farthest(candidates, self._next, after + 1, cyclic=True, dirty=dirty)

    @cached_property
    def peak_nonmodel(self) -> int:
        return max((m.nonmodel_peak for m in self.moments), default=0)

    def min_device_bytes(self, resident: Collection[int] = (), chunk_bytes: int = 0) -> tuple[int, int]:
        """(bytes, moment index): the smallest budget this iteration can run in, with the chunks
        ``resident`` (of ``chunk_bytes`` each) on the device at every moment besides those pinned."""
        best = (0, -1)
        resident = set(resident)
        for i, m in enumerate(self.moments):
            extra = len(resident - set(m.pinned)) * chunk_bytes
            need = m.pinned_bytes + m.nonmodel_peak + extra
            if need > best[0]:
                best = (need, i)
        return best

    def describe(self, i: int) -> str:
        m = self.moments[i]
        return f"moment {i} ({m.kind} {m.label})"
