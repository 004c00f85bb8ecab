"""early_drops: each drop right after the last read of its chunk, not where its slot is next needed.

``plan_residency`` evicts a chunk where its slot is needed, just before the node that needs the
room. Between its last reader and that node the chunk only holds memory. Moving the drop up to
just after the last reader (and after every action on its slot or chunk before it: its
writeback, a gradient stored into it, the wait for its fetch) frees the slot earlier and changes
nothing else: the same chunks move, and no node reads the chunk in between. The plan's device
bytes fall or stay at every node.

It matters to the compiled program. A memory node is a boundary Inductor's kernels do not cross,
and a drop placed just before the node that needs the room often falls between a large tensor and
its only reader: the loss's gradient (``nll_loss_backward``) and the log-softmax backward that
reads it. The tensor must then be a buffer of its own, written by the same kernel as the
log-probabilities while the logits are still live: a vocabulary-sized buffer more than the plan
left room for (docs/inductor.md, "Where Inductor's buffers exceed the plan"). Dropped after the
head's last read, the loss's kernels run in one segment with the room of the freed slot.

Only a ``drop`` moves (ZeRO's ``release_remote`` and everything else stay); ``prefetch_fetches``
runs after it and may start a fetch into the freed slot earlier, under its own capacity check.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pscompile.kinds import MemKind

from .plan_residency import ResidencyPlan


def early_drops(plan: ResidencyPlan, reads: Sequence[Sequence[int]]) -> tuple[ResidencyPlan, int]:
    """``plan`` with each drop moved up to just after the last reader of its chunk (``reads``: the
    chunks each node reads, in node order) and every earlier action on its slot or chunk; the new
    plan and how many drops moved."""
    actions = list(plan.actions)
    moved = 0
    by_slot: dict[int, int] = {}       # the node of the last action so far on each slot, on each chunk
    by_chunk: dict[int, int] = {}
    for k, a in enumerate(actions):
        last = _last_read(reads, a.chunk, a.before) if a.kind == MemKind.DROP else -1
        if last >= 0:                  # (a drop whose chunk was never read before it stays)
            floor = max(last + 1, by_chunk.get(a.chunk, 0),
                        by_slot.get(a.slot, 0) if a.slot is not None else 0)
            if floor < a.before:
                actions[k] = dataclasses.replace(a, before=floor)
                moved += 1
        by_chunk[a.chunk] = by_slot[a.slot] = actions[k].before       # (actions come in node order)
    if not moved:
        return plan, 0
    order = sorted(range(len(actions)), key=lambda i: actions[i].before)     # (stable: same node, same order)
    return dataclasses.replace(plan, actions=tuple(actions[i] for i in order)), moved


def _last_read(reads: Sequence[Sequence[int]], chunk: int, before: int) -> int:
    """The last node before ``before`` that reads ``chunk``; -1 if none."""
    for i in range(min(before, len(reads)) - 1, -1, -1):
        if chunk in reads[i]:
            return i
    return -1
