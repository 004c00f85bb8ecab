"""Memory tiers, chunk-sized slot pools, and counted moves between tiers.

A ``SlotPool`` hands out chunk-sized buffers on one tier. A buffer is allocated the first time the
pool needs one more and is reused after that (no fragmentation); the pool never frees. On CUDA
the host pool pins its buffers. A ``Link`` copies between two buffers, counts the bytes and the
time, and can emulate a slow device<->host link on the CPU (``link_bandwidth``).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

import torch


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class HostMeter:
    """The host bytes a store's model data holds now (its host pools' buffers, gradient buffers)
    and their peak since ``reset_peak``; pools on several threads share it."""

    def __init__(self):
        self.in_use = 0
        self.peak = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.in_use


class SlotPool:
    """Chunk-sized buffers of one dtype on one tier.

    A released buffer goes back to the allocator (on CUDA the caching allocator keeps chunk-sized
    blocks for reuse), so the memory a pool holds is exactly its buffers in use, and memory the
    plan gives to activations after an eviction really is free. Only pinned host buffers (slow to
    pin) wait in a free list for reuse. ``acquire(numel=...)`` hands out a shorter buffer (a
    trainable chunk's optimizer states cover its state extent only), counted at its own bytes and
    never kept for reuse.
    """

    def __init__(self, tier: Tier, device: torch.device, dtype: torch.dtype, chunk_size: int,
                 *, pin: bool = False, meter: HostMeter | None = None):
        self.tier = tier
        self.device = device
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.pin = pin
        self.keep_free = pin
        self._free: list[torch.Tensor] = []
        self.allocated = 0     # buffers created so far
        self.in_use = 0        # buffers handed out now
        self.peak_in_use = 0
        self._ptrs: set[int] = set()
        self.slot_bytes = chunk_size * torch.empty((), dtype=dtype).element_size()
        self.meter = meter           # counts this pool's buffers in use (host pools)
        self._short: dict[int, int] = {}   # storage ptr -> bytes of a buffer shorter than a slot
        self._short_bytes = 0

    def acquire(self, zero: bool = False, numel: int | None = None) -> torch.Tensor:
        if numel is not None and numel != self.chunk_size:
            return self._acquire_short(numel, zero)
        if self._free:
            buf = self._free.pop()
        else:
            buf = torch.empty(self.chunk_size, dtype=self.dtype, device=self.device)
            if self.pin:
                buf = buf.pin_memory()
            self.allocated += 1
            self._ptrs.add(buf.untyped_storage().data_ptr())
        if zero:
            buf.zero_()
        self.in_use += 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        if self.meter is not None:
            self.meter.add(self.slot_bytes)
        return buf

    def _acquire_short(self, numel: int, zero: bool) -> torch.Tensor:
        if not 0 < numel < self.chunk_size:
            raise ValueError(f"a buffer of {numel} elements from a pool of {self.chunk_size}-element slots")
        buf = (torch.zeros if zero else torch.empty)(numel, dtype=self.dtype, device=self.device)
        if self.pin:
            buf = buf.pin_memory()
        nbytes = numel * buf.element_size()
        self._short[buf.untyped_storage().data_ptr()] = nbytes
        self._short_bytes += nbytes
        if self.meter is not None:
            self.meter.add(nbytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        ptr = buf.untyped_storage().data_ptr()
        short = self._short.pop(ptr, None)
        if short is not None:
            self._short_bytes -= short
            if self.meter is not None:
                self.meter.add(-short)
            return
        assert ptr in self._ptrs, "buffer does not belong to this pool"
        self.in_use -= 1
        if self.meter is not None:
            self.meter.add(-self.slot_bytes)
        if self.keep_free:
            self._free.append(buf)
        else:
            self._ptrs.discard(ptr)

    def owns(self, storage_ptr: int) -> bool:
        return storage_ptr in self._ptrs or storage_ptr in self._short

    @property
    def bytes_in_use(self) -> int:
        return self.in_use * self.slot_bytes + self._short_bytes


@dataclass
class Traffic:
    """Counters of moves, reset at the start of every step."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    num_fetches: int = 0
    num_evictions: int = 0
    transfer_s: float = 0.0
    offload_bytes: int = 0      # the part of d2h_bytes that is saved activations going to the host
    reload_bytes: int = 0       # the part of h2d_bytes that is saved activations coming back

    def add(self, other: "Traffic") -> None:
        self.h2d_bytes += other.h2d_bytes
        self.d2h_bytes += other.d2h_bytes
        self.offload_bytes += other.offload_bytes
        self.reload_bytes += other.reload_bytes
        self.num_fetches += other.num_fetches
        self.num_evictions += other.num_evictions
        self.transfer_s += other.transfer_s


class Link:
    """Counted copies between the DEVICE and HOST tiers.

    ``bandwidth`` (bytes/s, CPU only) emulates a slow link: a copy takes at least
    ``nbytes / bandwidth`` seconds (it sleeps for the rest), so transfers cost wall time the way they
    would over PCIe. The rate holds in each direction: PCIe is full duplex, so a host->device copy
    and a device->host copy running at once (``ThreadCopies``' two copy threads) each get it.
    ``None`` copies at full memory speed. Copies may run on several threads; the counts are exact.
    """

    def __init__(self, bandwidth: float | None = None):
        self.bandwidth = bandwidth
        self.traffic = Traffic()
        self._lock = threading.Lock()
        self._free: dict[str, float] = {}     # emulated: when each direction's link is next free

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, activation: bool = False, *,
             counted: bool = False, ready: float | None = None) -> None:
        """Copy ``src`` into ``dst`` and count it; ``activation``: a saved activation, not a chunk;
        ``counted``: its bytes were counted when it was issued (``count``), only its time is;
        ``ready``: when the copy could have started (issued, and what it follows landed; default:
        now). An emulated link carries it from when both it is ready and the link is free, and the
        copy returns once that ends: a copy thread that wakes late does not push the copies queued
        behind it later, and its time is the link's, ``nbytes / bandwidth``."""
        start = time.perf_counter()
        dst.copy_(src, non_blocking=False)
        nbytes = src.numel() * src.element_size()
        busy = time.perf_counter() - start
        if self.bandwidth is not None:
            with self._lock:
                begin = max(start if ready is None else min(ready, start), self._free.get(direction, 0.0))
                end = self._free[direction] = begin + nbytes / self.bandwidth
            remaining = end - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            busy = max(busy, nbytes / self.bandwidth)
        if not counted:
            self.count(nbytes, direction, activation)
        self.add_time(busy)

    def count(self, nbytes: int, direction: str, activation: bool = False) -> None:
        """Count a copy now, as it is issued (one that may land after the counters are next read:
        a fetch for the next step started by this one, or any copy on a CUDA stream); its ``copy``,
        if the link runs it, passes ``counted``."""
        with self._lock:
            if direction == "h2d":
                self.traffic.h2d_bytes += nbytes
                self.traffic.reload_bytes += nbytes if activation else 0
            elif direction == "d2h":
                self.traffic.d2h_bytes += nbytes
                self.traffic.offload_bytes += nbytes if activation else 0
            else:
                raise AssertionError(f"unknown direction {direction}")

    def add_time(self, seconds: float) -> None:
        """Busy time of copies another engine ran (CUDA streams: read from their events)."""
        with self._lock:
            self.traffic.transfer_s += seconds

    def reset(self) -> Traffic:
        with self._lock:
            done, self.traffic = self.traffic, Traffic()
        return done
