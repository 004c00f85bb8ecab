"""The race checker: a CPU copy engine under which every copy lands at the latest moment the copy
contract (``memory/copies.py``) allows.

At ``submit`` the destination is poisoned (NaN for floating data, a bit pattern for integers) and
nothing is copied; the copy runs when it is first waited on (or at ``flush``), reading its source
*then*, after every earlier copy of its direction and its ``after``. So a schedule that reads a
destination before its wait computes on poison, and one that overwrites a source before the copy's
wait sends the overwritten data: both show in the results. A buffer freed (``check_free``) or
reused by another copy while a copy still owns it raises ``CopyRaceError`` at once, naming both
graph nodes. A real copy stream lands a copy somewhere between the submit and the wait; a schedule
that is right when every copy lands at the wait is right under any timing a stream can produce.

A compute-side ``wait()`` orders compute after the copy, not the host: on CUDA the host runs on
while the stream catches up. So the checker keeps the host's view apart from compute's until a
*host sync* -- a ``wait_host()`` on the copy, on a later copy of its direction, or on any copy
submitted after its compute-side wait, a ``sync_compute()`` after that wait, or a
``drain``/``flush``:

- a device->host copy's destination stays poisoned for the host until then (compute may free or
  reuse its source at the wait, so what it read is kept aside and written at the sync);
- a host->device copy's source is kept as it was read, and at the sync it must still hold those
  bytes: a host write before the sync (a host pool slot reused, a host update of the chunk) would
  have raced the copy on a GPU, and raises ``CopyRaceError`` naming the node.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from pscompile.memory.copies import Copy, CopyEngine, CopyRaceError, Direction, _check_direction
from pscompile.memory.tiers import Link


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of the memory ``t`` covers."""
    storage = t.untyped_storage()
    size = t.element_size()
    if t.numel() == 0:
        return storage.data_ptr(), 0, 0
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
    start = t.storage_offset() * size
    return storage.data_ptr(), start, start + extent * size


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with what no real copy writes: NaN, or a bit pattern for integer and bool data."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min + 0x5A if info.min < 0 else info.max - 0x5A)


def _chain(after) -> frozenset[int]:
    """The sequence numbers of ``after`` and of every copy it is ordered after."""
    seqs = set()
    while isinstance(after, _Deferred):
        seqs.add(after.seq)
        after = after.after
    return frozenset(seqs)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal (NaN included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@dataclass
class _Landed:
    """A landed copy the host does not yet know has landed (see the module docstring)."""

    seq: int
    direction: Direction
    chain: frozenset[int]
    node: str | None
    user: torch.Tensor          # d2h: the destination; h2d: the source
    kept: torch.Tensor          # d2h: what the copy read; h2d: the source as the copy read it
    span: tuple[int, int, int]
    waited_at: int | None = None     # the sequence number after which compute waited on it

    def synced_by(self, other: "_Deferred") -> bool:
        """A host-side wait on ``other`` shows this copy landed."""
        return ((self.direction == other.direction and self.seq <= other.seq) or self.seq in other.chain
                or (self.waited_at is not None and self.waited_at <= other.seq))


class _Deferred(Copy):
    def __init__(self, engine: "StrictCopies", seq: int, dst, src, direction: Direction, after, activation: bool,
                 counted: bool, node: str | None):
        self.engine, self.seq, self.direction, self.node = engine, seq, direction, node
        self.dst, self.src, self.after = dst, src, after
        self.activation, self.counted = activation, counted
        self.spans = (_span(dst), _span(src))
        self.chain = _chain(after)
        self.landed = False
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.engine._land(self)
        self.engine._compute_waited(self)
        if self.error is not None:
            raise self.error

    def wait_host(self) -> None:
        self.engine._land(self)
        self.engine._host_sync(self)
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.landed

    def label(self) -> str:
        return f"the {self.direction} copy of node {self.node or '(outside a graph)'}"


class StrictCopies(CopyEngine):
    """Copies land at their wait (see the module docstring); ``copies_landed`` counts them."""

    def __init__(self, link: Link):
        super().__init__(link)
        self._pending: list[_Deferred] = []
        self._landed: list[_Landed] = []
        self._seq = 0
        self._lock = threading.RLock()      # the overlapped optimizer waits from its own thread
        self.copies_landed = 0

    def submit(self, dst, src, direction, *, after=None, activation=False, counted=False, node=None) -> Copy:
        _check_direction(direction)
        with self._lock:
            copy = _Deferred(self, self._seq, dst, src, direction, after, activation, counted, node)
            self._seq += 1
            self._check_reuse(copy)
            self._check_landed(copy)
            poison(dst)
            self._pending.append(copy)
            return copy

    def _ordered_after(self, copy: _Deferred, earlier: _Deferred) -> bool:
        """``copy`` cannot land before ``earlier``: the same direction (in order), or through ``after``."""
        if earlier.direction == copy.direction:
            return True
        after = copy.after
        while isinstance(after, _Deferred):
            if after is earlier or (after.direction == earlier.direction and after.seq >= earlier.seq):
                return True
            after = after.after
        return False

    def _check_reuse(self, copy: _Deferred) -> None:
        dst, src = copy.spans
        for p in self._pending:
            p_dst, p_src = p.spans
            clash = ("writes the destination" if _overlap(dst, p_dst) else
                     "reads the destination" if _overlap(dst, p_src) else
                     "writes the source" if _overlap(src, p_dst) else None)
            if clash is not None and not self._ordered_after(copy, p):
                raise CopyRaceError(f"race: {copy.label()} uses memory that {p.label()}, still in flight, {clash} of; "
                                    f"wait for node {p.node}'s copy first or pass it as after=")

    def _check_landed(self, copy: _Deferred) -> None:
        """``copy`` writes memory a landed h2d copy read, or touches what a landed d2h copy wrote,
        before the host knew either landed: fine if ``copy`` is ordered after it on the streams
        (then the host's view of it is settled first), a race if not."""
        dst, src = copy.spans
        for e in [e for e in self._landed if _overlap(e.span, dst) or (e.direction == "d2h" and _overlap(e.span, src))]:
            if not e.synced_by(copy):
                raise CopyRaceError(f"race: {copy.label()} uses memory of the {e.direction} copy of node "
                                    f"{e.node or '(outside a graph)'}, which nothing has waited on yet; wait for it "
                                    f"first or pass it as after=")
            self._settle([e])

    def check_free(self, buf: torch.Tensor, node: str | None = None) -> None:
        span = _span(buf)
        with self._lock:
            for p in self._pending:
                if _overlap(span, p.spans[0]) or _overlap(span, p.spans[1]):
                    raise CopyRaceError(f"race: node {node or '(outside a graph)'} frees memory {p.label()} still "
                                        f"owns; its wait must come first")

    def _land(self, copy: _Deferred) -> None:
        with self._lock:
            if copy.landed:
                return
            if isinstance(copy.after, _Deferred):
                self._land(copy.after)
            for p in [p for p in self._pending if p.direction == copy.direction and p.seq < copy.seq]:
                self._land(p)
            self._pending.remove(copy)
            copy.landed = True
            dst_span, src_span = copy.spans        # the copy engines see each other's landed writes
            self._settle([e for e in self._landed if e.direction == "d2h" and
                          (_overlap(e.span, src_span) or _overlap(e.span, dst_span))])
            try:
                self._copy(copy, dst_span, src_span)
                self.copies_landed += 1
            except BaseException as e:      # noqa: BLE001 -- raised by the waits
                copy.error = e
            copy.dst = copy.src = copy.after = None

    def _copy(self, copy: _Deferred, dst_span, src_span) -> None:
        """Run ``copy``: a d2h copy into a buffer the host sees at its sync, an h2d copy into its
        destination, keeping its source as read. The checker's own buffers are nobody's memory, so
        they are made outside any dispatch mode (the non-model tracker)."""
        with _disable_current_modes():
            if copy.direction == "d2h":
                kept = torch.empty_like(copy.dst)
                self.link.copy(kept, copy.src, copy.direction, copy.activation, counted=copy.counted)
                self._landed.append(_Landed(copy.seq, "d2h", copy.chain, copy.node, copy.dst, kept, dst_span))
            else:
                self.link.copy(copy.dst, copy.src, copy.direction, copy.activation, counted=copy.counted)
                self._landed.append(_Landed(copy.seq, "h2d", copy.chain, copy.node, copy.src, copy.src.clone(),
                                            src_span))

    def _compute_waited(self, copy: _Deferred) -> None:
        """Compute waited on ``copy``, so on every copy it is ordered after."""
        with self._lock:
            for e in self._landed:
                if e.waited_at is None and ((e.direction == copy.direction and e.seq <= copy.seq)
                                            or e.seq in copy.chain):
                    e.waited_at = self._seq

    def _host_sync(self, copy: _Deferred) -> None:
        """A host-side wait on ``copy``: the host now knows which copies landed."""
        with self._lock:
            self._compute_waited(copy)
            self._settle([e for e in self._landed if e.synced_by(copy)])

    def sync_compute(self) -> None:
        with self._lock:
            self._settle([e for e in self._landed if e.waited_at is not None])

    def _settle(self, entries: list[_Landed]) -> None:
        """The host sees ``entries`` landed: a d2h destination gets its bytes, an h2d source must
        still hold what the copy read."""
        gone = set(map(id, entries))
        self._landed = [e for e in self._landed if id(e) not in gone]
        with _disable_current_modes():
            for e in entries:
                if e.direction == "d2h":
                    e.user.copy_(e.kept)
            changed = [e for e in entries if e.direction == "h2d" and not _same_bytes(e.user, e.kept)]
        for e in changed[:1]:
                raise CopyRaceError(
                    f"race: the host wrote the source of the h2d copy of node {e.node or '(outside a graph)'} "
                    f"after only a compute-side wait, before it knew the copy had landed (on a GPU the copy "
                    f"may read the new bytes); wait_host() on the copy first")

    def idle(self) -> bool:
        return not self._pending


    def drain(self) -> list[BaseException]:
        with self._lock:
            pending = list(self._pending)
            for p in pending:
                self._land(p)
            errors = [p.error for p in pending if p.error is not None]
            try:
                self._settle(list(self._landed))
            except CopyRaceError as e:
                errors.append(e)
            return errors
