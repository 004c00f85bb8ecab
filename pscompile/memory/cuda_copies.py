"""The CUDA copy engine: the copy contract (``memory/copies.py``) on streams and events.

- One stream per direction (a GPU has a copy engine each way), so a writeback crosses while the
  next fetch does, and neither waits for compute kernels issued after it.
- ``submit``: the copy stream first waits on the compute stream (the source is what compute wrote
  up to the submit), and on ``after``'s event; then ``dst.copy_(src, non_blocking=True)`` on the copy
  stream and an event recorded after it. Host buffers must be pinned for the copy to be
  asynchronous (``host_empty`` pins; the store's host pools pin on CUDA).
- ``Copy.wait()``: the compute stream waits on the event; the host does not block.
  ``Copy.wait_host()``: the host synchronizes on the event.
- Buffer lifetimes are event-gated, as FSDP2 does, not ``record_stream``: the handle holds both
  tensors until a wait, and every caller waits (compute-side) before it frees or reuses a buffer, so
  the caching allocator, which reuses a freed block for the next allocation on the compute stream,
  can only hand it to work the compute stream runs after the copy. ``record_stream`` would delay
  the block's reuse to an allocator-chosen moment the plan cannot count; with event-gated frees a
  slot given back with ``resize_(0)`` is free at the node the plan says.
- Bytes are counted when a copy is submitted (its size is known then); transfer time is read from
  the events' timings when the copies are flushed.

ZeRO's NCCL collectives follow the same discipline on the stream of ProcessGroupNCCL: an
``async_op`` collective starts after the compute stream's work so far, and its ``work.wait()`` makes
the compute stream wait without blocking the host (``dist/comm.py``).
"""

from __future__ import annotations

import torch

from pscompile.memory.copies import DIRECTIONS, Copy, CopyEngine, _check_direction
from pscompile.memory.tiers import Link


class _EventCopy(Copy):
    def __init__(self, engine: "CudaCopies", start, end, dst, src, node: str | None):
        self.engine, self.start, self.end, self.node = engine, start, end, node
        self._keep: tuple | None = (dst, src)       # event-gated: alive until a wait

    def wait(self) -> None:
        self.engine.compute().wait_event(self.end)
        self._keep = None

    def wait_host(self) -> None:
        self.end.synchronize()
        self._keep = None

    def done(self) -> bool:
        return self.end.query()


class CudaCopies(CopyEngine):
    """Copies on one CUDA stream per direction (see the module docstring)."""

    def __init__(self, link: Link, device: torch.device, *, pinned: bool = True):
        super().__init__(link)
        self.device = device
        self.pins_host = pinned     # False: pageable host buffers (the driver stages each copy)
        self.streams = {d: torch.cuda.Stream(device=device) for d in DIRECTIONS}
        self._pending: list[_EventCopy] = []

    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def submit(self, dst, src, direction, *, after=None, activation=False, counted=False, node=None) -> Copy:
        _check_direction(direction)
        stream = self.streams[direction]
        stream.wait_stream(self.compute())
        if isinstance(after, _EventCopy):
            stream.wait_event(after.end)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        if not counted:
            self.link.count(src.numel() * src.element_size(), direction, activation=activation)
        copy = _EventCopy(self, start, end, dst, src, node)
        self._pending.append(copy)
        if len(self._pending) >= 1024:            # (a caller that never flushes: settle the landed ones)
            self._account([c for c in self._pending if c.done()])
        return copy

    def _account(self, landed: list[_EventCopy]) -> None:
        """Add the transfer time of landed copies to the link and forget them."""
        seconds = sum(c.start.elapsed_time(c.end) for c in landed) / 1e3
        self.link.add_time(seconds)
        gone = set(map(id, landed))
        self._pending = [c for c in self._pending if id(c) not in gone]

    def sync_compute(self) -> None:
        self.compute().synchronize()

    def idle(self) -> bool:
        return all(stream.query() for stream in self.streams.values())

    def drain(self) -> list[BaseException]:
        errors: list[BaseException] = []
        for stream in self.streams.values():
            try:
                stream.synchronize()
            except BaseException as e:      # noqa: BLE001 -- a CUDA error, raised by flush
                errors.append(e)
        if not errors:
            self._account(list(self._pending))
        for c in self._pending:
            c._keep = None
        self._pending = []
        return errors

    def host_empty(self, shape, dtype: torch.dtype, stride=None) -> torch.Tensor:
        if stride is None:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pins_host)
        return torch.empty_strided(shape, stride, dtype=dtype, pin_memory=self.pins_host)
