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

Then whole steps with the states on disk, synchronous against lock-free updating; and a third table
with the parameters of most chunks on disk too (compiled mode, ``host_memory`` a few chunks): each
disk home read when it is needed against read ahead in the schedule's fetch order, against the
bound max(the same step with every chunk in RAM, the disk alone moving as many bytes).

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
from pscompile.memory.disk_homes import disk_staging_bytes
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


def _batch(s: dict) -> tuple:
    """The one batch every run trains on (next-token targets)."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def compute_alone(s: dict) -> float:
    """The median optimizer seconds of the same model with every state in host memory."""
    return _median_in_ram(s, dict(mode="hooks", device="cpu", dtype=torch.float32, chunk_size=s["chunk"]),
                          "optimizer_s")


def run(s: dict, folder: str, prefetch: bool, lock_free: bool = False) -> dict:
    """Train ``s["steps"]`` steps with the states on disk; ``lock_free``: the update thread does
    the disk I/O and the update while the next step's forward and backward run."""
    batch = _batch(s)
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


def params_on_disk(s: dict, folder: str, prefetch: bool) -> dict:
    """Compiled mode with the parameters of most chunks on disk too (``host_memory``: the staging
    buffers and four chunks' parameters) under a device budget of a third of the parameters;
    ``prefetch``: the disk homes read ahead in the schedule's fetch order and the next chunk's
    states staged during an update (False: each read when it is needed)."""
    batch = _batch(s)
    m = model(s)
    n_params = sum(p.numel() for p in m.parameters())
    host = disk_staging_bytes(s["chunk"], 4) + 4 * 4 * s["chunk"]          # the staging and 4 chunks
    config = dict(mode="compiled", backend="eager", device="cpu", dtype=torch.float32, chunk_size=s["chunk"],
                  device_memory=max(n_params * 4 // 3, 24 * s["chunk"] * 4))
    engine = pscompile.compile(m, batch, config=pscompile.Config(host_memory=host, disk_dir=folder, **config))
    engine.disk_prefetch = prefetch
    steps, losses, moved = [], [], []
    for _ in range(s["steps"]):
        losses.append(engine.step(batch))
        steps.append(engine.stats.time_s)
        moved.append(engine.stats.disk_read_bytes + engine.stats.disk_write_bytes)
    on_disk = len(engine.param_disk_chunks)
    engine.close()
    return dict(prefetch=prefetch, params=n_params, chunks=engine.layout.num_chunks, param_chunks_on_disk=on_disk,
                step_s=statistics.median(steps[1:]), disk_bytes_per_step=statistics.median(moved[1:]),
                losses=losses, config=config)


def in_ram_step(s: dict, config: dict) -> float:
    """The median step of the same model and device budget with every chunk in host memory."""
    return _median_in_ram(s, config, "time_s")


def _median_in_ram(s: dict, config: dict, stat: str) -> float:
    """The median ``stats.<stat>`` after the first step, every chunk in host memory."""
    batch = _batch(s)
    engine = pscompile.compile(model(s), batch, config=pscompile.Config(**config))
    values = []
    for _ in range(s["steps"]):
        engine.step(batch)
        values.append(getattr(engine.stats, stat))
    engine.close()
    return statistics.median(values[1:])


def params_table(s: dict, args) -> list[dict]:
    """Section 3: parameters on disk, read ahead or not, against max(the step in RAM, the disk alone)."""
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        rows = [params_on_disk(s, folder, prefetch) for prefetch in (False, True)]
        moved = rows[1]["disk_bytes_per_step"]
        slot = 4 * s["chunk"]
        disk_s = disk_alone(folder, max(1, int(moved // (2 * slot))), slot, reps=3)   # as many bytes, written and read
    ram_s = in_ram_step(s, rows[0]["config"])
    bound = max(ram_s, disk_s)
    table = [["each read when needed" if not r["prefetch"] else "read ahead", f"{r['params']:,}",
              f"{r['param_chunks_on_disk']}/{r['chunks']}", f"{r['step_s'] * 1000:.0f}",
              format_bytes(r["disk_bytes_per_step"]), f"{rows[0]['step_s'] / r['step_s']:.2f}x",
              f"{r['step_s'] / bound:.2f}"] for r in rows]
    print(tabulate(table, headers=["parameters on disk", "params", "chunks with parameters on disk", "step ms",
                                   "disk bytes/step", "speed-up", "/ bound"],
                   tablefmt="github" if args.markdown else "simple"))
    print(f"bound: max(the step with every chunk in RAM {ram_s * 1000:.0f} ms, disk alone {disk_s * 1000:.0f} ms) = "
          f"{bound * 1000:.0f} ms; losses identical: {rows[0]['losses'] == rows[1]['losses']}")
    for r in rows:
        r.update(bound_s=bound, in_ram_step_s=ram_s, disk_alone_s=disk_s,
                 config={k: str(v) for k, v in r["config"].items()})
    return rows


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
    params = params_table(s, args)
    same = serial["losses"] == overlap["losses"] and params[0]["losses"] == params[1]["losses"]
    # (lock-free trains on delayed updates: other losses)
    print(f"losses identical in both settings: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, results=results, same_losses=same, disk_alone_s=disk_s,
                                        compute_alone_s=compute_s, bound_s=bound, params_on_disk=params), indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
