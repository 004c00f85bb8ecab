"""plan_early_updates: a chunk's optimizer update starts as soon as its gradients are final on the host.

In a training step whose chunks the host updates, most chunks take their last gradient long before
the backward ends, yet go home only at the end: their writebacks are the step's tail, and the
host's AdamW waits for all of them. ZeRO-Offload instead updates a chunk on the CPU while the GPU
goes on with the backward. Here each such chunk's last writeback moves to right after its last use
(its last read or gradient store), and an ``update`` node follows it: there its update starts on a
host thread (``runtime/early_update.py``) while the backward goes on::

    store_grad = pscompile.store_grad(slot_2, ...)       # chunk 5's last gradient
    writeback  = pscompile.writeback(host_5, slot_2)     # goes home now, not at the end
    update     = pscompile.update(host_5)                # its AdamW step starts; the backward goes on
    ...
    drop       = pscompile.drop(slot_2)                  # at the end, as before

The chunk stays in its slot until its drop, as planned, so the device holds exactly what it held
before, and the same bytes move; only the writeback moves earlier (the other copy direction than
the backward's fetches). A chunk evicted in the backward after its last writeback gets its update
after that writeback. At most ``limit`` chunks get an ``update``, the first to be final (the host
keeps an undo copy of each until the step commits: the global norm, the clip factor and the
inf/NaN check are known only then).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from pscompile.kinds import MemKind

from .plan_residency import Action, ResidencyPlan


def _final_writebacks(plan: ResidencyPlan, host_chunks: frozenset[int]) -> dict[int, int]:
    """chunk -> action index of its last writeback, for chunks in ``host_chunks`` whose only later
    actions are drops."""
    out: dict[int, int] = {}
    for i, a in enumerate(plan.actions):
        if a.chunk not in host_chunks:
            continue
        if a.kind == MemKind.WRITEBACK:
            out[a.chunk] = i
        elif not a.decl.leaves:
            out.pop(a.chunk, None)          # touched again: not final (a later writeback may be)
    return out


def plan_early_updates(plan: ResidencyPlan, host_chunks: frozenset[int], last_use: Mapping[int, int], *,
                       limit: int) -> ResidencyPlan:
    """``plan`` with an ``update`` action right after the final writeback of each chunk in
    ``host_chunks`` that is final before the end of the run; a final writeback at the end moves
    first to right after the chunk's last use (``last_use``: chunk -> the last node that reads it
    or after which a gradient is stored into it). The first ``limit`` chunks to be final only."""
    end = plan.num_nodes
    finals = _final_writebacks(plan, host_chunks)
    at: dict[int, int] = {}                       # chunk -> the node its final writeback precedes
    for c, i in finals.items():
        before = plan.actions[i].before
        at[c] = before if before < end else last_use.get(c, end) + 1
    picked = sorted((c for c in at if at[c] < end), key=lambda c: (at[c], c))[:max(limit, 0)]
    if not picked:
        return plan
    moving = {finals[c]: c for c in picked if plan.actions[finals[c]].before >= end}
    staying = {finals[c]: c for c in picked if finals[c] not in moving}
    pending = sorted((at[c], c) for c in moving.values())       # (node, chunk) still to place
    actions: list[Action] = []

    def place(upto: int) -> None:                 # the moved writebacks due before ``upto``
        while pending and pending[0][0] < upto:
            node, c = pending.pop(0)
            actions.append(dataclasses.replace(plan.actions[finals[c]], before=node))
            actions.append(Action(node, MemKind.UPDATE, c, None, 0))

    for i, a in enumerate(plan.actions):
        if i in moving:
            continue
        place(a.before)                           # after every action of the node they precede
        actions.append(a)
        if i in staying:
            actions.append(Action(a.before, MemKind.UPDATE, staying[i], None, 0))
    place(end + 1)
    return dataclasses.replace(plan, actions=tuple(actions))
