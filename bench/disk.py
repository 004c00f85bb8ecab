"""The disk tier: optimizer steps with states on disk, the disk's reads overlapped with the
updates against serialized (each chunk read when its update starts), against the bound: the longer
of the update's compute alone (the same model with every state in RAM) and the disk's time alone
(the same slots written and read back through the tier's own file and I/O queue, no update).

A GPT whose fp32 master and Adam states mostly live on disk (``host_memory`` holds the
compute-dtype chunks, the staging buffers and a few chunks' states) trains in hooks mode with
``Config(disk_dir=...)`` on a real file (``O_DIRECT`` where the file system allows it, so the page
cache does not serve the reads). For each setting: the median optimizer time per step, the disk
bytes per step and the rate they imply, and the loss after the steps (the two settings must agree
exactly: only the order of I/O differs).

    python bench/disk.py [--quick] [--dir FOLDER] [--markdown] [--out bench/results/disk.json]

Float32, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.memory.tiers import Tier
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.units import format_bytes

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "disk.json"
FULL = dict(n_layer=6, d=384, vocab=4096, seq=64, batch=2, steps=6, chunk=1 << 18)
QUICK = dict(n_layer=2, d=128, vocab=512, seq=32, batch=2, steps=3, chunk=1 << 14)


def model(s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=s["n_layer"], n_head=max(1, s["d"] // 64), d_model=s["d"], vocab_size=s["vocab"],
                         seq_len=s["seq"]))


def disk_alone(folder: str, slots: int, slot_bytes: int, reps: int = 2) -> float:
    """Seconds to write and read back ``slots`` slots through the tier's own file and queue."""
    from pscompile.memory.disk import DiskQueue, SlotFile
    queue = DiskQueue(SlotFile(folder, num_slots=slots, slot_bytes=slot_bytes))
    bufs = [torch.randn(slot_bytes // 4) for _ in range(3)]
    best = float("inf")
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            for fut in [queue.write(k, bufs[k % 3]) for k in range(slots)]:
                fut.result()
            for fut in [queue.read(k, bufs[k % 3]) for k in range(slots)]:
                fut.result()
            best = min(best, time.perf_counter() - t0)
    finally:
        queue.close()
    return best


def compute_alone(s: dict) -> float:
    """The median optimizer seconds of the same model with every state in host memory."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    batch = (idx, torch.roll(idx, -1, dims=1))
    engine = pscompile.compile(model(s), batch, config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, chunk_size=s["chunk"]))
    times = []
    for _ in range(s["steps"]):
        engine.step(batch)
        times.append(engine.stats.optimizer_s)
    engine.close()
    return statistics.median(times[1:])


def run(s: dict, folder: str, prefetch: bool, lock_free: bool = False) -> dict:
    """Train ``s["steps"]`` steps with the states on disk; ``lock_free``: the update thread does
    the disk I/O and the update while the next step's forward and backward run."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    batch = (idx, torch.roll(idx, -1, dims=1))
    m = model(s)
    n_params = sum(p.numel() for p in m.parameters())
    per_param = 4 + (4 + 4 * 2 if lock_free else 0)      # the param chunks (+ next params, 2 gradient sets)
    host = (n_params + 2 * s["chunk"]) * per_param + 5 * 12 * s["chunk"]   # 3 staging sets, ~2 chunks' states
    engine = pscompile.compile(m, batch, config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, host_memory=host, disk_dir=folder, chunk_size=s["chunk"],
        lock_free=lock_free))
    engine.disk_prefetch = prefetch
    on_disk = sum(t is Tier.DISK for t in engine.store.os_tier)
    times, steps, fb, losses = [], [], [], []
    before = engine._disk_bytes()
    for _ in range(s["steps"]):
        losses.append(engine.step(batch))
        times.append(engine.stats.optimizer_s)
        steps.append(engine.stats.time_s)
        fb.append(engine.stats.forward_s + engine.stats.backward_s)
    engine._apply_queued_updates()
    moved = sum(engine._disk_bytes()) - sum(before)
    direct = engine.store.disk.queue.file.direct
    engine.close()
    opt = statistics.median(times[1:])
    return dict(prefetch=prefetch, lock_free=lock_free, params=n_params, chunks=engine.layout.num_chunks,
                chunks_on_disk=on_disk, host_memory=host, direct=direct, optimizer_s=opt,
                step_s=statistics.median(steps[1:]), forward_backward_s=statistics.median(fb[1:]),
                disk_bytes_per_step=moved // s["steps"], disk_rate=moved / s["steps"] / opt if opt else 0.0,
                losses=losses)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dir", default=None, help="folder for the disk tier's file (default: a temporary one)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    s = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        results = [run(s, folder, prefetch) for prefetch in (False, True)]
        serial, overlap = results
        disk_s = disk_alone(folder, 3 * overlap["chunks_on_disk"], 4 * s["chunk"])
    compute_s = compute_alone(s)
    bound = max(disk_s, compute_s)
    rows = [["serialized" if not r["prefetch"] else "overlapped", f"{r['params']:,}",
             f"{r['chunks_on_disk']}/{r['chunks']}", "O_DIRECT" if r["direct"] else "buffered",
             f"{r['optimizer_s'] * 1000:.0f}", format_bytes(r["disk_bytes_per_step"]),
             f"{r['disk_rate'] / 1e6:.0f} MB/s", f"{serial['optimizer_s'] / r['optimizer_s']:.2f}x",
             f"{r['optimizer_s'] / bound:.2f}"]
            for r in results]
    print(tabulate(rows, headers=["disk reads", "params", "chunks on disk", "file", "optimizer ms/step",
                                  "disk bytes/step", "rate", "speed-up", "/ bound"],
                   tablefmt="github" if args.markdown else "simple"))
    print(f"bound: max(update compute alone {compute_s * 1000:.0f} ms, disk alone {disk_s * 1000:.0f} ms) = "
          f"{bound * 1000:.0f} ms")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        free = run(s, folder, True, lock_free=True)
    rows = [[name, f"{r['step_s'] * 1000:.0f}", f"{r['forward_backward_s'] * 1000:.0f}",
             f"{r['optimizer_s'] * 1000:.0f}", format_bytes(r["disk_bytes_per_step"]),
             f"{r['step_s'] / max(r['forward_backward_s'], bound):.2f}"]
            for name, r in (("synchronous (overlapped reads)", overlap), ("lock-free, staleness 1", free))]
    print(tabulate(rows, headers=["update", "step ms", "forward+backward ms", "optimizer ms on the step",
                                  "disk bytes/step", "step / max(fwd+bwd, bound)"],
                   tablefmt="github" if args.markdown else "simple"))
    results.append(free)
    same = serial["losses"] == overlap["losses"]      # (lock-free trains on delayed updates: other losses)
    print(f"losses identical in both settings: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, results=results, same_losses=same, disk_alone_s=disk_s,
                                        compute_alone_s=compute_s, bound_s=bound), indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
