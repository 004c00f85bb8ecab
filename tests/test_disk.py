"""The disk tier's slot file and I/O queue (``pscompile/memory/disk.py``).

- every dtype and size round-trips through a slot, with ``O_DIRECT`` where the file system allows
  it and buffered (page cache dropped) otherwise;
- the file is unlinked as soon as it exists: the folder stays empty while it is in use, after
  ``close()`` and after a process holding it is killed;
- the queue keeps submission order, counts the bytes, hands a failed transfer's exception to its
  waiter, collects errors in ``drain`` and leaves no thread after ``close``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from pscompile.memory.disk import ALIGN, DiskQueue, SlotFile


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_every_dtype_and_size_round_trips(tmp_path, direct):
    f = SlotFile(tmp_path, num_slots=3, slot_bytes=10_000, direct=direct)
    assert f.slot_bytes == 3 * ALIGN and list(tmp_path.iterdir()) == []
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(2500, generator=g), torch.randn(77, generator=g).to(torch.bfloat16),
              torch.randint(0, 1000, (1250,), generator=g)]
    for slot, v in enumerate(values):
        f.write(slot, v)
    for slot, v in reversed(list(enumerate(values))):
        out = torch.empty_like(v)
        f.read(slot, out)
        assert torch.equal(out, v)
    with pytest.raises(IndexError, match="slot 3 is outside the file's 3 slots"):
        f.write(3, values[0])
    with pytest.raises(ValueError, match="contiguous CPU tensor of at most 12288 bytes"):
        f.write(0, torch.zeros(4000))
    f.close()
    assert list(tmp_path.iterdir()) == []


def _hold_and_hang(folder: str, ready) -> None:
    f = SlotFile(folder, num_slots=2, slot_bytes=1 << 20)
    f.write(0, torch.ones(1000))
    ready.set()
    signal.pause()


def test_a_killed_process_leaves_no_file(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_and_hang, args=(str(tmp_path), ready))
    p.start()
    assert ready.wait(60)
    assert list(tmp_path.iterdir()) == []                 # unlinked while in use
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert list(tmp_path.iterdir()) == []


def test_the_queue_keeps_order_counts_bytes_and_reports_failures(tmp_path):
    q = DiskQueue(SlotFile(tmp_path, num_slots=2, slot_bytes=ALIGN), depth=2)
    a, b = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)
    q.write(0, a)
    read = q.read(0, b)                                   # queued behind the write: sees its bytes
    bad = q.read(5, b.clone())
    assert read.result() == ALIGN and torch.equal(a, b)
    with pytest.raises(IndexError):
        bad.result()
    assert [type(e) for e in q.drain()] == [IndexError]
    assert (q.traffic.write_bytes, q.traffic.read_bytes) == (ALIGN, ALIGN)
    q.write(1, a).result()                                # the thread survives a failed transfer
    thread = q._thread
    q.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="the disk queue is closed"):
        q.write(0, a)


def test_a_missing_folder_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="disk_dir=.*nowhere' is not a folder"):
        SlotFile(tmp_path / "nowhere", num_slots=1, slot_bytes=ALIGN)


def test_a_folder_without_the_space_is_refused_before_anything_is_made(tmp_path):
    """The disk tier's size is checked against the folder's free space up front: the error names
    the folder, what it has and what the tier needs, and nothing is created there."""
    import shutil
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"disk_dir=.* GiB free, and the disk tier needs .* GiB \(3 slots"):
        SlotFile(tmp_path, num_slots=3, slot_bytes=free // 2)
    assert list(tmp_path.iterdir()) == []
