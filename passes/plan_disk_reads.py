"""plan_disk_reads: the disk reads of the chunks whose parameters live on disk, as actions of the plan.

A chunk homed on disk (``memory/disk_homes.py``) reaches the device in two moves: its slot of the
disk tier's file is read into a host staging buffer, then the fetch copies that buffer to the
device. This pass puts each read ``depth`` disk fetches ahead of the fetch that needs it: the read
of the k-th disk fetch goes right after the (k - depth)-th disk fetch (the first ``depth`` reads
before the first node), so at most ``depth`` reads are staged and not yet fetched at any node, and
the disk works while the device computes. ``depth`` is the staging buffers a run may fill ahead
(``HOME_BUFFERS - 2``: one buffer for the chunk being fetched or written home, one for a dirty
chunk's write still landing)::

    disk_read     = pscompile.disk_read(host_40)          # chunk 40: disk -> host staging, 1.0 MiB
    ...
    fetch         = pscompile.fetch(slot_3, host_40)       # then host staging -> device

A chunk whose fetch is asynchronous (``prefetch_fetches``) gets its read placed the same way, by
the order of the fetch actions. The bytes of the reads are the plan's ``disk_read_bytes``.
"""

from __future__ import annotations

import dataclasses

from pscompile.kinds import MemKind

from .plan_residency import Action, ResidencyPlan


def plan_disk_reads(plan: ResidencyPlan, disk_chunks: frozenset[int], *, depth: int, chunk_bytes: int) -> ResidencyPlan:
    """``plan`` with a ``disk_read`` action ``depth`` disk fetches ahead of each fetch of a chunk in
    ``disk_chunks`` (``chunk_bytes``: what one read moves)."""
    if not disk_chunks:
        return plan
    assert depth >= 1, f"disk_read depth {depth}"
    fetches = [i for i, a in enumerate(plan.actions) if a.kind == MemKind.FETCH and a.chunk in disk_chunks]
    reads: dict[int, list[Action]] = {}           # action index to put reads after (-1: at the start)
    for k, i in enumerate(fetches):
        anchor = fetches[k - depth] if k >= depth else -1
        before = plan.actions[anchor].before if anchor >= 0 else 0
        reads.setdefault(anchor, []).append(Action(before, MemKind.DISK_READ, plan.actions[i].chunk, None,
                                                   chunk_bytes))
    actions = list(reads.get(-1, []))
    for i, a in enumerate(plan.actions):
        actions.append(a)
        actions.extend(reads.get(i, []))
    return dataclasses.replace(plan, actions=tuple(actions))
