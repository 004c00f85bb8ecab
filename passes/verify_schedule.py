"""verify_schedule: check a scheduled graph's memory invariants by replaying it symbolically.

- a fetch fills a free slot; a drop empties an occupied one; an asynchronous fetch (prefetch) is
  waited for before anything reads its slot; a writeback and a device-side
  store_grad touch the slot that holds their chunk; an accumulate_grad adds into its own chunk's
  accumulation buffer at the parameter's offset; an asynchronous one is waited for exactly once,
  by a wait_grad of the same gradient, whose bytes count as device bytes until then;
- every parameter read is a view of the slot holding that parameter's chunk, at the parameter's
  offset in the layout (so nothing is used after it was dropped, and nothing before it arrived); a
  parameter that spans chunks is its pages, each read from its own chunk's slot, concatenated in
  order;
- every gradient page is stored (or accumulated) exactly once, at its place in the layout;
- no chunk with unsaved gradients is dropped;
- planned device bytes (resident slots + device optimizer states + non-model bytes of the node)
  never exceed the budget;
- the iteration ends with exactly the chunks whose optimizer states live on the device resident
  (or, for a warm run, the residency its plan promises the next run), none of the others dirty;
- a chunk whose parameters live on disk is read (``disk_read``) before each of its fetches, and at
  most ``disk_depth`` such reads are waiting for their fetch at any node (the staging buffers);
- a chunk's ``update`` (``plan_early_updates``) comes once, with its gradients home (none left in
  its slot), and after it nothing reads the chunk and no memory node but its drop touches it (its
  update reads and writes the host copy from then on);
- ZeRO (``world > 1``): an allgather fills a free slot and its release_remote empties it (the
  pair brackets every read of the group: a remote shard is read only while gathered); gradients
  go into the gathered group only, before its reduce_scatter; every group that receives a
  gradient is reduce-scattered exactly once, and none is released with gradients unreduced.

Raises ``ScheduleError`` (a ValueError) naming the first node that breaks an invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from pscompile.errors import ScheduleError
from pscompile.graph import meta as gmeta
from pscompile.kinds import MemKind
from pscompile.graph.ops import is_memory_node, mem_op
from pscompile.memory.layout import ChunkLayout
from pscompile.units import format_bytes

__all__ = ["ScheduleError", "VerifyReport", "verify_schedule"]


@dataclass(frozen=True)
class VerifyReport:
    num_memory_nodes: int
    peak_device_bytes: int
    peak_node: str

    def summary(self, budget: int | None) -> str:
        b = "unlimited" if budget is None else format_bytes(budget)
        return (f"verify_schedule: {self.num_memory_nodes} memory nodes ok, planned peak "
                f"{format_bytes(self.peak_device_bytes)} <= {b} (at {self.peak_node})")


def verify_schedule(gm: fx.GraphModule, layout: ChunkLayout, *, slot_bytes: int, budget: int | None,
                    initial: dict[int, int], os_device_chunks: frozenset[int] = frozenset(),
                    os_device_bytes: int = 0, final: dict[int, int] | None = None,
                    world: int = 1, grad_fqns: tuple[str, ...] = (), per_chunk: bool = False,
                    arriving: frozenset[int] = frozenset(), disk_chunks: frozenset[int] = frozenset(),
                    disk_depth: int = 0) -> VerifyReport:
    """``initial``/``final``: chunk -> slot resident at the start / required at the end (default
    for the end: exactly the chunks whose optimizer states live on the device); ``arriving``: the
    slots of ``initial`` whose fetch is still in flight when the run starts (each needs a wait). ``world`` > 1:
    chunks are groups sharded over that many ranks; ``grad_fqns`` the gradients the graph makes
    (each of their groups must be reduce-scattered exactly once)."""
    replay = _Replay(gm, layout, initial=initial, arriving=arriving, world=world, per_chunk=per_chunk)
    replay.disk_chunks, replay.disk_depth = disk_chunks, disk_depth
    for node in gm.graph.nodes:
        if node.op == "placeholder":      # the batch and buffers are live from the start
            replay.nonmodel = gmeta.get(node, "nonmodel", replay.nonmodel)
        elif is_memory_node(node):
            replay.memory_node(node)
        else:
            replay.compute_node(node)
            replay.charge(node, slot_bytes=slot_bytes, os_device_bytes=os_device_bytes, budget=budget)
    replay.finish(os_device_chunks=os_device_chunks, final=final, grad_fqns=grad_fqns)
    return VerifyReport(replay.count, replay.peak, replay.peak_node)


# the ops that carry a chunk's gradient
_GRADIENT_OPS = frozenset({MemKind.STORE_GRAD, MemKind.ACCUMULATE_GRAD, MemKind.REDUCE_SCATTER, MemKind.REDUCE})


def _fail(node: fx.Node, why: str):
    raise ScheduleError(f"verify_schedule: node {node.name} ({node.format_node()[:120]}): {why}")


class _Replay:
    """The symbolic state of the device while a scheduled graph is replayed node by node."""

    def __init__(self, gm: fx.GraphModule, layout: ChunkLayout, *, initial: dict[int, int],
                 arriving: frozenset[int], world: int, per_chunk: bool):
        def placeholders(key: str) -> dict[fx.Node, int]:
            return {n: gmeta.get(n, key) for n in gm.graph.nodes
                    if n.op == "placeholder" and gmeta.get(n, key) is not None}
        self.layout, self.world, self.per_chunk = layout, world, per_chunk
        self.slot_of = placeholders("slot")
        self.host_of = placeholders("host_chunk")
        self.acc_of = placeholders("acc_chunk")
        self.holds: dict[int, int] = {slot: chunk for chunk, slot in initial.items()}   # slot -> chunk
        self.dirty: set[int] = set()
        self.pending: set[int] = set(arriving)   # slots whose asynchronous fetch has not been waited for
        # (parameter, chunk) of an asynchronous accumulate_grad -> (its gradient, page bytes), until its wait
        self.copying: dict[tuple[str, int], tuple[fx.Node, int]] = {}
        self.held = 0                   # device bytes those gradients keep alive (gmeta.held_grad_bytes)
        self.reduced: set[int] = set()  # groups reduce-scattered (ZeRO)
        self.stored: dict[tuple[str, int], int] = {}     # (fqn, page) -> stores of that gradient page
        self.sharded = world > 1
        self.arrive, self.leave = ((MemKind.BROADCAST if per_chunk else MemKind.ALLGATHER, MemKind.RELEASE_REMOTE)
                                   if self.sharded else (MemKind.FETCH, MemKind.DROP))
        self.reduce_kind = MemKind.REDUCE if per_chunk else MemKind.REDUCE_SCATTER
        self.nonmodel = 0
        self.peak, self.peak_node, self.count = 0, "start", 0
        self.disk_chunks: frozenset[int] = frozenset()
        self.disk_depth = 0
        self.staged: list[int] = []     # chunks read from disk and not fetched yet
        self.updated: set[int] = set()  # chunks whose update started (plan_early_updates)

    # ---- memory nodes ----------------------------------------------------------------------
    def memory_node(self, node: fx.Node) -> None:
        self.count += 1
        mem = mem_op(node)
        if mem is None:
            _fail(node, "memory node without its MemOp metadata")
        if (mem.decl.arrives or mem.decl.leaves or mem.decl.reduces) and \
                mem.kind not in (self.arrive, self.leave, self.reduce_kind):
            where = "sharded over " + str(self.world) + " ranks" if self.sharded else "of one rank"
            _fail(node, f"{mem.kind} in a schedule {where}; chunks arrive by {self.arrive}, leave by "
                        f"{self.leave} and reduce by {self.reduce_kind} here")
        if mem.chunk in self.updated and not mem.decl.leaves:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} after its update started on the host")
        self._check_kind(node, mem)
        getattr(self, "_" + mem.decl.check)(node, mem)     # each op's check, named by its declaration
        if not mem.decl.link and mem.nbytes:
            _fail(node, f"{mem.kind} moves no bytes by its declaration, but its MemOp says {mem.nbytes}")

    def _wait(self, node: fx.Node, mem) -> None:
        slot = self.slot_of.get(node.args[0])
        if slot not in self.pending or self.holds.get(slot) != mem.chunk:
            _fail(node, f"wait on slot {slot} without an asynchronous fetch of chunk {mem.chunk} in flight")
        self.pending.discard(slot)

    def _check_kind(self, node: fx.Node, mem) -> None:
        """What the chunk's kind allows (``memory/chunk_kinds.py``): a gradient (stored, accumulated,
        reduced) only into a kind that has one, an update only of a kind that is updated, and a
        writeback only of a kind whose device copy can change (a frozen chunk's never does)."""
        if mem.chunk is None or not 0 <= mem.chunk < self.layout.num_chunks:
            return
        kind = self.layout.kind(mem.chunk)
        if mem.kind in _GRADIENT_OPS and not kind.grad:
            _fail(node, f"{mem.kind} into chunk {mem.chunk}, a {kind} chunk, which has no gradient")
        if mem.kind == MemKind.UPDATE and not kind.updated:
            _fail(node, f"update of chunk {mem.chunk}, a {kind} chunk, which the optimizer does not update")
        if mem.kind == MemKind.WRITEBACK and not (kind.updated or kind.grad):
            _fail(node, f"writeback of chunk {mem.chunk}, a {kind} chunk, whose device copy never changes")

    def _writeback(self, node: fx.Node, mem) -> None:
        slot = self.slot_of.get(node.args[1])
        if self.holds.get(slot) != mem.chunk or self.host_of.get(node.args[0]) != mem.chunk:
            _fail(node, f"writeback of chunk {mem.chunk} from slot {slot}, which holds {self.holds.get(slot)}")
        self.dirty.discard(mem.chunk)

    def _accumulate(self, node: fx.Node, mem) -> None:
        if self.acc_of.get(node.args[0]) != mem.chunk:
            _fail(node, f"gradient of {mem.fqn} added into another chunk's accumulation buffer")
        self._check_page(node, mem)
        if mem.asynchronous:          # the gradient stays on the device until its wait
            self.copying[(mem.fqn, mem.chunk)] = (node.args[1], mem.nbytes)
            self.held = gmeta.held_grad_bytes(self.copying.values())

    def _arrive(self, node: fx.Node, mem) -> None:
        if mem.kind == MemKind.BROADCAST and node.args[2] != mem.chunk % self.world:
            _fail(node, f"broadcast of chunk {mem.chunk} from rank {node.args[2]}; its owner is rank "
                        f"{mem.chunk % self.world}")
        slot = self.slot_of.get(node.args[0])
        if slot in self.holds:
            _fail(node, f"fetch of chunk {mem.chunk} into slot {slot}, which still holds chunk {self.holds[slot]}")
        if self.host_of.get(node.args[1]) != mem.chunk:
            _fail(node, f"fetch of chunk {mem.chunk} reads another host chunk")
        self.holds[slot] = mem.chunk
        if mem.asynchronous:
            self.pending.add(slot)
        if mem.chunk in self.disk_chunks:
            if mem.chunk not in self.staged:
                _fail(node, f"fetch of chunk {mem.chunk}, whose parameters live on disk, without a disk_read "
                            "of it since its last fetch")
            self.staged.remove(mem.chunk)

    def _update(self, node: fx.Node, mem) -> None:
        if mem.chunk in self.dirty or self.host_of.get(node.args[0]) != mem.chunk:
            _fail(node, f"update of chunk {mem.chunk} while its gradients are on the device, or with another "
                        "host chunk")
        self.updated.add(mem.chunk)

    def _disk_read(self, node: fx.Node, mem) -> None:
        if mem.chunk not in self.disk_chunks or self.host_of.get(node.args[0]) != mem.chunk:
            _fail(node, f"disk_read of chunk {mem.chunk}, which is not homed on disk or reads another host chunk")
        self.staged.append(mem.chunk)
        if len(self.staged) > self.disk_depth:
            _fail(node, f"{len(self.staged)} disk reads wait for their fetch (chunks {self.staged}); the host "
                        f"stages at most {self.disk_depth}")

    def _grad_landed(self, node: fx.Node, mem) -> None:
        grad, _ = self.copying.pop((mem.fqn, mem.chunk), (None, 0))
        self.held = gmeta.held_grad_bytes(self.copying.values())
        if grad is None or node.args[0] is not grad:
            _fail(node, f"wait for the copy of {mem.fqn}'s gradient to chunk {mem.chunk} without an "
                        "asynchronous accumulate_grad of that gradient in flight")

    def _leave(self, node: fx.Node, mem) -> None:
        slot = self.slot_of.get(node.args[0])
        if slot in self.pending:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot} before the wait for its fetch")
        if self.holds.get(slot) != mem.chunk:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot}, which holds {self.holds.get(slot)}")
        if mem.chunk in self.dirty:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} loses gradients: no "
                        f"{'reduce_scatter' if self.sharded else 'writeback'} before it")
        del self.holds[slot]

    def _reduce(self, node: fx.Node, mem) -> None:
        slot = self.slot_of.get(node.args[1])
        if self.holds.get(slot) != mem.chunk:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot}, which holds {self.holds.get(slot)}")
        target = self.acc_of.get(node.args[0]) if node.args[4] else self.host_of.get(node.args[0])
        if target != mem.chunk:
            _fail(node, f"{mem.kind} of chunk {mem.chunk} writes another chunk's home")
        if self.per_chunk and node.args[2] != mem.chunk % self.world:
            _fail(node, f"reduce of chunk {mem.chunk} to rank {node.args[2]}; its owner is rank "
                        f"{mem.chunk % self.world}")
        if mem.chunk in self.reduced:
            _fail(node, f"chunk {mem.chunk} is reduced twice (its gradients would count twice)")
        self.reduced.add(mem.chunk)
        self.dirty.discard(mem.chunk)

    def _store(self, node: fx.Node, mem) -> None:
        dest = node.args[0]
        if self.sharded and mem.chunk in self.reduced:
            _fail(node, f"gradient of {mem.fqn} stored after chunk {mem.chunk} was reduced: "
                        "it would never reach its owner")
        if self.sharded and dest not in self.slot_of:
            _fail(node, f"gradient of {mem.fqn} stored outside its gathered group {mem.chunk}")
        if dest in self.slot_of:
            slot = self.slot_of[dest]
            if slot in self.pending:
                _fail(node, f"gradient of {mem.fqn} stored into slot {slot} before the wait "
                            "for its asynchronous fetch")
            if self.holds.get(slot) != mem.chunk:
                _fail(node, f"gradient of {mem.fqn} stored into slot {slot}, which holds "
                            f"{self.holds.get(slot)}, not chunk {mem.chunk}")
            self.dirty.add(mem.chunk)
        elif self.host_of.get(dest) != mem.chunk:
            _fail(node, f"gradient of {mem.fqn} stored into the wrong host chunk")
        self._check_page(node, mem)

    def _check_page(self, node: fx.Node, mem) -> None:
        """A gradient store writes one page of its parameter, at the layout's place."""
        entry = self.layout.entry(mem.fqn)
        start, numel = node.args[3:5] if len(node.args) >= 5 else (0, -1)
        k = next((k for k, p in enumerate(entry.pieces) if p.chunk == mem.chunk), None)
        if k is None:
            _fail(node, f"gradient of {mem.fqn} goes to chunk {mem.chunk}, which holds none of it")
        p = entry.pieces[k]
        whole = (p.chunk_offset, 0, -1) if not entry.spans else (p.chunk_offset, p.tensor_offset, p.numel)
        if (node.args[2], start, numel) != whole:
            _fail(node, f"gradient of {mem.fqn} stored at (offset, start, numel) {(node.args[2], start, numel)}, "
                        f"layout says {whole}")
        self.stored[(mem.fqn, k)] = self.stored.get((mem.fqn, k), 0) + 1

    # ---- compute nodes ---------------------------------------------------------------------
    def compute_node(self, node: fx.Node) -> None:
        """A parameter page is read from the slot holding its chunk, at its place; a parameter is
        made from its pages in order."""
        layout, holds = self.layout, self.holds
        fqn = gmeta.get(node, "param")
        page = gmeta.get(node, "page")
        if page is not None:                  # one page of a parameter, read from its slot
            pfqn, k = page
            p = layout.entry(pfqn).pieces[k]
            slot = self.slot_of.get(node.args[0])
            if slot is None or holds.get(slot) != p.chunk:
                _fail(node, f"reads {pfqn} from slot {slot}, which holds {holds.get(slot)}, not its chunk {p.chunk}")
            if slot in self.pending:
                _fail(node, f"reads {pfqn} from slot {slot} before the wait for its asynchronous fetch")
            if p.chunk in self.updated:
                _fail(node, f"reads {pfqn} after chunk {p.chunk}'s update started on the host")
            if tuple(node.args[1:4]) != (0, p.chunk_offset, p.chunk_offset + p.numel):
                _fail(node, f"reads {pfqn} at elements {tuple(node.args[2:4])}, layout says "
                            f"{(p.chunk_offset, p.chunk_offset + p.numel)}")
        if fqn is not None and isinstance(node.args[0], fx.Node) and (
                gmeta.get(node.args[0], "page") is not None or gmeta.get(node.args[0], "gather") is not None):
            src = node.args[0]                # the parameter's root: its one page, or all of them gathered
            pages = list(src.args[0]) if gmeta.get(src, "gather") is not None else [src]
            want = [(fqn, k) for k in range(len(layout.entry(fqn).pieces))]
            if [gmeta.get(a, "page") for a in pages] != want:
                _fail(node, f"makes {fqn} from pages {[gmeta.get(a, 'page') for a in pages]}; the layout has {want}")
        if fqn is None:         # parameter views are rebuilt right before their reader: they allocate
            self.nonmodel = gmeta.get(node, "nonmodel", self.nonmodel)    # nothing and keep the reader's moment

    def charge(self, node: fx.Node, *, slot_bytes: int, os_device_bytes: int, budget: int | None) -> None:
        """The planned device bytes at ``node``: resident slots, device optimizer states, its
        non-model bytes and the gradients still copying; within the budget."""
        used = len(self.holds) * slot_bytes + os_device_bytes + self.nonmodel + self.held
        if budget is not None:     # the non-model bytes (gradients still copying among them: they are live
            gmeta.put(node, "room", budget - (used - self.nonmodel - self.held))   # tensors) the plan leaves room for here
        if used > self.peak:
            self.peak, self.peak_node = used, node.name
        if budget is not None and used > budget:
            _fail(node, f"planned device bytes {used} exceed device_memory={budget}")

    # ---- the end ---------------------------------------------------------------------------
    def finish(self, *, os_device_chunks: frozenset[int], final: dict[int, int] | None,
               grad_fqns: tuple[str, ...]) -> None:
        """Every wait came, the residency the plan promised, no chunk left dirty, every gradient
        page stored once and (ZeRO) every group that got gradients reduced."""
        holds, layout = self.holds, self.layout
        if self.pending:
            raise ScheduleError(f"verify_schedule: asynchronous fetches into slots {sorted(self.pending)} are never "
                                "waited for")
        if self.copying:
            raise ScheduleError(f"verify_schedule: the copies of gradients {sorted(f for f, _ in self.copying)[:6]} "
                                "to the host are never waited for")
        if final is None and set(holds.values()) != set(os_device_chunks):
            raise ScheduleError(f"verify_schedule: the iteration ends with chunks {sorted(holds.values())} on the "
                                f"device; expected {sorted(os_device_chunks)} (those updated on the device)")
        if final is not None and {c: k for k, c in holds.items()} != dict(final):
            raise ScheduleError(f"verify_schedule: the iteration ends with chunk->slot "
                                f"{ {c: k for k, c in sorted(holds.items())} }; the plan promised {dict(final)}")
        if self.dirty - set(os_device_chunks):
            raise ScheduleError(f"verify_schedule: chunks {sorted(self.dirty - set(os_device_chunks))} end dirty on "
                                "the device (their gradients never reach the host update)")
        pages = {(f, k) for f in grad_fqns for k in range(len(layout.entry(f).pieces))}
        stored = self.stored
        if grad_fqns and (set(stored) != pages or any(v != 1 for v in stored.values())):
            wrong = sorted(p for p in pages | set(stored) if stored.get(p, 0) != 1)
            raise ScheduleError(f"verify_schedule: gradient pages (fqn, page) {wrong[:6]} are not stored exactly "
                                "once")
        if self.sharded and grad_fqns:
            expected = {c for f in grad_fqns for c in layout.entry(f).chunks}
            if expected != self.reduced:
                raise ScheduleError(f"verify_schedule: chunks {sorted(expected - self.reduced)} receive gradients "
                                    "that are never reduced")
