"""prefetch_fetches: start each fetch as early as memory allows, wait for it where it was.

ANGEL-PTM's scheduler (Algorithm 1, phase 2) advances transfers so they overlap earlier compute,
checking at every step that the earlier start causes no out-of-memory. On a residency plan a fetch
of chunk ``c`` into slot ``k`` planned before node ``i`` may start before node ``j < i`` when:

- slot ``k`` is free on ``[j, i)`` (after the drop of its previous chunk, which in turn follows
  that chunk's writeback);
- no other action touches chunk ``c`` on ``[j, i)`` (its host copy is final: no gradient is stored
  there and no writeback of it is pending);
- one more resident chunk fits under the capacity of every node in ``[j, i)``:
  ``(resident + 1) * slot_bytes + os_device_bytes + max(N[m-1], N[m]) <= device_memory``;
- it moves back at most ``max_distance`` nodes (a bound on the lookahead, not on correctness).

ZeRO's all-gathers move the same way (the collective is issued early, asynchronously, on every
rank at the same place, since every rank plans from the same data). The fetch becomes asynchronous, and a ``wait`` action at its old place blocks the first reader
until the copy has landed::

    before node j:  fetch  chunk c -> slot k     (starts the copy)
    ... nodes j .. i-1 compute while it moves ...
    before node i:  wait   slot k                (the reader needs it now)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pscompile.kinds import MemKind

from .plan_residency import Action, ResidencyPlan


@dataclasses.dataclass(frozen=True)
class PrefetchReport:
    moved: int
    total: int
    mean_distance: float

    @property
    def summary(self) -> str:
        return (f"prefetch_fetches: {self.moved}/{self.total} fetches started earlier, "
                f"{self.mean_distance:.1f} nodes ahead on average")


def resident_counts(plan: ResidencyPlan) -> list[int]:
    """Resident chunks while each node runs, replaying the plan's actions."""
    count = len(plan.initial)
    by_node: dict[int, list[Action]] = {}
    for a in plan.actions:
        by_node.setdefault(a.before, []).append(a)
    out = []
    for i in range(plan.num_nodes):
        for a in by_node.get(i, ()):
            count += 1 if a.decl.arrives else -1 if a.decl.leaves else 0
        out.append(count)
    return out


def prefetch_fetches(plan: ResidencyPlan, nonmodel: Sequence[int], *, budget: int | None,
                     os_device_bytes: int = 0, max_distance: int = 200,
                     windows: Sequence[int] | None = None) -> tuple[ResidencyPlan, PrefetchReport]:
    """``windows``: the per-node capacity windows plan_residency used (default ``max(N[m-1], N[m])``)."""
    T = plan.num_nodes
    resident = resident_counts(plan)

    def window(m: int) -> int:
        if windows is not None:
            return windows[m]
        return max(nonmodel[m - 1] if m > 0 else 0, nonmodel[m])

    def capacity_chunks(m: int) -> float:
        if budget is None:
            return float("inf")
        return (budget - window(m) - os_device_bytes) / plan.slot_bytes

    actions = list(plan.actions)
    last_slot_free: dict[int, int] = {}     # slot -> node index after which it is free
    last_chunk_touch: dict[int, int] = {}   # chunk -> node index of its latest action
    new_actions: list[Action] = []
    moved, distances, total = 0, [], 0
    for a in actions:
        if a.decl.arrives and a.before < T:
            total += 1
            earliest = max(last_slot_free.get(a.slot, 0), last_chunk_touch.get(a.chunk, 0),
                           a.before - max_distance, 0)
            j = a.before
            while j > earliest and resident[j - 1] + 1 <= capacity_chunks(j - 1):
                j -= 1
            if j < a.before:
                for m in range(j, a.before):
                    resident[m] += 1
                new_actions.append(dataclasses.replace(a, before=j, asynchronous=True))
                if not a.asynchronous:       # an asynchronous fetch already has its wait before its reader
                    new_actions.append(Action(a.before, MemKind.WAIT, a.chunk, a.slot, 0))
                moved += 1
                distances.append(a.before - j)
            else:
                new_actions.append(a)
        else:
            new_actions.append(a)
        if a.decl.leaves:
            last_slot_free[a.slot] = a.before
        last_chunk_touch[a.chunk] = a.before
    # actions must stay ordered by the node they precede; within a node, keep the original order
    order = {id(x): k for k, x in enumerate(new_actions)}
    new_actions.sort(key=lambda x: (x.before, order[id(x)]))
    report = PrefetchReport(moved, total, sum(distances) / len(distances) if distances else 0.0)
    peak, peak_node = max((resident[m] * plan.slot_bytes + os_device_bytes + window(m), m) for m in range(T)) \
        if T else (0, 0)
    return dataclasses.replace(plan, actions=tuple(new_actions), peak_device_bytes=peak, peak_node=peak_node), report
