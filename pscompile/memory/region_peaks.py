"""What compiled code allocates inside: per labelled range, the peak above its start.

The tracker sees tensors through Python dispatch, so the temporaries an Inductor-compiled region
allocates and frees inside itself are invisible to it. ``torch.profiler`` with ``profile_memory``
records every allocation and free of the allocator with the running total, in the event tree under
the ``record_function`` range that was open. For each range labelled ``prefix + str(k)``, the peak of
that running total inside the range minus its value just before the range opened is what the code
inside allocated at most beyond what was live when it started (its outputs included).
"""

from __future__ import annotations

import bisect

import torch


def allocation_peaks(prof: torch.profiler.profile, prefix: str, device: torch.device) -> dict[int, int]:
    """``k -> bytes`` for every range ``prefix + str(k)`` recorded in ``prof`` (see the module doc)."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int]] = []     # (time ns, running total after the event, its size)
    spans: dict[int, tuple[int, int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.typed[0] == _EventType.Allocation:
            a = n.typed[1]
            if a.device.type == device.type:
                allocs.append((n.start_time_ns, a.total_allocated, a.alloc_size))
            continue
        if n.name.startswith(prefix):
            spans[int(n.name[len(prefix):])] = (n.start_time_ns, n.end_time_ns)
        stack.extend(n.children)
    allocs.sort()
    times = [t for t, _, _ in allocs]
    out = {}
    for k, (start, end) in spans.items():
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        before = allocs[lo - 1][1] if lo > 0 else (allocs[0][1] - allocs[0][2] if allocs else 0)
        inside = [total for _, total, _ in allocs[lo:hi]]
        out[k] = max(0, max(inside, default=before) - before)
    return out
