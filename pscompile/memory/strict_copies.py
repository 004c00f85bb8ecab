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
"""

from __future__ import annotations

import threading

import torch

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


class _Deferred(Copy):
    def __init__(self, engine: "StrictCopies", seq: int, dst, src, direction: Direction, after, activation: bool,
                 counted: bool, node: str | None):
        self.engine, self.seq, self.direction, self.node = engine, seq, direction, node
        self.dst, self.src, self.after = dst, src, after
        self.activation, self.counted = activation, counted
        self.spans = (_span(dst), _span(src))
        self.landed = False
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.engine._land(self)
        if self.error is not None:
            raise self.error

    wait_host = wait

    def done(self) -> bool:
        return self.landed

    def label(self) -> str:
        return f"the {self.direction} copy of node {self.node or '(outside a graph)'}"


class StrictCopies(CopyEngine):
    """Copies land at their wait (see the module docstring); ``copies_landed`` counts them."""

    def __init__(self, link: Link):
        super().__init__(link)
        self._pending: list[_Deferred] = []
        self._seq = 0
        self._lock = threading.RLock()      # the overlapped optimizer waits from its own thread
        self.copies_landed = 0

    def submit(self, dst, src, direction, *, after=None, activation=False, counted=False, node=None) -> Copy:
        _check_direction(direction)
        with self._lock:
            copy = _Deferred(self, self._seq, dst, src, direction, after, activation, counted, node)
            self._seq += 1
            self._check_reuse(copy)
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
            try:
                self.link.copy(copy.dst, copy.src, copy.direction, copy.activation, counted=copy.counted)
                self.copies_landed += 1
            except BaseException as e:      # noqa: BLE001 -- raised by the waits
                copy.error = e
            copy.dst = copy.src = copy.after = None

    def idle(self) -> bool:
        return not self._pending

    def move(self, dst, src, direction, *, node=None) -> None:
        self.submit(dst, src, direction, node=node).wait()

    def drain(self) -> list[BaseException]:
        with self._lock:
            pending = list(self._pending)
            for p in pending:
                self._land(p)
            return [p.error for p in pending if p.error is not None]
