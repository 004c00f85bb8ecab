"""Checkpoint memory, size and speed: ``pscompile.save`` / ``load`` against ``torch.save`` /
``torch.load`` of the engine's state dict, and against the disk's own sequential rate.

Each row runs in a fresh process (the peak resident memory of a process only grows): an engine
(hooks mode, float32, one step taken) on a stack of square Linear layers, then the operation with
the kernel's peak-RSS counter reset just before it (``/proc/self/clear_refs``), so "extra peak" is
the operation's own: the peak minus the resident memory before it. Freed heap memory is given back
first (``malloc_trim``) and large buffers come from fresh pages (``MALLOC_MMAP_THRESHOLD_``), so an
allocation cannot hide in memory the process already holds. The bound is the issue's: 1.2x
one chunk's state (fp32 master + two Adam states = 12 bytes per element of a chunk). The "states
on disk" rows keep all but one chunk's optimizer states in the disk tier (``host_memory`` below
the state), so the save reads them through the tier's one-chunk cache and the load writes them
back through it. The disk rate writes (fsync) and reads the same number of bytes with plain file I/O.

    python bench/checkpoint.py            # ~1.2 GB of state
    python bench/checkpoint.py --quick    # ~24 MiB, for CI
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from harness.host import vm_hwm_bytes
from harness.output import parser, table, write_json
from harness.runner import child, run_fresh

STATE_BYTES_PER_ELEMENT = 12


def _reset_peak() -> int:
    """Give freed heap memory back to the system (else a later allocation reuses it unseen), reset
    the peak-RSS counter, and return the resident memory now."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _engine(width: int, layers: int, chunk: int, disk_dir: str | None = None):
    """The engine (one step taken); with ``disk_dir`` the host holds the param chunks, the disk
    tier's staging buffers and one chunk's states, and every other chunk's states live on disk."""
    import torch
    import pscompile
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    x = torch.randn(4, width)

    def loss_fn(out, batch):
        return out.square().mean()
    chunks = pscompile.build_layout(((n, tuple(p.shape)) for n, p in model.named_parameters()), chunk).num_chunks
    tiers = {} if disk_dir is None else dict(disk_dir=disk_dir, host_memory=(4 * chunks + 4 * 12) * chunk)
    engine = pscompile.compile(model, (x,), loss_fn=loss_fn,
                               config=pscompile.Config(mode="hooks", dtype=torch.float32, chunk_size=chunk, **tiers))
    engine.step((x,))
    return engine


def worker(spec: dict) -> dict:
    """One measurement, in this (fresh) process."""
    import torch
    import pscompile
    op, width, layers, chunk, folder = (spec[k] for k in ("op", "width", "layers", "chunk", "folder"))
    disk = op.endswith("(states on disk)")
    engine = _engine(width, layers, chunk, disk_dir=folder if disk else None)
    on_disk = sum(t.name == "DISK" for t in engine.store.os_tier)
    elements = sum(p.numel() for p in engine.params.values())
    path = Path(folder) / ("ps.ckpt" if op.startswith("pscompile") else "torch.pt")
    if "load" in op:                 # the file the load reads, written before the measurement
        pscompile.save(engine, path) if op.startswith("pscompile") else torch.save(engine.state_dict(), path)
    base = _reset_peak()
    t0 = time.perf_counter()
    if op.startswith("pscompile.save"):
        pscompile.save(engine, path)
    elif op.startswith("pscompile.load"):
        pscompile.load(engine, path)
    elif op == "torch.save":
        torch.save(engine.state_dict(), path)
    else:
        engine.load_state_dict(torch.load(path, weights_only=True))
    seconds = time.perf_counter() - t0
    return {"op": op, "seconds": seconds, "extra_peak_bytes": vm_hwm_bytes() - base,
            "file_bytes": path.stat().st_size, "state_bytes": STATE_BYTES_PER_ELEMENT * elements,
            "chunk_state_bytes": STATE_BYTES_PER_ELEMENT * engine.layout.chunk_size,
            "num_chunks": engine.layout.num_chunks, "chunks_on_disk": on_disk}


def disk_rate(nbytes: int, folder: str) -> dict:
    """Sequential write (fsync) and read of ``nbytes`` with plain file I/O, 8 MiB blocks."""
    block = os.urandom(8 << 20)
    path = Path(folder) / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    read = time.perf_counter() - t0
    path.unlink()
    return {"write_s": write, "read_s": read}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "checkpoint", quick="about 24 MiB of state instead of 1.2 GB", child=True)
    args = ap.parse_args(argv)
    if child(args.child, worker):
        return 0
    width, layers, chunk = (512, 8, 1 << 18) if args.quick else (4096, 6, 4 << 20)
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as folder:
        for op in ("pscompile.save", "pscompile.load", "torch.save", "torch.load",
                   "pscompile.save (states on disk)", "pscompile.load (states on disk)"):
            # large buffers from mmap (fresh pages, counted when touched), never from a reused heap
            rows.append(run_fresh(__file__, dict(op=op, width=width, layers=layers, chunk=chunk, folder=folder),
                                  timeout=900, env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}))
            print(f"[{op}] {rows[-1]['seconds']:.2f} s", file=sys.stderr)
        disk = disk_rate(rows[0]["file_bytes"], folder)
    mib = 1 << 20
    cells = [[r["op"], f"{r['chunks_on_disk']}/{r['num_chunks']}", f"{r['state_bytes'] / mib:,.0f}",
              f"{r['file_bytes'] / r['state_bytes']:.3f}",
              f"{r['extra_peak_bytes'] / mib:,.1f}", f"{r['extra_peak_bytes'] / r['chunk_state_bytes']:.2f}",
              f"{r['extra_peak_bytes'] / r['state_bytes']:.3f}", f"{r['seconds']:.2f}",
              f"{(disk['write_s'] if 'save' in r['op'] else disk['read_s']) / r['seconds']:.2f}"] for r in rows]
    print(f"Checkpoint of {rows[0]['num_chunks']} chunks of {chunk:,} elements (one chunk's state: "
          f"{rows[0]['chunk_state_bytes'] / mib:.0f} MiB); each row a fresh process; extra peak = peak RSS during "
          f"the call minus RSS before it; disk rate = plain sequential write (fsync) / read of the same bytes")
    print(table(cells, ["operation", "chunks' states on disk", "state MiB", "file / state", "extra peak MiB",
                        "extra / chunk state", "extra / state", "seconds", "disk time / time"], markdown=False))
    write_json(args.out, {"quick": args.quick, "width": width, "layers": layers, "chunk_size": chunk,
                          "rows": rows, "disk": disk})
    return 0


if __name__ == "__main__":
    sys.exit(main())
