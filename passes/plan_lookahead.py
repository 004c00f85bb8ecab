"""plan_lookahead: the next training step's first chunks, fetched by this step after their update.

A training step ends with the AdamW update of its host-updated chunks, and the next step starts by
fetching the chunks its first nodes read: until those land, nothing computes, and the copy overlaps
nothing. This pass picks them from a training plan -- the fetches issued before its first node
that reads a chunk (``prefetch_fetches`` moves as many there as memory allows), in their order --
and gives each a slot. The engine fetches each one right after its update, so the copy overlaps
the rest of the optimizer step, the writebacks still landing and the caller's loop; the next
step runs the warm variant of the plan, which starts with those chunks in their slots, in flight
(``plan_residency(start=..., start_in_flight=True)``: a wait before the first reader of each).
The bytes count in the step that issues the fetches.

Memory: while a step ends, the device holds the chunks resident after its last node (released
as their writebacks land) and the lookahead chunks, next to the non-model bytes of the last node.
A chunk is counted once: the update that precedes its lookahead fetch needs its device copy gone.
Chunks are dropped from the end of the list until that fits the budget.

Slots: each lookahead chunk gets the lowest slot that neither a chunk resident at the end nor a
device-updated chunk holds, so its fetch never waits for a writeback to land. A plan that already
starts from a lookahead (the warm variant) keeps the chunks and slots it started with, so that
one plan repeats step after step; if they do not fit at its end, it fetches none ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pscompile.kinds import MemKind
from pscompile.units import format_bytes

from .plan_residency import ResidencyPlan

__all__ = ["Lookahead", "plan_lookahead", "resident_at_end"]


@dataclass(frozen=True)
class Lookahead:
    fetches: tuple[tuple[int, int], ...]     # (chunk, slot), in the order they are issued
    slot_bytes: int
    peak_device_bytes: int                   # planned, while the step ends

    @property
    def nbytes(self) -> int:
        return len(self.fetches) * self.slot_bytes

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(c for c, _ in self.fetches)

    def summary(self) -> str:
        if not self.fetches:
            return "plan_lookahead: no chunk fetched ahead for the next step"
        pairs = ", ".join(f"{c}->{k}" for c, k in self.fetches)
        return (f"plan_lookahead: {len(self.fetches)} chunk(s) fetched for the next step after their update "
                f"(chunk->slot {pairs}), {format_bytes(self.nbytes)}; peak {format_bytes(self.peak_device_bytes)} "
                "while the step ends")


def resident_at_end(plan: ResidencyPlan) -> dict[int, int]:
    """chunk -> slot resident after the plan's last node, before its final evictions."""
    holds = {k: c for c, k in plan.initial}
    for a in plan.actions:
        if a.before >= plan.num_nodes:
            break
        if a.decl.arrives:
            holds[a.slot] = a.chunk
        elif a.decl.leaves:
            holds.pop(a.slot, None)
    return {c: k for k, c in holds.items()}


def _lead(plan: ResidencyPlan, os_device_chunks: frozenset[int]) -> list[int]:
    """Chunks fetched before the plan's first node that reads a chunk, in issue order."""
    reads = [a.before for a in plan.actions
             if a.kind is MemKind.WAIT or (a.kind is MemKind.FETCH and not a.asynchronous)]
    if not reads:
        return []
    first = min(reads)
    return [a.chunk for a in plan.actions
            if a.kind is MemKind.FETCH and a.before <= first and a.chunk not in os_device_chunks]


def plan_lookahead(plan: ResidencyPlan, windows: Sequence[int], *, budget: int | None, os_device_bytes: int = 0,
                   os_device_chunks: frozenset[int] = frozenset(),
                   fixed: Sequence[tuple[int, int]] | None = None) -> Lookahead:
    """The lookahead of a training ``plan`` (one rank, host-updated chunks); ``windows`` are the
    per-node windows it was planned with. ``fixed``: the (chunk, slot) list it started from (a
    warm variant): kept whole if it fits, else none."""
    end = resident_at_end(plan)
    tail = windows[-1] if len(windows) else 0

    def peak(chunks: list[int]) -> int:
        return len(set(end) | set(chunks)) * plan.slot_bytes + os_device_bytes + tail

    def fits(chunks: list[int]) -> bool:
        return budget is None or peak(chunks) <= budget

    if fixed is not None:
        fetches = tuple(fixed) if fixed and fits([c for c, _ in fixed]) else ()
        return Lookahead(fetches, plan.slot_bytes, peak([c for c, _ in fetches]))
    chunks = _lead(plan, os_device_chunks)
    while chunks and not fits(chunks):
        chunks.pop()
    taken = set(end.values()) | {k for c, k in plan.initial if c in os_device_chunks}
    fetches, k = [], 0
    for c in chunks:
        while k in taken:
            k += 1
        fetches.append((c, k))
        taken.add(k)
    return Lookahead(tuple(fetches), plan.slot_bytes, peak(chunks))
