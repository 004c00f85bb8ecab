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
                    arriving: frozenset[int] = frozenset()) -> VerifyReport:
    """``initial``/``final``: chunk -> slot resident at the start / required at the end (default
    for the end: exactly the chunks whose optimizer states live on the device); ``arriving``: the
    slots of ``initial`` whose fetch is still in flight when the run starts (each needs a wait). ``world`` > 1:
    chunks are groups sharded over that many ranks; ``grad_fqns`` the gradients the graph makes
    (each of their groups must be reduce-scattered exactly once)."""
    slot_of_ph = {n: gmeta.get(n, "slot") for n in gm.graph.nodes
                  if n.op == "placeholder" and gmeta.get(n, "slot") is not None}
    host_of_ph = {n: gmeta.get(n, "host_chunk") for n in gm.graph.nodes
                  if n.op == "placeholder" and gmeta.get(n, "host_chunk") is not None}
    acc_of_ph = {n: gmeta.get(n, "acc_chunk") for n in gm.graph.nodes
                 if n.op == "placeholder" and gmeta.get(n, "acc_chunk") is not None}
    holds: dict[int, int] = {slot: chunk for chunk, slot in initial.items()}   # slot -> chunk
    dirty: set[int] = set()
    pending: set[int] = set(arriving)   # slots whose asynchronous fetch has not been waited for
    # (parameter, chunk) of an asynchronous accumulate_grad -> (its gradient, page bytes), until its wait
    copying: dict[tuple[str, int], tuple[fx.Node, int]] = {}
    held = 0                        # device bytes those gradients keep alive (gmeta.held_grad_bytes)
    reduced: set[int] = set()       # groups reduce-scattered (ZeRO)
    sharded = world > 1
    arrive, leave = ((MemKind.BROADCAST if per_chunk else MemKind.ALLGATHER, MemKind.RELEASE_REMOTE) if sharded
                     else (MemKind.FETCH, MemKind.DROP))
    reduce_kind = MemKind.REDUCE if per_chunk else MemKind.REDUCE_SCATTER
    nonmodel = 0
    peak, peak_node, count = 0, "start", 0

    def fail(node: fx.Node, why: str):
        raise ScheduleError(f"verify_schedule: node {node.name} ({node.format_node()[:120]}): {why}")

    stored: dict[tuple[str, int], int] = {}     # (fqn, page) -> stores of that gradient page

    def check_page(node: fx.Node, mem) -> None:
        """A gradient store writes one page of its parameter, at the layout's place."""
        entry = layout.entry(mem.fqn)
        start, numel = node.args[3:5] if len(node.args) >= 5 else (0, -1)
        k = next((k for k, p in enumerate(entry.pieces) if p.chunk == mem.chunk), None)
        if k is None:
            fail(node, f"gradient of {mem.fqn} goes to chunk {mem.chunk}, which holds none of it")
        p = entry.pieces[k]
        whole = (p.chunk_offset, 0, -1) if not entry.spans else (p.chunk_offset, p.tensor_offset, p.numel)
        if (node.args[2], start, numel) != whole:
            fail(node, f"gradient of {mem.fqn} stored at (offset, start, numel) {(node.args[2], start, numel)}, "
                       f"layout says {whole}")
        stored[(mem.fqn, k)] = stored.get((mem.fqn, k), 0) + 1

    for node in gm.graph.nodes:
        if node.op == "placeholder":      # the batch and buffers are live from the start
            nonmodel = gmeta.get(node, "nonmodel", nonmodel)
            continue
        if is_memory_node(node):
            count += 1
            mem = mem_op(node)
            if mem is None:
                fail(node, "memory node without its MemOp metadata")
            if (mem.kind.arrives or mem.kind.leaves or mem.kind.reduces) and mem.kind not in (arrive, leave, reduce_kind):
                fail(node, f"{mem.kind} in a schedule {'sharded over ' + str(world) + ' ranks' if sharded else 'of one rank'}; "
                           f"chunks arrive by {arrive}, leave by {leave} and reduce by {reduce_kind} here")
            if mem.kind.arrives:
                if mem.kind == MemKind.BROADCAST and node.args[2] != mem.chunk % world:
                    fail(node, f"broadcast of chunk {mem.chunk} from rank {node.args[2]}; its owner is rank "
                               f"{mem.chunk % world}")
                slot = slot_of_ph.get(node.args[0])
                if slot in holds:
                    fail(node, f"fetch of chunk {mem.chunk} into slot {slot}, which still holds chunk {holds[slot]}")
                if host_of_ph.get(node.args[1]) != mem.chunk:
                    fail(node, f"fetch of chunk {mem.chunk} reads another host chunk")
                holds[slot] = mem.chunk
                if mem.asynchronous:
                    pending.add(slot)
            elif mem.kind == MemKind.WAIT and mem.slot is None:     # a gradient's copy has landed
                grad, _ = copying.pop((mem.fqn, mem.chunk), (None, 0))
                held = gmeta.held_grad_bytes(copying.values())
                if grad is None or node.args[0] is not grad:
                    fail(node, f"wait for the copy of {mem.fqn}'s gradient to chunk {mem.chunk} without an "
                               "asynchronous accumulate_grad of that gradient in flight")
            elif mem.kind == MemKind.WAIT:
                slot = slot_of_ph.get(node.args[0])
                if slot not in pending or holds.get(slot) != mem.chunk:
                    fail(node, f"wait on slot {slot} without an asynchronous fetch of chunk {mem.chunk} in flight")
                pending.discard(slot)
            elif mem.kind.leaves:
                slot = slot_of_ph.get(node.args[0])
                if slot in pending:
                    fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot} before the wait for its fetch")
                if holds.get(slot) != mem.chunk:
                    fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot}, which holds {holds.get(slot)}")
                if mem.chunk in dirty:
                    fail(node, f"{mem.kind} of chunk {mem.chunk} loses gradients: no "
                               f"{'reduce_scatter' if sharded else 'writeback'} before it")
                del holds[slot]
            elif mem.kind.reduces:
                slot = slot_of_ph.get(node.args[1])
                if holds.get(slot) != mem.chunk:
                    fail(node, f"{mem.kind} of chunk {mem.chunk} from slot {slot}, which holds {holds.get(slot)}")
                target = acc_of_ph.get(node.args[0]) if node.args[4] else host_of_ph.get(node.args[0])
                if target != mem.chunk:
                    fail(node, f"{mem.kind} of chunk {mem.chunk} writes another chunk's home")
                if per_chunk and node.args[2] != mem.chunk % world:
                    fail(node, f"reduce of chunk {mem.chunk} to rank {node.args[2]}; its owner is rank {mem.chunk % world}")
                if mem.chunk in reduced:
                    fail(node, f"chunk {mem.chunk} is reduced twice (its gradients would count twice)")
                reduced.add(mem.chunk)
                dirty.discard(mem.chunk)
            elif mem.kind == MemKind.WRITEBACK:
                slot = slot_of_ph.get(node.args[1])
                if holds.get(slot) != mem.chunk or host_of_ph.get(node.args[0]) != mem.chunk:
                    fail(node, f"writeback of chunk {mem.chunk} from slot {slot}, which holds {holds.get(slot)}")
                dirty.discard(mem.chunk)
            elif mem.kind == MemKind.ACCUMULATE_GRAD:
                if acc_of_ph.get(node.args[0]) != mem.chunk:
                    fail(node, f"gradient of {mem.fqn} added into another chunk's accumulation buffer")
                check_page(node, mem)
                if mem.asynchronous:          # the gradient stays on the device until its wait
                    copying[(mem.fqn, mem.chunk)] = (node.args[1], mem.nbytes)
                    held = gmeta.held_grad_bytes(copying.values())
            elif mem.kind == MemKind.STORE_GRAD:
                dest = node.args[0]
                if sharded and mem.chunk in reduced:
                    fail(node, f"gradient of {mem.fqn} stored after chunk {mem.chunk} was reduced: "
                               "it would never reach its owner")
                if sharded and dest not in slot_of_ph:
                    fail(node, f"gradient of {mem.fqn} stored outside its gathered group {mem.chunk}")
                if dest in slot_of_ph:
                    if slot_of_ph[dest] in pending:
                        fail(node, f"gradient of {mem.fqn} stored into slot {slot_of_ph[dest]} before the wait "
                                   "for its asynchronous fetch")
                    if holds.get(slot_of_ph[dest]) != mem.chunk:
                        fail(node, f"gradient of {mem.fqn} stored into slot {slot_of_ph[dest]}, which holds "
                                   f"{holds.get(slot_of_ph[dest])}, not chunk {mem.chunk}")
                    dirty.add(mem.chunk)
                elif host_of_ph.get(dest) != mem.chunk:
                    fail(node, f"gradient of {mem.fqn} stored into the wrong host chunk")
                check_page(node, mem)
            continue
        fqn = gmeta.get(node, "param")
        page = gmeta.get(node, "page")
        if page is not None:                  # one page of a parameter, read from its slot
            pfqn, k = page
            p = layout.entry(pfqn).pieces[k]
            slot = slot_of_ph.get(node.args[0])
            if slot is None or holds.get(slot) != p.chunk:
                fail(node, f"reads {pfqn} from slot {slot}, which holds {holds.get(slot)}, not its chunk {p.chunk}")
            if slot in pending:
                fail(node, f"reads {pfqn} from slot {slot} before the wait for its asynchronous fetch")
            if tuple(node.args[1:4]) != (0, p.chunk_offset, p.chunk_offset + p.numel):
                fail(node, f"reads {pfqn} at elements {tuple(node.args[2:4])}, layout says "
                           f"{(p.chunk_offset, p.chunk_offset + p.numel)}")
        if fqn is not None and isinstance(node.args[0], fx.Node) and (
                gmeta.get(node.args[0], "page") is not None or gmeta.get(node.args[0], "gather") is not None):
            src = node.args[0]                # the parameter's root: its one page, or all of them gathered
            pages = list(src.args[0]) if gmeta.get(src, "gather") is not None else [src]
            want = [(fqn, k) for k in range(len(layout.entry(fqn).pieces))]
            if [gmeta.get(a, "page") for a in pages] != want:
                fail(node, f"makes {fqn} from pages {[gmeta.get(a, 'page') for a in pages]}; the layout has {want}")
        if fqn is None:         # parameter views are rebuilt right before their reader: they allocate
            nonmodel = gmeta.get(node, "nonmodel", nonmodel)    # nothing and keep the reader's moment
        used = len(holds) * slot_bytes + os_device_bytes + nonmodel + held
        if used > peak:
            peak, peak_node = used, node.name
        if budget is not None and used > budget:
            fail(node, f"planned device bytes {used} exceed device_memory={budget}")
    if pending:
        raise ScheduleError(f"verify_schedule: asynchronous fetches into slots {sorted(pending)} are never waited for")
    if copying:
        raise ScheduleError(f"verify_schedule: the copies of gradients {sorted(f for f, _ in copying)[:6]} to the host "
                            "are never waited for")
    if final is None and set(holds.values()) != set(os_device_chunks):
        raise ScheduleError(f"verify_schedule: the iteration ends with chunks {sorted(holds.values())} on the "
                            f"device; expected {sorted(os_device_chunks)} (those updated on the device)")
    if final is not None and {c: k for k, c in holds.items()} != dict(final):
        raise ScheduleError(f"verify_schedule: the iteration ends with chunk->slot "
                            f"{ {c: k for k, c in sorted(holds.items())} }; the plan promised {dict(final)}")
    if dirty - set(os_device_chunks):
        raise ScheduleError(f"verify_schedule: chunks {sorted(dirty - set(os_device_chunks))} end dirty on the "
                            "device (their gradients never reach the host update)")
    pages = {(f, k) for f in grad_fqns for k in range(len(layout.entry(f).pieces))}
    if grad_fqns and (set(stored) != pages or any(v != 1 for v in stored.values())):
        wrong = sorted(p for p in pages | set(stored) if stored.get(p, 0) != 1)
        raise ScheduleError(f"verify_schedule: gradient pages (fqn, page) {wrong[:6]} are not stored exactly "
                            "once")
    if sharded and grad_fqns:
        expected = {c for f in grad_fqns for c in layout.entry(f).chunks}
        if expected != reduced:
            raise ScheduleError(f"verify_schedule: chunks {sorted(expected - reduced)} receive gradients that are "
                                "never reduced")
    return VerifyReport(count, peak, peak_node)
