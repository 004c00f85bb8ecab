"""Schedule: the scheduled graph of compiled mode, for people to read.

``print(engine.schedule)`` shows the graph as Python-like code under a provenance header (Thunder's
traces are the model): which passes ran and what each reported, the budget, the planned traffic,
and a trailing comment on every memory node::

    # pscompile schedule (compiled mode, training iteration)
    # model:  GPT(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64, ...)
    # layout: 28 tensors, 120,576 params in 8 chunks of 17,408 elements (86.6% utilised); float32
    # budget: device_memory 3.0 MiB (3,145,728 B); planned peak 3.0 MiB at mm_1 (model 544.0 KiB + ...
    ...
    def iteration(slot_0..slot_7, host_0..host_7, in_0, in_1):
        fetch_default = pscompile.fetch(slot_0, host_0)   # fetch chunk 0 -> slot 0 (host->device), 68.0 KiB
        slice_tensor = aten.slice(slot_0, 0, 0, 16384)
        view_default = aten.view(slice_tensor, [256, 64])  # param wte.weight (chunk 0 in slot 0)
        embedding = aten.embedding(view_default, in_0)

``table()`` is the same graph as one row per node (idx, name, op, chunk, tier, bytes, live device
bytes, source), ``timeline()`` the device bytes at every node split into model and non-model data,
and ``save(folder)`` writes all of them (plus a PNG of the timeline when matplotlib imports).

How device bytes are counted at a node: resident slots x ``slot_bytes`` + the optimizer states kept
on the device + the non-model bytes live there. Residency is replayed from the plan's initial slots
and the memory nodes (a fetch occupies its slot from the moment it starts, a drop frees it). The
non-model bytes of a node copied from the captured graph are its entry in ``Scheduled.nonmodel``
(static estimate or measured); a node the schedule inserted -- a memory node, a view of a slot
rebuilt right before its reader, the output -- runs while the last copied node's bytes are live and
gets that value. This is the rule ``verify_schedule`` checks the budget with and the windows
``plan_residency`` plans with, so every value is within the budget and the maximum over the graph
is the verified peak (``plan.peak_device_bytes`` is computed before prefetch_fetches starts fetches
earlier, so it can be a little lower).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import fx

from pscompile.kinds import MemKind, Phase, RunKind
from pscompile.graph.meta import get, held_grad_bytes
from pscompile.graph.ops import DECLS, MemOp, decl_for, activation_move, is_memory_node, mem_op
from pscompile.compiled.listing import _NONE, _code, _cut, _few, _kind, _memory_comment, _module_of, _op_name, _short_trace, _signature, _slot_of, _tier
from pscompile.units import format_bytes

if TYPE_CHECKING:
    from pscompile.graph.pipeline import Scheduled
    from pscompile.memory.layout import ChunkLayout

__all__ = ["Schedule", "NodeRow", "model_summary"]

_COMMENT_COLUMN = 60     # trailing comments start at this column when the code is shorter


@dataclass(frozen=True)
class NodeRow:
    """One node of the scheduled graph, with the accounting of ``table()`` and ``timeline()``."""

    idx: int
    name: str
    op: str                    # "aten.mm", "pscompile.fetch", "getitem", "placeholder", "output"
    kind: str                  # "memory" | "compute" | "param_view" | "input" | "output"
    mem: MemOp | None          # memory nodes only
    chunks: tuple[int, ...]    # chunks it moves (memory) or reads (parameter views and readers)
    tier: str                  # "host->device", "device->host", "device" (reads a slot), ""
    nbytes: int | None         # bytes moved between tiers (memory nodes), else None
    resident_slots: int        # device slots holding a chunk while it runs
    model_bytes: int           # resident_slots * slot_bytes + optimizer states on the device
    nonmodel_bytes: int        # non-model bytes live while it runs (see the module docstring)
    source: str                # module path (nn_module_stack / stack_trace / parameters read), or "-"
    phase: Phase | None        # FWD | BWD on compute nodes, else None

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.nonmodel_bytes


def model_summary(model: torch.nn.Module) -> str:
    """One line: the model's class and, when it has a dataclass ``config``, its fields."""
    cfg = getattr(model, "config", None)
    fields = getattr(cfg, "__dataclass_fields__", None)
    if fields:
        inner = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in fields)
        return f"{type(model).__name__}({inner})"
    return type(model).__name__


class Schedule:
    """A readable view of one ``Scheduled`` (the plan, the rewritten graph, and the passes that
    made them). It reads the schedule and never changes it."""

    def __init__(self, scheduled: "Scheduled", *, layout: "ChunkLayout", budget: int | None, slot_bytes: int,
                 os_device_bytes: int, dtype: torch.dtype, model: str | None = None):
        self.scheduled = scheduled
        self.layout = layout
        self.budget = budget
        self.slot_bytes = slot_bytes
        self.os_device_bytes = os_device_bytes
        self.dtype = dtype
        self.model = model

    # ----------------------------------------------------------- the Scheduled record, passed through
    @property
    def gm(self) -> fx.GraphModule:
        return self.scheduled.gm

    @property
    def plan(self):
        return self.scheduled.plan

    @property
    def captured(self):
        return self.scheduled.captured

    @property
    def nonmodel(self) -> tuple[int, ...]:
        return self.scheduled.nonmodel

    @property
    def measured(self) -> bool:
        return self.scheduled.measured

    @property
    def passes(self):
        return self.scheduled.passes

    # ----------------------------------------------------------- accounting
    @cached_property
    def rows(self) -> tuple[NodeRow, ...]:
        """One ``NodeRow`` per node of the scheduled graph, in graph order."""
        nodes = list(self.gm.graph.nodes)
        nonmodel = self._nonmodel_per_node(nodes)
        holds: dict[int, int] = {slot: chunk for chunk, slot in self.plan.initial}   # slot -> chunk
        # gradients alive until their copy lands (overlap_grad_copies): (parameter, chunk) -> (grad, page bytes)
        held: dict[tuple[str, int], tuple[fx.Node, int]] = {}
        held_bytes = 0
        rows = []
        for i, n in enumerate(nodes):
            mem = mem_op(n) if is_memory_node(n) else None
            if mem is not None and mem.kind == MemKind.ACCUMULATE_GRAD and mem.asynchronous:
                held[(mem.fqn, mem.chunk)] = (n.args[1], mem.nbytes)
                held_bytes = held_grad_bytes(held.values())
            elif mem is not None and mem.kind == MemKind.WAIT and mem.slot is None:
                held.pop((mem.fqn, mem.chunk), None)
                held_bytes = held_grad_bytes(held.values())
            if mem is not None and mem.slot is not None:
                if mem.decl.arrives:
                    holds[mem.slot] = mem.chunk
                elif mem.decl.leaves:
                    holds.pop(mem.slot, None)
            model_bytes = len(holds) * self.slot_bytes + self.os_device_bytes
            kind = _kind(n)
            rows.append(NodeRow(
                idx=i, name=n.name, op=_op_name(n), kind=kind, mem=mem, chunks=self._chunks(n, mem),
                tier=_tier(n, mem), nbytes=mem.nbytes if mem is not None else None, resident_slots=len(holds),
                model_bytes=model_bytes, nonmodel_bytes=nonmodel[i] + held_bytes, source=self._source(n, mem),
                phase=get(n, "phase") if kind == "compute" else None))   # rebuilt views keep their forward tag
        return tuple(rows)

    def _nonmodel_per_node(self, nodes: list[fx.Node]) -> list[int]:
        """A node copied from the captured graph has its own curve entry; a node the schedule
        inserted (memory nodes, rebuilt parameter views, the output) runs while the last copied
        node's bytes are live, so it gets that node's value (0 before the first): the rule
        ``verify_schedule`` checks the budget with."""
        out, last = [], 0
        for n in nodes:
            src = get(n, "src_index")
            if src is not None and not is_memory_node(n) and get(n, "param") is None and src < len(self.nonmodel):
                last = self.nonmodel[src]
            out.append(last)
        return out

    def _chunks(self, n: fx.Node, mem: MemOp | None) -> tuple[int, ...]:
        if mem is not None:
            return (mem.chunk,)
        fqns = [get(n, "param")] if get(n, "param") is not None else list(get(n, "reads", ()))
        out: list[int] = []
        for fqn in fqns:
            try:
                chunks = self.layout.entry(fqn).chunks
            except KeyError:
                continue
            out.extend(c for c in chunks if c not in out)
        return tuple(out)

    def _source(self, n: fx.Node, mem: MemOp | None) -> str:
        stack = n.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1]
            return str(path[0] if isinstance(path, tuple) else path) or _NONE
        trace = n.meta.get("stack_trace")
        if trace:
            return _short_trace(trace)
        if mem is not None:
            if mem.fqn:
                return _module_of(mem.fqn)
            try:
                modules = list(dict.fromkeys(_module_of(e.fqn) for e, _ in self.layout.chunk_members(mem.chunk)))
            except (IndexError, AttributeError):
                return _NONE
            return _few(modules)
        fqns = [get(n, "param")] if get(n, "param") is not None else list(get(n, "reads", ()))
        if fqns:
            return _few(list(dict.fromkeys(_module_of(f) for f in fqns)))
        return _NONE

    @cached_property
    def peak(self) -> NodeRow:
        """The node with the most device bytes (the first of equals)."""
        return max(self.rows, key=lambda r: r.total_bytes)

    @property
    def peak_device_bytes(self) -> int:
        return self.peak.total_bytes

    def memory_rows(self) -> list[NodeRow]:
        return [r for r in self.rows if r.mem is not None]

    def timeline(self) -> list[dict]:
        """Per node: model bytes on the device, non-model bytes, their total and the budget."""
        return [{"idx": r.idx, "name": r.name, "op": r.op, "kind": r.kind,
                 "mem": r.mem.kind if r.mem is not None else None,
                 "chunk": r.mem.chunk if r.mem is not None else None,
                 "phase": r.phase, "model_bytes": r.model_bytes, "nonmodel_bytes": r.nonmodel_bytes,
                 "total_bytes": r.total_bytes, "budget": self.budget} for r in self.rows]

    # ----------------------------------------------------------- text
    def header(self) -> str:
        """The provenance header (comment lines)."""
        plan, rows = self.plan, self.rows
        mem_rows = self.memory_rows()
        counts: dict[str, int] = {}
        for r in mem_rows:
            counts[r.mem.kind] = counts.get(r.mem.kind, 0) + 1
        dtype = str(self.dtype).replace("torch.", "")
        peak = self.peak
        budget = "unlimited" if self.budget is None else f"{format_bytes(self.budget)} ({self.budget:,} B)"
        what = {RunKind.TRAIN: "training iteration", RunKind.ACCUM: "one micro-batch of gradient accumulation",
                RunKind.EVAL: "evaluation, forward only"}[self.scheduled.kind]
        lines = [f"pscompile schedule (compiled mode, {what})"]
        if self.model:
            lines.append(f"model:  {self.model}")
        lines.append(f"layout: {self.layout.describe()}; {dtype}; "
                     f"{plan.num_slots} device slot(s) of {format_bytes(self.slot_bytes)}")
        share = "" if self.budget is None else f"{peak.total_bytes / self.budget:.1%} of the budget: "
        lines.append(f"budget: device_memory {budget}; planned peak {format_bytes(peak.total_bytes)} at "
                     f"{peak.name} ({share}model {format_bytes(peak.model_bytes)} + non-model "
                     f"{format_bytes(peak.nonmodel_bytes)}); optimizer states on the device "
                     f"{format_bytes(self.os_device_bytes)}")
        ahead = self.scheduled.lookahead
        homed = [(c, k) for c, k in plan.initial if c in self.scheduled.os_device]
        if homed:
            pairs = ", ".join(f"chunk {c} in slot {k}" for c, k in homed)
            lines.append(f"resident from the start (optimizer states on the device): {pairs}")
        arriving = [(c, k) for c, k in plan.initial if c not in self.scheduled.os_device]
        if arriving:
            pairs = ", ".join(f"chunk {c} in slot {k}" for c, k in arriving)
            what = "arriving (fetched by the previous step after their update; a wait before the first reader)" \
                if self.scheduled.kind is RunKind.TRAIN else "resident from the start (left by the previous run)"
            lines.append(f"{what}: {pairs}")
        if self.scheduled.activations is not None:
            lines.append(self.scheduled.activations.describe())
        if self.measured:
            lines.append("non-model memory: measured in the warm-up step (the static estimate was replaced)")
        else:
            lines.append("non-model memory: static estimate from FakeTensor metadata "
                         "(replaced by the measured curve after the first step)")
        if plan.world > 1 and counts.get(MemKind.BROADCAST) is None and counts.get(MemKind.ALLGATHER) is not None:
            lines.append(f"ZeRO: each chunk is a group of {plan.world} shards, rank r owns shard r; per iteration "
                         f"{counts.get(MemKind.ALLGATHER, 0)} allgathers ({format_bytes(plan.allgather_bytes)} from the "
                         f"other ranks), {counts.get(MemKind.REDUCE_SCATTER, 0)} reduce_scatters "
                         f"({format_bytes(plan.reduce_scatter_bytes)} to them), "
                         f"{counts.get(MemKind.RELEASE_REMOTE, 0)} release_remote")
        elif plan.world > 1:
            lines.append(f"ZeRO per chunk: chunk c is owned by rank c % {plan.world}; per iteration "
                         f"{counts.get(MemKind.BROADCAST, 0)} broadcasts ({format_bytes(plan.allgather_bytes)} received "
                         f"from owners), {counts.get(MemKind.REDUCE, 0)} reduces ({format_bytes(plan.reduce_scatter_bytes)} "
                         f"sent to owners), {counts.get(MemKind.RELEASE_REMOTE, 0)} release_remote")
        fetches = sum(v for k, v in counts.items() if decl_for(MemKind(k)).arrives)
        prefetched = sum(1 for r in mem_rows if r.mem.decl.arrives and r.mem.asynchronous)
        host_grads = sum(1 for r in mem_rows if r.mem.kind in (MemKind.STORE_GRAD, MemKind.ACCUMULATE_GRAD)
                         and r.mem.slot is None)
        overlapped = sum(1 for r in mem_rows if r.mem.kind == MemKind.ACCUMULATE_GRAD and r.mem.asynchronous)
        lines.append(f"planned traffic per iteration: h2d {format_bytes(plan.h2d_bytes)} ({fetches} fetches"
                     + (f", {prefetched} started early" if prefetched else "") + f"), d2h "
                     f"{format_bytes(plan.d2h_bytes)} ({counts.get(MemKind.WRITEBACK, 0)} writebacks, {host_grads} "
                     f"gradient stores to the host"
                     + (f", {overlapped} of them copied while compute goes on" if overlapped else "")
                     + (f", {sum(v for k, v in counts.items() if decl_for(MemKind(k)).reduces)} reductions" if plan.world > 1
                        else "")
                     + f"), {sum(v for k, v in counts.items() if decl_for(MemKind(k)).leaves)} evictions"
                     + (f"; activations {format_bytes(self.scheduled.offload_bytes)} offloaded and reloaded "
                        f"(each way, on top of the chunks)" if self.scheduled.offload_bytes else ""))
        if ahead is not None and ahead.fetches:
            pairs = ", ".join(f"chunk {c} -> slot {k}" for c, k in ahead.fetches)
            lines.append(f"after the update, for the next step (each as soon as it is updated; in the h2d bytes "
                         f"above): fetch {pairs}")
        total_s = sum(p.seconds for p in self.passes)
        lines.append(f"passes ({len(self.passes)}, {total_s:.3f} s):")
        width = max((len(p.name) for p in self.passes), default=0)
        for p in self.passes:
            summary = p.summary[len(p.name) + 2:] if p.summary.startswith(p.name + ": ") else p.summary
            lines.append(f"  {p.name:<{width}}  {p.seconds:7.3f} s  {summary}")
        kinds = ", ".join(f"{v} {k}" for k, v in counts.items())
        lines.append(f"graph: {len(rows)} nodes, {len(mem_rows)} memory nodes ({kinds or 'none'})")
        return "\n".join("# " + line if line else "#" for line in lines)

    def listing(self) -> str:
        """The header, then the graph as readable code, one line per node."""
        nodes = list(self.gm.graph.nodes)
        rows = self.rows
        placeholders = [n.name for n in nodes if n.op == "placeholder"]
        out = [self.header(), f"def iteration({_signature(placeholders)}):",
               f"    # slot_k: device slots of {format_bytes(self.slot_bytes)}; "
               + ("host_c: the host copy of chunk c" if self.plan.world == 1 else
                  "host_c: this rank's home of chunk c (ZeRO: its shard, or per chunk the whole chunk where "
                  "it is the owner)")]
        phase = None
        for n, r in zip(nodes, rows):
            if n.op == "placeholder":
                continue
            if r.phase is not None and r.phase != phase:
                if phase is not None or r.phase != Phase.FWD:
                    out.append(f"    # ---- {'backward' if r.phase == Phase.BWD else 'forward'} ----")
                phase = r.phase
            code = _code(n)
            comment = self._comment(n, r)
            if comment:
                code = f"{code:<{_COMMENT_COLUMN - 4}}  # {comment}"
            out.append("    " + code)
        return "\n".join(out)

    def _comment(self, n: fx.Node, r: NodeRow) -> str:
        mem = r.mem
        if mem is not None:
            return _memory_comment(mem, self.layout, n)
        fqn = get(n, "param")
        if get(n, "gather") is not None:
            e = self.layout.entry(fqn)
            return (f"gathers the {len(e.pieces)} pages of {fqn} (chunks {', '.join(map(str, e.chunks))}): "
                    f"a copy of {format_bytes(e.numel * n.meta['val'].element_size())} its reader holds")
        if fqn is not None and r.kind == "param_view":
            where = (f"chunks {', '.join(map(str, r.chunks))}" if len(r.chunks) > 1 else
                     f"chunk {r.chunks[0]}" if r.chunks else "chunk ?")
            slot = _slot_of(n)
            return f"param {fqn} ({where}" + (f" in slot {slot})" if slot is not None else ")")
        if n.op == "output":
            return "loss"
        moves = activation_move(n)
        if moves is not None:
            return moves.describe()
        reloaded = get(n, "reloads")
        if reloaded is not None:
            return f"view of the reloaded {reloaded}"
        recomputed = get(n, "recomputes")
        if recomputed is not None:
            return f"recomputes {recomputed}"
        mask = get(n, "mask_of")
        if mask is not None:
            return f"dropout mask {mask} kept as bool, rebuilt for the backward"
        return ""

    def __str__(self) -> str:
        return self.listing()

    def __repr__(self) -> str:
        return (f"<Schedule {len(self.rows)} nodes, {len(self.memory_rows())} memory nodes, "
                f"peak {format_bytes(self.peak_device_bytes)}, budget "
                f"{'unlimited' if self.budget is None else format_bytes(self.budget)}>")

    def table(self, *, memory_only: bool = False, limit: int | None = None) -> str:
        """One row per node (or per memory node): idx, name, op, chunk, tier, bytes moved, live device
        bytes (model + non-model), source. ``limit`` keeps the first rows and says how many were left."""
        from tabulate import tabulate

        rows = self.memory_rows() if memory_only else list(self.rows)
        shown = rows if limit is None else rows[:limit]
        body = [(r.idx, _cut(r.name, 40), _cut(r.op, 40), _cut(",".join(map(str, r.chunks)), 24), r.tier,
                 format_bytes(r.nbytes) if r.nbytes is not None else "", format_bytes(r.total_bytes),
                 _cut(r.source, 48)) for r in shown]
        text = tabulate(body, headers=("idx", "name", "op", "chunk", "tier", "bytes", "live device", "source"),
                        tablefmt="simple", disable_numparse=True, colalign=("right",) + ("left",) * 7)
        if len(shown) < len(rows):
            text += f"\n... {len(rows) - len(shown)} more row(s)"
        return text

    # ----------------------------------------------------------- files
    def save(self, folder) -> list[Path]:
        """Write ``schedule.txt`` (the listing), ``schedule_table.txt``, ``timeline.json`` and, when
        matplotlib imports, ``timeline.png`` into ``folder`` (created if missing)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, text in (("schedule.txt", self.listing()), ("schedule_table.txt", self.table())):
            path = folder / name
            path.write_text(text + "\n")
            written.append(path)
        path = folder / "timeline.json"
        peak = self.peak
        path.write_text(json.dumps({
            "model": self.model, "budget": self.budget, "slot_bytes": self.slot_bytes,
            "os_device_bytes": self.os_device_bytes, "measured": self.measured,
            "peak_device_bytes": peak.total_bytes, "peak_node": peak.name,
            "h2d_bytes": self.plan.h2d_bytes, "d2h_bytes": self.plan.d2h_bytes,
            "nodes": self.timeline()}, indent=1) + "\n")
        written.append(path)
        png = self.plot(folder / "timeline.png")
        if png is not None:
            written.append(png)
        return written

    def plot(self, path) -> Path | None:
        """Draw the timeline into ``path`` (PNG, Agg, no display); None when matplotlib is missing."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return None
        mib = float(1 << 20)
        rows = self.rows
        x = [r.idx for r in rows]
        model = [r.model_bytes / mib for r in rows]
        total = [r.total_bytes / mib for r in rows]
        fig = Figure(figsize=(13, 4.8), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.fill_between(x, 0, model, step="post", color="tab:blue", alpha=0.75,
                        label="model data (chunk slots + optimizer states)")
        ax.fill_between(x, model, total, step="post", color="tab:orange", alpha=0.6, label="non-model data")
        if self.budget is not None:
            ax.axhline(self.budget / mib, color="tab:red", linestyle="--", linewidth=1.2,
                       label=f"budget {format_bytes(self.budget)}")
        for decl in DECLS.values():                # each op's marker, as its declaration gives it
            if decl.mark is None:
                continue
            marker, color, label = decl.mark
            pts = [(r.idx, r.total_bytes / mib) for r in rows if r.mem is not None and r.mem.op == decl.name]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=18, color=color,
                           zorder=3, label=f"{label} ({len(pts)})")
        first_bwd = next((r.idx for r in rows if r.phase == Phase.BWD), None)
        if first_bwd is not None:
            ax.axvline(first_bwd, color="black", linewidth=0.8, alpha=0.5)
            ax.text(first_bwd, 0, " backward", va="bottom", ha="left", fontsize=8, alpha=0.7)
        peak = self.peak
        ax.set_xlim(0, max(x) if x else 1)
        ax.set_ylim(0, max(max(total, default=0), (self.budget or 0) / mib) * 1.08 or 1)
        ax.set_xlabel("node of the scheduled graph")
        ax.set_ylabel("device MiB")
        budget = "unlimited" if self.budget is None else format_bytes(self.budget)
        ax.set_title(f"{self.model or 'model'}\ndevice budget {budget}, planned peak "
                     f"{format_bytes(peak.total_bytes)} at {peak.name} "
                     f"({'measured' if self.measured else 'static'} non-model curve)", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path)
        return path


# ==================================================================== formatting helpers
