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
    for k, a in enumerate(actions):
        if a.kind != MemKind.DROP:
            continue
        floor = _last_read(reads, a.chunk, a.before) + 1
        if floor == 0:                     # (never read before its drop: left where it is)
            continue
        for b in actions[:k]:
            if b.before <= a.before and (b.chunk == a.chunk or (a.slot is not None and b.slot == a.slot)):
                floor = max(floor, b.before)
        if floor < a.before:
            actions[k] = dataclasses.replace(a, before=floor)
            moved += 1
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
