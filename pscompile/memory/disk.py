"""The disk tier's storage: one preallocated file of fixed-size slots, read and written at their
offsets by a background I/O thread (``DiskQueue``) that overlaps compute.

The file is created in ``disk_dir`` and unlinked at once: its blocks live exactly as long as the
descriptor, so ``close()``, interpreter exit and a crash all give them back, and no file is left
behind that a later engine could mistake for valid state. Where the file system allows it the
file is opened with ``O_DIRECT``: transfers bypass the page cache, so the host's RAM does not turn
the disk tier into a memcpy. ``O_DIRECT`` wants aligned addresses, offsets and sizes, so slots are
rounded up to 4 KiB and transfers go through one aligned bounce buffer. Elsewhere (tmpfs, other
systems) the file is buffered and ``posix_fadvise(DONTNEED)`` drops its pages after each transfer.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from pscompile.memory.copies import settle

ALIGN = 4096


def _buffer(t: torch.Tensor, nbytes: int):
    """A writable view of the first ``nbytes`` of a contiguous CPU tensor's memory (buffer protocol)."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class SlotFile:
    """``num_slots`` slots of ``slot_bytes`` (rounded up to 4 KiB) in one unlinked file in ``folder``."""

    def __init__(self, folder: str | os.PathLike, *, num_slots: int, slot_bytes: int, direct: bool = True):
        self.fd: int | None = None
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"disk_dir={str(folder)!r} is not a folder; create it or name an existing one")
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.num_slots = num_slots
        need, free = self.slot_bytes * num_slots, shutil.disk_usage(folder).free
        if need > free:                 # checked before anything is made: nothing is left behind
            raise ValueError(
                f"disk_dir={str(folder)!r} has {free / 2**30:.2f} GiB free, and the disk tier needs "
                f"{need / 2**30:.2f} GiB ({num_slots} slots of {self.slot_bytes} bytes); free space there, or name a "
                "folder on a disk with that much free space")
        self.path = folder / f".pscompile-{os.getpid()}-{uuid.uuid4().hex[:12]}.slots"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = False
        fd = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError:          # tmpfs and friends: no O_DIRECT
                fd = None
        if fd is None:
            fd = os.open(self.path, flags, 0o600)
        self.fd = fd
        os.unlink(self.path)         # nothing survives the descriptor: close, exit and crash alike
        try:
            size = self.slot_bytes * num_slots
            if size:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:
                    os.ftruncate(fd, size)
        except OSError as e:
            self.close()
            raise ValueError(f"disk_dir={str(folder)!r} cannot hold {num_slots} slots of {self.slot_bytes} bytes "
                             f"({size} bytes): {e}; give a folder on a disk with that much free space") from e
        self._bounce = _aligned(self.slot_bytes) if self.direct else None

    def _check(self, slot: int, t: torch.Tensor) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside the file's {self.num_slots} slots")
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous() or nbytes > self.slot_bytes:
            raise ValueError(f"a slot transfer needs a contiguous CPU tensor of at most {self.slot_bytes} bytes")
        return nbytes

    def write(self, slot: int, src: torch.Tensor) -> int:
        """Write ``src``'s bytes at the start of ``slot``; returns the bytes written to the file."""
        nbytes = self._check(slot, src)
        offset = slot * self.slot_bytes
        if self.direct:
            n = -(-nbytes // ALIGN) * ALIGN
            self._bounce[:nbytes].copy_(src.view(-1).view(torch.uint8))
            _write_all(self.fd, _buffer(self._bounce, n), offset)
        else:
            n = nbytes
            _write_all(self.fd, _buffer(src, n), offset)
            os.fdatasync(self.fd)
            _drop_pages(self.fd, offset, n)
        return n

    def read(self, slot: int, dst: torch.Tensor) -> int:
        """Fill ``dst`` from the start of ``slot``; returns the bytes read from the file."""
        nbytes = self._check(slot, dst)
        offset = slot * self.slot_bytes
        if self.direct:
            n = -(-nbytes // ALIGN) * ALIGN
            _read_all(self.fd, _buffer(self._bounce, n), offset)
            dst.view(-1).view(torch.uint8).copy_(self._bounce[:nbytes])
        else:
            n = nbytes
            _read_all(self.fd, _buffer(dst, n), offset)
            _drop_pages(self.fd, offset, n)
        return n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        self.close()


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def _read_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise OSError(f"the disk tier's file ended at byte {offset + done}")
        done += n


def _drop_pages(fd: int, offset: int, nbytes: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


@dataclass
class DiskTraffic:
    read_bytes: int = 0
    write_bytes: int = 0
    busy_s: float = 0.0


class DiskQueue:
    """Slot transfers run in submission order on one background thread; at most ``depth`` wait in
    the queue (``submit`` blocks beyond that, so the compute thread never runs far ahead of the
    disk). ``Future.result()`` waits for one transfer, ``drain`` for all (collecting errors)."""

    def __init__(self, file: SlotFile, *, depth: int = 4):
        self.file = file
        self.traffic = DiskTraffic()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._pending: list[Future] = []
        self._thread = threading.Thread(target=self._work, name="pscompile-disk", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, kind, slot, tensor = item
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.perf_counter()
            try:
                if kind == "write":
                    n = self.file.write(slot, tensor)
                    self.traffic.write_bytes += n
                else:
                    n = self.file.read(slot, tensor)
                    self.traffic.read_bytes += n
            except BaseException as e:      # noqa: BLE001 -- handed to the waiter
                fut.set_exception(e)
            else:
                fut.set_result(n)
            finally:
                self.traffic.busy_s += time.perf_counter() - t0

    def _submit(self, kind: str, slot: int, tensor: torch.Tensor) -> Future:
        if not self._thread.is_alive():
            raise RuntimeError("the disk queue is closed")
        fut: Future = Future()
        self._queue.put((fut, kind, slot, tensor))
        self._pending.append(fut)
        return fut

    def write(self, slot: int, src: torch.Tensor) -> Future:
        return self._submit("write", slot, src)

    def read(self, slot: int, dst: torch.Tensor) -> Future:
        return self._submit("read", slot, dst)

    def drain(self) -> list[BaseException]:
        """Wait for every transfer; the exceptions of those that failed."""
        pending, self._pending = self._pending, []
        return settle(pending)

    def flush(self) -> None:
        errors = self.drain()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for every transfer, stop the thread and close the file."""
        if self._thread.is_alive():
            self.drain()
            self._queue.put(None)
            self._thread.join()
        self.file.close()
