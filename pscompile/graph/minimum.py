"""The smallest budget a schedule fits, and the activation plan that lets it fit
(``graph/pipeline.py`` runs these between analysis and scheduling).

    minimum_budget(analyzed, layout, nonmodel=, ...)                         -> Minimum
        max over nodes of (chunks read there x slot bytes + the non-model window)
    choose_activations(analyzed, layout, policy=, budget=, ...)           -> AnalyzedGraph
        recompute_activations  the saved activations of the fewest segments that let the
                               schedule fit the budget, recomputed in the backward (then the
                               two analyses again, on the rewritten graph); offloads likewise
    least_budget / config_least: the smallest budget over the activation choices a policy allows
    program_least: that budget with the room Inductor's program needs (the default backend)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence

from torch import fx

from pscompile.config import Config
from pscompile.graph.analysis import (
    AnalyzedGraph,
    _analyze,
    _Passes,
    describe_node,
    node_reads,
    node_windows,
    regather,
)
from pscompile.kinds import Activations, Backend, Collectives, Mode
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.rates import Rates
from pscompile.memory.model_bytes import ModelBytes, dequant_workspace, device_homable, owned_chunks
from pscompile.memory.tiers import Tier
from pscompile.passes.offload_activations import find_offloads, offload_activations
from pscompile.passes.recompute_activations import (
    ActivationPlan,
    find_segments,
    recompute_activations,
)
from pscompile.units import format_bytes


@dataclass(frozen=True)
class Minimum:
    """The smallest budget a capture's schedules fit in, and the node that sets it."""

    nbytes: int          # chunks read at ``node`` x slot bytes + its window of non-model bytes
    node: int            # index in the captured graph
    chunks: int          # chunks ``node`` reads
    slot_bytes: int
    window: int          # non-model bytes its chunks must fit next to

    def describe(self, nodes: Sequence[fx.Node]) -> str:
        return (f"at {describe_node(nodes[self.node])}, {self.chunks} chunk(s) of {self.slot_bytes} bytes "
                f"read there + {self.window} bytes of non-model data")


def minimum_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, *, nonmodel: Sequence[int],
                   slot_bytes: int, world: int = 1, device_homes: int = 0, state_bytes: int = 0) -> Minimum:
    """The smallest ``device_memory`` every schedule of ``analyzed`` fits in with this layout and
    curve: at every node, the chunks it reads next to its window (``node_windows``), optimizer
    states on the host. plan_residency succeeds at any budget from here up (it may evict everything
    else), and so do the passes after it, which keep its per-node bounds. Sharded (``world > 1``),
    a group that holds some of its gradients counts as read until it holds all of them.
    ``device_homes``: the first chunks live on the device for the whole iteration (the host cannot
    hold them), each with ``state_bytes`` of optimizer states."""
    reads = node_reads(analyzed.captured, layout, hold_grads=analyzed.grad_store_points if world > 1 else None)
    windows = node_windows(analyzed.captured, nonmodel)
    best = Minimum(0, 0, 0, slot_bytes, 0)
    homes = set(device_homable(layout)[:device_homes])     # (the first chunks whose kind may live there)
    # their states: over each one's state extent (ZeRO: whole shards, ``state_bytes`` each)
    states = device_homes * state_bytes if world > 1 else \
        sum(map(layout.state_extent, homes)) * state_bytes // layout.chunk_size
    states += dequant_workspace(layout)     # (an NF4 chunk's landing: fixed bytes, as the engines count them)
    for i, (chunks, w) in enumerate(zip(reads, windows)):
        chunks = set(chunks) | homes
        need = len(chunks) * slot_bytes + w + states
        if need > best.nbytes:
            best = Minimum(need, i, len(chunks), slot_bytes, w)
    return best


def _cheaper_ways(by_size: Sequence, offloads: Mapping, offload_bytes: Callable, rates: Rates | None,
                  room: int | None) -> list[str]:
    """"auto": each segment the cheaper way, recomputed or offloaded (offloads while the host has
    ``room``; without ``rates`` none)."""
    mixed = []
    for s in by_size:
        cheaper = (rates is not None and s.index in offloads
                   and rates.offload_s(offload_bytes(s), s.flops) < rates.recompute_s(s.flops)
                   and (room is None or offload_bytes(s) <= room))
        mixed.append(Activations.OFFLOAD if cheaper else Activations.RECOMPUTE)
        if cheaper and room is not None:
            room -= offload_bytes(s)
    return mixed


class _Variants:
    """The rewritten graphs ``choose_activations`` weighs: the first ``m`` segments by saved bytes,
    each recomputed or offloaded, rewritten and analyzed once (``cache``; one serves every layout)."""

    def __init__(self, analyzed: AnalyzedGraph, policy: str, segments, offloads: Mapping, by_size: Sequence,
                 cache: dict[tuple, AnalyzedGraph]):
        self.analyzed, self.policy, self.segments = analyzed, policy, segments
        self.offloads, self.by_size, self.cache = offloads, by_size, cache

    def offload_bytes(self, s) -> int:
        return sum(o.nbytes for o in self.offloads.get(s.index, ()))

    def make(self, m: int, how_each: Sequence[str], overlap: bool = False) -> AnalyzedGraph:
        chosen = self.by_size[:m]
        rec = [s for s, how in zip(chosen, how_each) if how == Activations.RECOMPUTE]
        off = [s for s, how in zip(chosen, how_each) if how == Activations.OFFLOAD]
        overlap = overlap and bool(off)
        key = (tuple(s.index for s in rec), tuple(s.index for s in off), overlap)
        if key not in self.cache:
            plan = ActivationPlan(self.policy, self.segments, tuple(sorted(s.index for s in rec)),
                                  tuple(sorted(s.index for s in off)), sum(map(self.offload_bytes, off)), overlap)
            self.cache[key] = self._rewrite(rec, off, plan, overlap)
        # one cache serves every layout: a rewrite is analyzed once, and carries this layout's gathers
        got = regather(self.cache[key], self.analyzed.gathers)
        return replace(got, activations=replace(got.activations, policy=self.policy))

    def _rewrite(self, rec: list, off: list, plan: ActivationPlan, overlap: bool) -> AnalyzedGraph:
        analyzed, segments = self.analyzed, self.segments
        if not rec and not off:
            return replace(analyzed, activations=plan)
        passes = _Passes(analyzed.passes)
        captured = analyzed.captured
        if rec:
            captured = passes.run("recompute_activations", lambda: recompute_activations(captured, rec),
                                  lambda c: f"recompute_activations: {len(rec)} of {len(segments)} segments, "
                                            f"{format_bytes(sum(s.saved_bytes for s in rec))} of saved "
                                            f"activations recomputed")
        if off:
            moves = [o for s in off for o in self.offloads[s.index]]
            captured = passes.run("offload_activations",
                                  lambda: offload_activations(captured, moves, overlap=overlap),
                                  lambda c: f"offload_activations: {len(off)} of {len(segments)} segments, "
                                            f"{len(moves)} storages, {format_bytes(plan.offload_bytes)} of "
                                            f"saved activations wait on the host"
                                            + (", copies overlapped" if overlap else ""))
        return _analyze(captured, passes, plan, analyzed.gathers)


def loss_segment_last(by_size: list, segments: Sequence) -> list:
    """``by_size`` with the forward's last segment (the one the loss ends) moved last, so that
    "auto" takes it only when the others do not fit. The loss reads its saved values and the
    backward reads them right after, so taking them off the device lowers the curve only between
    those two nodes; and its recomputation lands in the compute region of its forward, which
    Inductor fuses into kernels that hold both (the 4-layer d=128 GPT with a 2048 vocabulary at
    1.15x its minimum: Inductor's buffers over the plan by 3,058,721 bytes with it recomputed,
    927,777 without)."""
    last = segments[-1].index if segments else None
    return [s for s in by_size if s.index != last] + [s for s in by_size if s.index == last]


@dataclass(frozen=True)
class ActivationChoice:
    """What ``choose_activations`` chose: the first ``segments`` of the segments by saved bytes,
    each taken off the device as ``ways`` says (one per segment, "keep" / "recompute" /
    "offload"), offloads overlapped with compute or not, and whether the result fits the budget (a
    refusal does not)."""

    segments: int
    ways: tuple[str, ...]
    overlap: bool
    fits: bool


class ChoicesKept(Protocol):
    """Activation choices kept across processes (``compiled.choice_store.ChoiceStore``): ``facts``
    are everything a choice depends on besides the capture ``gm``."""

    def recall_activations(self, gm: fx.GraphModule, facts: tuple,
                           check: Callable[[ActivationChoice], None]) -> ActivationChoice | None: ...

    def keep_activations(self, gm: fx.GraphModule, facts: tuple, choice: ActivationChoice) -> None: ...


def choose_activations(analyzed: AnalyzedGraph, layout: ChunkLayout, *, policy: str, budget: int | None,
                       slot_bytes: int, world: int = 1, device_homes: int = 0, state_bytes: int = 0,
                       variants: dict[tuple, AnalyzedGraph] | None = None, rates: Rates | None = None,
                       host_room: int | None = None, kept: ChoicesKept | None = None) -> AnalyzedGraph:
    """The analyzed graph to plan with under ``policy`` (``Config.activations``).

    "keep": ``analyzed`` as it is. "recompute": every segment with saved activations recomputed.
    "offload": every segment's offloadable storages (``offload_activations.find_offloads``) on the
    host, the rest kept; ``ValueError`` if the host has no room for them (``host_room`` bytes besides
    the chunks; None: unlimited). "auto": none when the graph fits ``budget`` as it is
    (``minimum_budget`` on its static curve), else the fewest segments, largest saved bytes first,
    that let it fit (by bisection), each taken off the device the cheaper way by ``rates``:
    recomputed (its FLOPs at the device's rate) or offloaded (its bytes twice over the link, less
    what overlaps compute: ``Rates.offload_s``; only while the host has room; without ``rates``
    never). If all of them that way do not fit, the
    fewest recomputed, or else offloaded, that fit. Below the least budget of all recomputed and
    all offloaded it refuses (the graph it returns does not fit), even where a mix would fit: the
    least budget (``least_budget``) must not depend on the measured rates. ``variants`` (a dict, initially empty) lets a
    caller that plans one capture at many budgets rewrite each graph once. ``kept``: a choice made
    by an earlier process on the same capture and facts is taken from it (checked: its segments
    exist and it fits as it did), and a choice made here is told to it."""
    if policy == Activations.KEEP or not analyzed.captured.backward:
        return analyzed
    segments = find_segments(analyzed.captured)
    offloads = find_offloads(analyzed.captured, segments)
    by_size = loss_segment_last(sorted(segments, key=lambda s: -s.saved_bytes), segments)
    cache: dict[tuple, AnalyzedGraph] = {} if variants is None else variants

    variants_of = _Variants(analyzed, policy, segments, offloads, by_size, cache)
    offload_bytes = variants_of.offload_bytes
    total_offload = sum(map(offload_bytes, segments))
    host_fits_all = host_room is None or total_offload <= host_room
    if policy == Activations.OFFLOAD and not host_fits_all:
        raise ValueError(f"activations='offload': the saved activations need {format_bytes(total_offload)} of host "
                         f"memory besides the chunks and host_memory leaves {format_bytes(host_room)}; give more "
                         f"host_memory, or activations='auto' (recomputes what the host cannot take)")
    mixed = _cheaper_ways(by_size, offloads, offload_bytes, rates, host_room)
    choosing = _Choosing(variants_of, layout, budget, dict(slot_bytes=slot_bytes, world=world,
                                                           device_homes=device_homes, state_bytes=state_bytes))
    if kept is None:
        choice = choosing.choose(mixed, host_fits_all)
    else:
        # (the host's room and the rates count only through whether it holds every offload and ``mixed``:
        # both are measured, a little differently in each process)
        facts = (policy, budget, slot_bytes, world, device_homes, state_bytes, host_fits_all, tuple(mixed),
                 _layout_digest(layout), _hash_ints(analyzed.nonmodel), sorted((analyzed.gathers or {}).items()))
        choice = kept.recall_activations(analyzed.captured.gm, facts, choosing.check)
        if choice is None:
            choice = choosing.choose(mixed, host_fits_all)
            kept.keep_activations(analyzed.captured.gm, facts, choice)
    return variants_of.make(choice.segments, choice.ways, overlap=choice.overlap)


class _Choosing:
    """``choose_activations``'s search over the variants at one budget: ``choose`` finds the choice,
    ``check`` says whether a kept one holds for this graph."""

    def __init__(self, variants: _Variants, layout: ChunkLayout, budget: int | None, sizes: dict):
        self.variants, self.layout, self.budget, self.sizes = variants, layout, budget, sizes
        self.n = len(variants.by_size)
        self.policy = variants.policy
        self.every = {Activations.RECOMPUTE: [Activations.RECOMPUTE] * self.n,
                      Activations.OFFLOAD: [Activations.OFFLOAD if s.index in variants.offloads else Activations.KEEP
                                            for s in variants.by_size]}

    def least(self, a: AnalyzedGraph) -> int:
        return minimum_budget(a, self.layout, nonmodel=a.nonmodel, **self.sizes).nbytes

    def fits_graph(self, a: AnalyzedGraph) -> bool:
        return self.budget is None or self.least(a) <= self.budget

    def fits(self, m: int, how_each: Sequence[str]) -> bool:
        return self.fits_graph(self.variants.make(m, how_each))

    def with_first(self, m: int, how_each: Sequence[str]) -> ActivationChoice:
        """The choice: offloads overlapped with compute where that still fits (a reload issued one
        ahead holds its bytes longer), else waited for where they are."""
        make = self.variants.make
        overlap = Activations.OFFLOAD in how_each[:m] and self.fits_graph(make(m, how_each, overlap=True))
        return ActivationChoice(m, tuple(how_each), overlap, self.fits_graph(make(m, how_each, overlap=overlap)))

    def check(self, choice: ActivationChoice) -> None:
        """Raises ValueError unless ``choice`` names this graph's segments and fits as it did."""
        by_size, offloads = self.variants.by_size, self.variants.offloads
        if not 0 <= choice.segments <= self.n or len(choice.ways) != self.n:
            raise ValueError(f"it takes {choice.segments} of {len(choice.ways)} segments, this graph has {self.n}")
        for s, way in zip(by_size[:choice.segments], choice.ways):
            if way not in (Activations.KEEP, Activations.RECOMPUTE, Activations.OFFLOAD) or (way == Activations.OFFLOAD and s.index not in offloads):
                raise ValueError(f"segment {s.index} cannot be taken off the device as {way!r}")
        got = self.variants.make(choice.segments, choice.ways, overlap=choice.overlap)
        if self.fits_graph(got) != choice.fits:
            raise ValueError(f"it {'fit' if choice.fits else 'did not fit'} the budget then and does not now")

    def choose(self, mixed: Sequence[str], host_fits_all: bool) -> ActivationChoice:
        n, every, fits = self.n, self.every, self.fits
        if self.policy in every:
            return self.with_first(n, every[self.policy])
        if n == 0 or fits(0, mixed):
            return self.with_first(0, mixed)
        fallbacks = [Activations.RECOMPUTE] + ([Activations.OFFLOAD] if host_fits_all and self.variants.offloads else [])

        def least_of(way: str) -> int:
            return self.least(self.variants.make(n, every[way]))
        smallest = min(fallbacks, key=least_of)
        if self.budget < least_of(smallest):
            # below what all recomputed or all offloaded fits in, auto refuses (the least budget must not
            # depend on the measured rates), whatever a mix might fit in
            return self.with_first(n, every[smallest])
        # the fewest segments that fit, each the cheaper way; if even all of them that way do not fit,
        # the fewest recomputed, or else offloaded (one of the two fits all: the budget is above its least)
        how = next(h for h in (mixed, *(every[w] for w in fallbacks)) if fits(n, h))
        lo, hi = 1, n                      # the smallest m with fits(m)
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid, how):
                hi = mid
            else:
                lo = mid + 1
        return self.with_first(lo if fits(lo, how) else n, how)


def _hash_ints(values: Sequence[int]) -> str:
    """A short digest of a sequence of ints (a non-model curve)."""
    return hashlib.sha256(repr(tuple(values)).encode()).hexdigest()


def _layout_digest(layout: ChunkLayout) -> str:
    return hashlib.sha256(repr((layout.chunk_size, layout.num_chunks, layout.entries, layout.aliases)).encode()).hexdigest()


def least_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, *, policy: str, slot_bytes: int, world: int = 1,
                 device_homes: int = 0, state_bytes: int = 0, host_room: int | None = None,
                 variants: dict[tuple, AnalyzedGraph] | None = None) -> Minimum:
    """The smallest budget some graph ``choose_activations`` picks under ``policy`` fits in:
    ``analyzed``'s own minimum, or (unless "keep") that of the graph with every segment taken off
    the device the policy's way ("auto": all recomputed, or all offloaded where the host has room),
    whichever is smallest. It does not depend on the measured rates, only the choice above it does."""
    def least(a: AnalyzedGraph) -> Minimum:
        return minimum_budget(a, layout, nonmodel=a.nonmodel, slot_bytes=slot_bytes, world=world,
                              device_homes=device_homes, state_bytes=state_bytes)
    keep = least(analyzed)
    if policy == Activations.KEEP or not analyzed.captured.backward:
        return keep
    options = [keep]
    ways = (policy,) if policy != Activations.AUTO else (Activations.RECOMPUTE, Activations.OFFLOAD)  # auto's fallbacks
    for way in ways:
        try:
            options.append(least(choose_activations(analyzed, layout, policy=way, budget=0, slot_bytes=slot_bytes,
                                                    world=world, device_homes=device_homes, state_bytes=state_bytes,
                                                    host_room=host_room, variants=variants)))
        except ValueError:
            if policy != Activations.AUTO:   # the host cannot take them: "offload" says so, auto recomputes
                raise
    return min(options, key=lambda m: m.nbytes)


def config_least(analyzed: AnalyzedGraph, layout: ChunkLayout, config: Config, *, world: int = 1,
                 rank: int = 0, variants: dict[tuple, AnalyzedGraph] | None = None) -> int:
    """The least budget of one layout under ``config``, as the engine counts it: ``least_budget``
    with the chunks the host cannot hold on the device (their optimizer states with them) and the
    host room offloaded activations may use. ``analyzed`` carries this layout's gathered copies."""
    from pscompile.config import available_host_bytes
    from pscompile.memory.disk_states import STAGED_SETS
    from pscompile.optim.placement import host_shortfall_chunks, host_state_chunks
    mb = ModelBytes(config.dtype.itemsize)
    slot_bytes, state_bytes = mb.param_chunk(layout.chunk_size), mb.state_chunk(layout.chunk_size)
    disk = config.disk_dir is not None and world == 1      # the host's shortfall goes to disk, not the device
    host_only = mb.host_bytes(layout, [c for c in range(layout.num_chunks) if not layout.homed_on(c, Tier.DEVICE)])
    homes = 0 if config.host_memory is None or world > 1 or disk else host_shortfall_chunks(
        num_chunks=len(device_homable(layout)), chunk_bytes=mb.chunk(layout.chunk_size),
        host_budget=max(0, config.host_memory - host_only))
    host = config.host_memory if config.host_memory is not None else int(0.8 * available_host_bytes())
    n, cs = layout.num_chunks, layout.chunk_size            # host room for activations, as the engine counts it
    per_chunk = config.collectives == Collectives.PER_CHUNK
    owned = owned_chunks(n, rank=rank, world=world, per_chunk=per_chunk)
    on_host = [c for c in owned if c not in set(device_homable(layout, owned)[:homes])]
    room = max(0, host - mb.host_bytes(layout, on_host, cs if per_chunk or world == 1 else cs // world))
    if disk and room == 0:
        room = max(0, host_state_chunks(num_chunks=n, chunk_size=cs, param_bytes=config.dtype.itemsize,
                                        staging_chunks=STAGED_SETS, host_budget=host)[1])
    return least_budget(analyzed, layout, policy=config.activations, slot_bytes=slot_bytes, world=world,
                        device_homes=homes, state_bytes=state_bytes, host_room=room, variants=variants).nbytes


# Inductor's kernels hold more than eager code at some nodes (per-row statistics of a
# normalization, a value kept for a fused reader): at a plan's exact minimum the program may not
# fit, and the step runs as compiled eager. The engine keeps a share of every budget free of its
# plan (``program_headroom``; a larger budget would otherwise pick larger chunks and keep more
# activations, filling it again), and the minimum named for Inductor adds it. What the programs
# held beyond the plan's curve in their worst segment (2026-12-07, the CPU's C++ kernels; the
# project's ten tiny architectures at 1.0-2x and eight held-out Hugging Face models at 1.0-1.15x,
# ``bench/held_out.py``): up to 0.114 of the budget in float32, up to 0.167 in bfloat16 (T5 at
# its minimum: 0.29); at each budget the same bytes whatever share was kept. Hence, by the
# compute dtype's bytes, 1/8 and 1/6 of the budget kept (least + 1/7 and least + 1/5 named); a
# program that still does not fit is planned again (``compiled/lowering.py``).
PROGRAM_MARGINS = {4: 7, 2: 5}


def program_margin(config: Config) -> int:
    """The minimum named for Inductor is the plan's least plus 1/this of it (``PROGRAM_MARGINS``)."""
    return PROGRAM_MARGINS[config.dtype.itemsize]


def program_headroom(budget: int | None, config: Config) -> int:
    """Device bytes compiled mode keeps free of its plan for what Inductor's program holds beyond
    the measured (eager) curve (fused kernels allocate all their outputs before they run and free
    their inputs after): 1/(``program_margin`` + 1) of the budget, so that at ``program_least``
    the plan is made at its own least budget. 0 without a budget, in hooks mode or with another
    backend. Layouts are weighed, and schedules planned, at the budget less this
    (``pipeline.plan_within``)."""
    if budget is None or config.mode != Mode.COMPILED or config.backend != Backend.INDUCTOR:
        return 0
    return budget // (program_margin(config) + 1)


def program_least(least: int, config: Config) -> int:
    """The least budget at which Inductor's program runs, for a plan whose least budget is ``least``
    (at which compiled eager runs): ``least`` plus 1/``program_margin`` of it."""
    return least + -(-least // program_margin(config))
