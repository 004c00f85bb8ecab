"""plan_residency: which parameter chunk sits in which device slot at every node of the graph.

A pure analysis over an *access table*: for each node, the chunks it reads, and the gradients
stored after it. It walks the nodes once, keeping the chunks each node reads on the device and,
when node i's capacity ``device_memory - max(N[i-1], N[i]) - resident optimizer states`` is
exceeded (chunks for node i arrive while node i-1's data is live and stay while node i runs), evicting the resident chunk whose next use is farthest away (Belady's OPT; optimal
for equal-size chunks when the future is known). Among equally far chunks a clean one goes first:
its host copy is still valid, so evicting it costs no copy. Slots are assigned statically, so the
scheduled graph can name the buffer every read comes from.

The iteration starts with the chunks whose optimizer states live on the device resident in slots
0..k-1 (they stay there across iterations: the update runs on the device) and ends with them
resident again; every other chunk ends on the host (written back if it holds gradients), where
its update runs. The actions this produces, in order::

    before node i:  store_grad  (gradients of node i-1)   -> into the chunk's slot, or its host copy
                    (accumulate_grad instead, for a micro-batch of gradient accumulation: added into
                    the chunk's fp32 accumulation buffer on the host; the parameter stays clean)
                    writeback   (dirty victim)            slot -> host, chunk bytes
                                (or, right after its last gradient store, a chunk whose
                                gradients are complete: it stays resident, clean)
                    drop        (victim)                  the slot becomes free
                    fetch       (a chunk node i reads)    host -> slot, chunk bytes

Sharded (ZeRO, ``world > 1``): the planning unit is a communication group of ``world`` chunks
(the layout's "chunk" is the group; rank r owns its r-th shard). A group arrives by ``allgather``
(this rank's shard crosses host -> device, the others come from their owners) and leaves by
``release_remote`` (nothing is copied: every shard has its home on its owner). Gradients go into
the gathered group, which the caller keeps resident from its first gradient to its last (its
reads include the group there); right after its last gradient the group is ``reduce_scatter``ed
(each rank receives the sum of its own shard, written to its host home, or added into its fp32
accumulation shard for a micro-batch) and released::

    before node i:  store_grad ... (the group's last gradients, into its slot)
                    reduce_scatter (group g)              slot -> own shard on the host, shard bytes
                    release_remote (group g)              the slot becomes free

Per-chunk collectives (``per_chunk``; the memory-saving variant for many ranks): the unit is one
chunk, owned by rank ``c % world``; it arrives by ``broadcast`` from its owner (only the owner's
link carries it) and its gradients go by ``reduce`` to the owner, so a slot is one chunk, never a
group. Bytes differ per rank, so the plan is ``rank``'s.

Two victim policies (``policy``):

- ``"belady"`` (the default): demand fetching with farthest-next-use eviction, as above; the
  fewest fetches there are. ``prefetch_fetches`` then starts each fetch as early as it fits.
- ``"angel"``: ANGEL-PTM's unified scheduler (Algorithm 1, phase 1), the comparison: moves are
  prioritised. After a node's own chunks, every chunk that will be read later is fetched at once,
  in order of first use, as long as there is room at that node. When a later node needs room,
  the *last* move is taken back first (LIFO, the algorithm's "pop the last
  movement task"): a chunk fetched ahead and not yet read is un-fetched (its fetch is cancelled,
  nothing moves) and waits until room frees; chunks whose use in this run is over go before
  that. Phase 2 (gathers advanced to the earliest point without running out of memory) is
  ``prefetch_fetches``, which both policies share.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pscompile.errors import ResidencyError
from pscompile.graph.ops import OpDecl, decl_for
from pscompile.kinds import MemKind, Policy
from pscompile.memory.belady import NextUse, farthest
from pscompile.units import format_bytes

__all__ = ["GradStore", "Action", "ResidencyPlan", "ResidencyError", "arrivals", "arrival_windows", "plan_residency",
           "POLICIES"]

POLICIES = ("belady", "angel")   # victim policies of ``plan_residency`` (the module doc)


@dataclass(frozen=True)
class GradStore:
    """One gradient (or one page of it, for a tensor that spans chunks) going into its chunk."""

    chunk: int
    fqn: str
    offset: int      # element offset of the parameter (its page) inside the chunk
    nbytes: int      # bytes of the gradient (its page)
    start: int = 0   # first element of the page inside the flattened gradient
    numel: int = -1  # elements of the page (-1: the whole gradient)


@dataclass(frozen=True)
class Action:
    before: int                # index of the node this action precedes (== num_nodes: the end)
    kind: MemKind              # STORE_GRAD | ACCUMULATE_GRAD | WRITEBACK | DROP | FETCH | WAIT
    chunk: int
    slot: int | None           # None: a store_grad into the host copy, or an accumulate_grad
    nbytes: int                # bytes copied between tiers
    grad: GradStore | None = None
    asynchronous: bool = False  # a fetch started early (prefetch_fetches); a WAIT action marks its old place
    comm_bytes: int = 0        # ALLGATHER: bytes received from other ranks; REDUCE_SCATTER: bytes sent
    to_acc: bool = False       # REDUCE_SCATTER: added into the fp32 accumulation shard, not the host home

    @property
    def decl(self) -> OpDecl:
        """The declaration of the op that performs it (what it does to residency among it)."""
        return decl_for(self.kind, slot=self.slot)


@dataclass(frozen=True)
class ResidencyPlan:
    actions: tuple[Action, ...]
    num_nodes: int
    num_slots: int
    initial: tuple[tuple[int, int], ...]      # (chunk, slot) resident when the iteration starts
    final: tuple[tuple[int, int], ...]        # (chunk, slot) resident when it ends
    slot_bytes: int
    peak_device_bytes: int                    # planned: resident chunks + optimizer states + N[i]
    peak_node: int
    h2d_bytes: int
    d2h_bytes: int
    num_fetches: int
    num_evictions: int
    world: int = 1                            # ranks the groups are sharded over (1: no ZeRO)
    allgather_bytes: int = 0                  # received from other ranks, per rank
    reduce_scatter_bytes: int = 0             # sent to other ranks, per rank
    policy: str = "belady"                    # how victims and fetch times were chosen (the module doc)

    def summary(self, budget: int | None) -> str:
        b = "unlimited" if budget is None else format_bytes(budget)
        comm = (f", {format_bytes(self.allgather_bytes)} all-gathered, "
                f"{format_bytes(self.reduce_scatter_bytes)} reduce-scattered over {self.world} ranks"
                if self.world > 1 else "")
        how = " (ANGEL-PTM Algorithm 1: moves first, the last move taken back)" if self.policy == Policy.ANGEL else ""
        return (f"plan_residency{how}: {self.num_slots} slots, {self.num_fetches} fetches, "
                f"{self.num_evictions} evictions, {format_bytes(self.h2d_bytes + self.d2h_bytes)} moved{comm}, "
                f"peak {format_bytes(self.peak_device_bytes)} <= {b}")


@dataclass
class _State:
    resident: dict[int, int] = field(default_factory=dict)   # chunk -> slot
    dirty: set[int] = field(default_factory=set)
    free: list[int] = field(default_factory=list)
    num_slots: int = 0

    def take_slot(self) -> int:
        if self.free:
            return self.free.pop(0)
        self.num_slots += 1
        return self.num_slots - 1


def arrival_windows(nonmodel: Sequence[int], executed: Sequence[bool]) -> tuple[int, ...]:
    """Per node, the non-model bytes its chunks must fit next to.

    The memory nodes planned before node ``i`` run right after the last node that really executes
    before it (``p``), while ``p``'s bytes are live; node ``i`` then runs with ``N[i]``. Nodes that
    do not execute at their place (parameter views, rebuilt right before each reader, and the
    output) add nothing of their own. So the window of an executed node is ``max(N[p], N[i])``,
    and of any other node ``N[p]`` (0 before the first node). ``verify_schedule`` charges the
    scheduled graph by the same rule."""
    before = arrivals(nonmodel, executed)
    return tuple(max(b, n) if ran else b for b, n, ran in zip(before, nonmodel, executed))


def arrivals(nonmodel: Sequence[int], executed: Sequence[bool]) -> tuple[int, ...]:
    """Per node, the bytes of the last executed node before it (0 before the first): what is live,
    at most, when the memory nodes planned before it run."""
    out, last = [], 0
    for n, ran in zip(nonmodel, executed):
        out.append(last)
        if ran:
            last = n
    return tuple(out)


def plan_residency(reads: Sequence[Sequence[int]], nonmodel: Sequence[int], *,
                   stores: Mapping[int, Sequence[GradStore]], num_chunks: int, slot_bytes: int,
                   budget: int | None, os_device_chunks: frozenset[int] = frozenset(),
                   os_device_bytes: int = 0, accumulate: bool = False,
                   start: Mapping[int, int] | None = None, keep_at_end: bool = False,
                   end: Mapping[int, int] | None = None,
                   describe_node=lambda i: f"node {i}",
                   windows: Sequence[int] | None = None, world: int = 1, rank: int = 0,
                   per_chunk: bool = False, start_in_flight: bool = False,
                   policy: str = "belady", device_shards: frozenset[int] = frozenset(),
                   fetch_bytes: Sequence[int] | None = None) -> ResidencyPlan:
    """Plan residency for ``len(reads)`` nodes. ``stores[i]`` are the gradients stored right
    after node ``i`` (``accumulate``: added into host accumulation buffers instead, so no chunk
    becomes dirty). Raises ``ResidencyError`` naming the node when the budget is too small.

    Warm runs (a loop of micro-batches or evaluations, where nothing is updated between runs):
    ``keep_at_end`` leaves the clean chunks resident at the end instead of evicting them, choosing
    victims by their next use in the *next* run (cyclic Belady); ``start`` (chunk -> slot) are
    clean chunks already resident when the run starts, besides the optimizer-state chunks; ``end``
    (chunk -> slot) is the residency the run must finish with (fixed up after the last node), so a
    plan whose ``start`` and ``end`` are one residency repeats for any number of runs.

    ``start_in_flight``: the ``start`` chunks are still arriving when the run starts (a training
    step fetched them for this one after its update, ``plan_lookahead``): each gets a ``wait``
    before the first node that reads it, or before its eviction if none does first.

    ``world > 1``: chunks are communication groups sharded over ``world`` ranks (see the module
    docstring); ``reads`` must keep each group resident from its first gradient store to its last
    (``analysis.node_reads`` does).

    ``policy``: ``"belady"`` or ``"angel"`` (the module doc). ``device_shards`` (ZeRO): groups whose
    own shard lives on this rank's device: their gathers and reductions move no link bytes (a
    reduction into the accumulation buffer on the host still does).

    Long on purpose: one Belady simulation over the access sequence. Its closures share the residency
    being simulated (slots, next uses, pending stores and copies); as separate functions each would
    take that whole state.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not a residency policy; use one of {POLICIES}")
    angel = policy == Policy.ANGEL
    T = len(reads)
    assert len(nonmodel) == T
    next_use = NextUse(reads)      # cyclic when clean chunks stay for the next run (keep_at_end)

    def window(i: int) -> int:
        # chunks for node i arrive while the previous node's data is still live, and stay while node
        # i runs (``windows``: the same with "previous" meaning the last executed node)
        if windows is not None:
            return windows[i]
        return max(nonmodel[i - 1] if i > 0 else 0, nonmodel[i])

    def capacity(i: int) -> float:
        if budget is None:
            return float("inf")
        return budget - window(i) - os_device_bytes

    st = _State()
    actions: list[Action] = []
    initial = []
    for c in sorted(os_device_chunks):
        st.resident[c] = st.take_slot()
        initial.append((c, st.resident[c]))
    for c, k in sorted((start or {}).items(), key=lambda x: x[1]):
        if c in os_device_chunks:
            continue
        assert k >= st.num_slots and k not in st.resident.values(), f"start: slot {k} of chunk {c} is taken"
        st.free.extend(range(st.num_slots, k))
        st.num_slots = k + 1
        st.resident[c] = k
        initial.append((c, k))
    initial.sort(key=lambda x: x[1])
    arriving = {c for c in (start or {}) if c not in os_device_chunks} if start_in_flight else set()

    order = itertools.count()
    moved_at: dict[int, int] = {}    # angel: chunk -> order of its move (the last move is taken back first)
    ahead: dict[int, int] = {}       # angel: chunk fetched ahead, not used yet -> index of its fetch action

    def land(c: int, before: int) -> None:
        if c in arriving:
            arriving.discard(c)
            actions.append(Action(before, MemKind.WAIT, c, st.resident[c], 0))
    h2d = d2h = fetches = evictions = gathered = scattered = 0
    peak, peak_node = 0, 0
    sharded = world > 1

    def owner_bytes(c: int, *, to_host: bool = False) -> tuple[int, int]:
        """(bytes over this rank's link, bytes with other ranks) of one collective on chunk/group c
        (``to_host``: its shard goes to the host even where its home is the device; an NF4 group
        moves its packed bytes, ``fetch_bytes``)."""
        moved = slot_bytes if fetch_bytes is None else fetch_bytes[c]
        link, comm = (moved // world, moved - moved // world) if not per_chunk else \
            (moved, 0) if c % world == rank else (0, moved)
        return (0 if c in device_shards and not to_host else link), comm
    grads_left = {}                                   # chunk/group -> gradients still to store
    for gs in stores.values():
        for g in gs:
            grads_left[g.chunk] = grads_left.get(g.chunk, 0) + 1

    def write_back(c: int, before: int) -> None:
        nonlocal d2h
        actions.append(Action(before, MemKind.WRITEBACK, c, st.resident[c], slot_bytes))
        d2h += slot_bytes
        st.dirty.discard(c)

    def take_back(c: int) -> None:
        """angel: un-fetch a chunk fetched ahead and not used since (nothing moves; it waits for room)."""
        nonlocal h2d, fetches, gathered
        k = ahead.pop(c)
        a = actions[k]
        actions[k] = None
        h2d -= a.nbytes
        gathered -= a.comm_bytes
        fetches -= 1
        arriving.discard(c)
        bisect.insort(st.free, st.resident.pop(c))

    def evict(c: int, before: int) -> None:
        nonlocal d2h, evictions
        if c in ahead:
            take_back(c)
            return
        land(c, before)
        if c in st.dirty:
            assert not sharded, f"group {c} would be released with unreduced gradients"
            write_back(c, before)
        slot = st.resident.pop(c)
        actions.append(Action(before, MemKind.RELEASE_REMOTE if sharded else MemKind.DROP, c, slot, 0))
        evictions += 1
        bisect.insort(st.free, slot)

    def fetch(c: int, before: int, slot: int | None = None, asynchronous: bool = False) -> int:
        """Fetch (or gather) chunk c before node ``before``; returns the index of its action.
        ``asynchronous``: its reader waits for it (a ``wait`` before its first use, ``land``)."""
        nonlocal h2d, fetches, gathered
        slot = st.take_slot() if slot is None else slot
        st.resident[c] = slot
        moved_at[c] = next(order)
        if sharded:
            link, comm = owner_bytes(c)
            actions.append(Action(before, MemKind.BROADCAST if per_chunk else MemKind.ALLGATHER, c, slot, link,
                                  asynchronous=asynchronous, comm_bytes=comm))
            h2d += link
            gathered += comm
        else:
            moved = slot_bytes if fetch_bytes is None else fetch_bytes[c]   # (NF4: the packed bytes)
            actions.append(Action(before, MemKind.FETCH, c, slot, moved, asynchronous=asynchronous))
            h2d += moved
        fetches += 1
        if asynchronous:
            arriving.add(c)
        return len(actions) - 1

    def fill(i: int) -> None:
        """angel: after node i's own chunks, fetch every chunk read later in this run, in order of
        first use, while there is room at node i (a later node short of room takes them back)."""
        later = sorted((j, c) for c in range(num_chunks) if c not in st.resident and c not in os_device_chunks
                       for j in (next_use.at_or_after(c, i + 1, cyclic=False),) if j < T)
        for _, c in later:
            if (len(st.resident) + 1) * slot_bytes > capacity(i):
                break
            ahead[c] = fetch(c, i, asynchronous=True)

    def reduce_scatter(c: int, before: int) -> None:
        nonlocal d2h, scattered
        link, comm = owner_bytes(c, to_host=accumulate)
        actions.append(Action(before, MemKind.REDUCE if per_chunk else MemKind.REDUCE_SCATTER, c, st.resident[c],
                              link, comm_bytes=comm, to_acc=accumulate))
        d2h += link
        scattered += comm
        st.dirty.discard(c)
        evict(c, before)

    for i in range(T + 1):
        completed = []                                # chunks whose last gradient is stored here
        for g in stores.get(i - 1, ()):               # gradients of node i-1 go into their chunk
            if sharded:
                if g.chunk not in st.resident:
                    raise AssertionError(f"group {g.chunk} is not gathered when the gradient of {g.fqn} "
                                         "is stored (its reads must hold it from first to last gradient)")
                ahead.pop(g.chunk, None)
                actions.append(Action(i, MemKind.STORE_GRAD, g.chunk, st.resident[g.chunk], 0, g))
                st.dirty.add(g.chunk)
                grads_left[g.chunk] -= 1
                if grads_left[g.chunk] == 0:          # the group's gradients are complete
                    reduce_scatter(g.chunk, i)
            elif accumulate:
                actions.append(Action(i, MemKind.ACCUMULATE_GRAD, g.chunk, None, g.nbytes, g))
                d2h += g.nbytes
            elif g.chunk in st.resident:
                land(g.chunk, i)
                ahead.pop(g.chunk, None)
                actions.append(Action(i, MemKind.STORE_GRAD, g.chunk, st.resident[g.chunk], 0, g))
                st.dirty.add(g.chunk)
            else:
                actions.append(Action(i, MemKind.STORE_GRAD, g.chunk, None, g.nbytes, g))
                d2h += g.nbytes
            if not sharded:
                grads_left[g.chunk] -= 1
                if grads_left[g.chunk] == 0:
                    completed.append(g.chunk)
        # a host-updated chunk whose gradients are complete goes home now, while the backward goes
        # on (the writeback it needs anyway, only earlier: the device->host engine is idle
        # otherwise); it stays resident, clean, until the plan evicts it with a drop
        for c in completed:
            if c in st.dirty and c not in os_device_chunks:
                write_back(c, i)
        if i == T:
            break
        need = list(dict.fromkeys(reads[i]))
        for c in need:
            land(c, i)
            ahead.pop(c, None)
        limit = capacity(i)
        if len(need) * slot_bytes > limit:
            minimum = len(need) * slot_bytes + window(i) + os_device_bytes
            raise ResidencyError(
                f"device_memory={budget} bytes is below the minimum {minimum} bytes needed at {describe_node(i)}: "
                f"{len(need)} chunk(s) of {slot_bytes} bytes read there + {window(i)} "
                f"bytes of non-model data + {os_device_bytes} bytes of optimizer states on the device", i, minimum)
        missing = [c for c in need if c not in st.resident]
        while (len(st.resident) + len(missing)) * slot_bytes > limit:
            victims = [c for c in st.resident if c not in need and c not in os_device_chunks]
            if not victims:
                homed = len(os_device_chunks) * slot_bytes + os_device_bytes
                raise ResidencyError(
                    f"device_memory={budget} bytes cannot hold the chunks pinned at {describe_node(i)}: "
                    f"{len(os_device_chunks)} chunk(s) living on the device with their optimizer states take "
                    f"{homed} bytes, and {len(need)} chunk(s) read there + {window(i)} bytes of non-model data "
                    "need the rest", i, -1)
            if angel:     # uses over in this run first, then the last move
                victim = max(victims, key=lambda c: (next_use.at_or_after(c, i, cyclic=False) == float("inf"),
                                                     moved_at.get(c, -1), c))
            else:
                victim = farthest(victims, next_use, i, cyclic=keep_at_end, dirty=st.dirty)
            evict(victim, i)
        for c in missing:
            fetch(c, i)
        if angel:
            fill(i)
        used = len(st.resident) * slot_bytes + os_device_bytes + window(i)
        if used > peak:
            peak, peak_node = used, i
    # the end: chunks updated on the host go home (clean ones may stay for a warm next run);
    # device-updated ones must be resident
    want = dict(end) if end is not None else None
    for c in sorted(st.resident):
        if c in os_device_chunks:
            continue
        if want is not None:
            if want.get(c) != st.resident[c] or c in st.dirty:
                evict(c, T)
        elif not keep_at_end or c in st.dirty:
            evict(c, T)
    for c in sorted(os_device_chunks):
        if c not in st.resident:
            fetch(c, T)
    for c, k in sorted((want or {}).items()):
        if c not in st.resident:                        # into the very slot the next run expects
            st.free.remove(k) if k in st.free else None
            st.num_slots = max(st.num_slots, k + 1)
            fetch(c, T, slot=k)
    final = tuple(sorted(st.resident.items(), key=lambda x: x[1]))
    if angel:                  # moves taken back: the peak is the one of the moves that remain
        actions = [a for a in actions if a is not None]
        peak, peak_node = _replayed_peak(actions, len(initial), T, window, slot_bytes, os_device_bytes)
    return ResidencyPlan(tuple(actions), T, st.num_slots, tuple(initial), final, slot_bytes, peak, peak_node,
                         h2d, d2h, fetches, evictions, world, gathered, scattered, policy)


def _replayed_peak(actions: Sequence[Action], resident: int, T: int, window, slot_bytes: int,
                   os_device_bytes: int) -> tuple[int, int]:
    """(peak bytes, node) of ``actions`` replayed from ``resident`` chunks: the chunks resident
    while each node runs, next to its window and the optimizer states on the device."""
    peak, node, k = 0, 0, 0
    for i in range(T):
        while k < len(actions) and actions[k].before == i:
            resident += actions[k].decl.arrives - actions[k].decl.leaves
            k += 1
        used = resident * slot_bytes + os_device_bytes + window(i)
        if used > peak:
            peak, node = used, i
    return peak, node
