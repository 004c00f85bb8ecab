"""overlap_grad_copies: a micro-batch's gradients cross to the host while the backward goes on.

A micro-batch of gradient accumulation adds each gradient into its chunk's fp32 buffer on the
host (``accumulate_grad``). Done synchronously, the backward stops at every gradient until its
copy has crossed the link. Here the copy starts at the ``accumulate_grad`` and the run goes on;
a ``wait`` for that gradient, later, blocks until the copy has landed (and adds it into the
buffer). Until the wait the gradient stays alive on the device, so the plan counts its bytes at
every node in between::

    before node i:  accumulate_grad  g -> acc[c]   (async: the copy starts)
    ... nodes i .. j-1 compute while it crosses; g's bytes are held on the device ...
    before node j:  wait             g             (landed; g may die now)

The wait goes to a node ``j`` that already has memory actions (so it cuts no new compiled
region: memory nodes split the graph into regions, and a region more costs a call) or is the end
of the run, at most ``max_distance`` nodes ahead, with every node of ``[i, j)`` within the budget
once this gradient's bytes are added to what is resident there, the window the residency plan
used and the gradients already held there. Every gradient first gets the nodes up to the next
such boundary; then, in rounds, each moves its wait one boundary later while that fits, so the
room is shared among the gradients rather than taken by the first.

A gradient with no such ``j`` stays synchronous. The bytes held are those of the gradient's
storage, whole: a gradient spanning chunks (one store per page) is one unit, all its pages
started together and waited for at the same node. Nothing moves that did not before: the bytes, the
fetches and the evictions of the plan are unchanged; only the wait times and the peak (the held
bytes) are.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Mapping, Sequence

from pscompile.kinds import MemKind
from pscompile.units import format_bytes

from .plan_residency import Action, ResidencyPlan
from .prefetch_fetches import resident_counts


@dataclasses.dataclass(frozen=True)
class GradOverlapReport:
    overlapped: int        # accumulate_grad actions whose copy runs while later nodes compute
    total: int             # accumulate_grad actions in the plan
    mean_distance: float   # nodes between an overlapped copy's start and its wait, on average
    held_peak: int         # most gradient bytes held on the device at one node

    @property
    def summary(self) -> str:
        return (f"overlap_grad_copies: {self.overlapped}/{self.total} gradient copies overlap compute, "
                f"{self.mean_distance:.1f} nodes on average, at most {format_bytes(self.held_peak)} held")


def overlap_grad_copies(plan: ResidencyPlan, windows: Sequence[int], *, budget: int | None,
                        os_device_bytes: int = 0, grad_bytes: Mapping[str, int] | None = None,
                        max_distance: int = 200) -> tuple[ResidencyPlan, GradOverlapReport]:
    """``windows``: the non-model bytes per node the residency plan was made with (its capacity
    windows); ``grad_bytes``: parameter -> bytes of the storage its gradient keeps alive (default:
    its pages' bytes). A gradient spanning chunks has a store per page; its pages start together
    and all wait at the same node, holding the whole gradient until then. Returns the plan with
    asynchronous accumulate_grad actions, a ``WAIT`` (``slot`` None, ``grad`` the page) for each,
    and the peak including the held gradients."""
    T = plan.num_nodes
    resident = resident_counts(plan)
    held = [0] * T
    boundaries = sorted({a.before for a in plan.actions} | {T})

    def fits(m: int, extra: int) -> bool:
        if budget is None:
            return True
        return resident[m] * plan.slot_bytes + os_device_bytes + windows[m] + held[m] + extra <= budget

    pages: dict[tuple[str, int], list[Action]] = {}     # (parameter, node) -> its accumulate_grad pages
    for a in plan.actions:
        if a.kind == MemKind.ACCUMULATE_GRAD and a.before < T:
            pages.setdefault((a.grad.fqn, a.before), []).append(a)
    # every gradient first gets the compute up to the next boundary, then, round by round, one
    # boundary more while it fits: the room is shared rather than taken by the first gradients
    units = [(key, (grad_bytes or {}).get(key[0], sum(a.nbytes for a in group))) for key, group in pages.items()]
    wait_at = {key: key[1] for key, _ in units}
    growing = list(units)
    while growing:                      # (held bytes only grow: a gradient that stops stays stopped)
        still = []
        for key, nbytes in growing:
            i, j = key[1], wait_at[key]
            k = bisect.bisect_right(boundaries, j)
            b = boundaries[k] if k < len(boundaries) else None
            if b is None or b - i > max_distance or not all(fits(m, nbytes) for m in range(j, b)):
                continue
            for m in range(j, b):
                held[m] += nbytes
            wait_at[key] = b
            still.append((key, nbytes))
        growing = still
    wait_at = {key: j for key, j in wait_at.items() if j > key[1]}
    distances = [j - key[1] for key, j in wait_at.items()]
    new_actions: list[Action] = []
    waits: list[Action] = []
    for a in plan.actions:
        j = wait_at.get((a.grad.fqn, a.before)) if a.kind == MemKind.ACCUMULATE_GRAD else None
        if j is None:
            new_actions.append(a)
            continue
        new_actions.append(dataclasses.replace(a, asynchronous=True))
        waits.append(Action(j, MemKind.WAIT, a.chunk, None, 0, grad=a.grad))
    # a gradient's wait comes first among its node's actions: its bytes go before anything arrives
    order = {id(x): k for k, x in enumerate(new_actions)}
    wait_ids = {id(w) for w in waits}
    merged = sorted(waits + new_actions,
                    key=lambda x: (x.before, 0 if id(x) in wait_ids else 1, order.get(id(x), 0)))
    peak, peak_node = plan.peak_device_bytes, plan.peak_node
    for m in range(T):
        used = resident[m] * plan.slot_bytes + os_device_bytes + windows[m] + held[m]
        if held[m] and used > peak:
            peak, peak_node = used, m
    report = GradOverlapReport(len(waits), sum(len(g) for g in pages.values()),
                               sum(distances) / len(distances) if distances else 0.0, max(held, default=0))
    return dataclasses.replace(plan, actions=tuple(merged), peak_device_bytes=peak, peak_node=peak_node), report
