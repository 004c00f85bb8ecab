"""The disk tier (docs/disk-tier.md): a GPT whose fp32 master and Adam states mostly live on disk
trains in hooks mode on a real file (``O_DIRECT`` where allowed), its reads serialized against
overlapped with the updates, against the bound max(the update's compute with every state in RAM,
the disk alone moving the same slots through the tier's own file and queue): per setting the
median optimizer time, the disk bytes and rate per step, and the losses (equal in both). Then
whole steps, synchronous against lock-free; and compiled mode with most chunks' parameters on disk
too, each read when needed against read ahead, against max(the step in RAM, the disk alone).

    python bench/disk.py [--quick] [--dir FOLDER] [--markdown] [--out bench/results/disk.json]

Float32, one torch thread.
"""

from __future__ import annotations

import sys
import tempfile

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import median_after, train
from harness.specs import gpt_of, token_batches
from harness.timing import time_reps
from pscompile.memory.disk_homes import disk_staging_bytes
from pscompile.memory.tiers import Tier
from pscompile.units import format_bytes

FULL = dict(n_layer=6, d=384, vocab=4096, seq=64, batch=2, steps=6, chunk=1 << 18)
QUICK = dict(n_layer=2, d=128, vocab=512, seq=32, batch=2, steps=3, chunk=1 << 14)


def disk_alone(folder: str, slots: int, slot_bytes: int, reps: int = 2) -> float:
    """Seconds to write and read back ``slots`` slots through the tier's own file and queue."""
    from pscompile.memory.disk import DiskQueue, SlotFile
    queue = DiskQueue(SlotFile(folder, num_slots=slots, slot_bytes=slot_bytes))
    bufs = [torch.randn(slot_bytes // 4) for _ in range(3)]

    def write_and_read():
        for io in (queue.write, queue.read):
            for fut in [io(k, bufs[k % 3]) for k in range(slots)]:
                fut.result()
    try:
        return min(time_reps(write_and_read, reps))
    finally:
        queue.close()


def _batch(s: dict) -> tuple:
    """The one batch every run trains on."""
    return token_batches(s["vocab"], s["batch"], s["seq"], 1)[0]


def run(s: dict, folder: str, prefetch: bool, lock_free: bool = False) -> dict:
    """Train ``s["steps"]`` steps with the states on disk; ``lock_free``: the update thread does
    the disk I/O and the update while the next step's forward and backward run."""
    batch = _batch(s)
    m = gpt_of(s)
    n_params = sum(p.numel() for p in m.parameters())
    per_param = 4 + (4 + 4 * 2 if lock_free else 0)      # the param chunks (+ next params, 2 gradient sets)
    host = (n_params + 2 * s["chunk"]) * per_param + 5 * 12 * s["chunk"]   # 3 staging sets, ~2 chunks' states
    engine = pscompile.compile(m, batch, config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, host_memory=host, disk_dir=folder, chunk_size=s["chunk"],
        lock_free=lock_free))
    engine.disk_prefetch = prefetch
    on_disk = sum(t is Tier.DISK for t in engine.store.os_tier)
    before = engine._disk_bytes()
    losses, stats = train(engine, [batch] * s["steps"], close=False)
    engine._apply_queued_updates()
    moved = sum(engine._disk_bytes()) - sum(before)
    direct = engine.store.disk.queue.file.direct
    engine.close()
    opt = median_after(stats, "optimizer_s")
    return dict(prefetch=prefetch, lock_free=lock_free, params=n_params, chunks=engine.layout.num_chunks,
                chunks_on_disk=on_disk, host_memory=host, direct=direct, optimizer_s=opt,
                step_s=median_after(stats, "time_s"),
                forward_backward_s=median_after(stats, lambda x: x.forward_s + x.backward_s),
                disk_bytes_per_step=moved // s["steps"], disk_rate=moved / s["steps"] / opt if opt else 0.0,
                losses=losses)


def params_on_disk(s: dict, folder: str, prefetch: bool) -> dict:
    """Compiled mode with the parameters of most chunks on disk too (``host_memory``: the staging
    buffers and four chunks' parameters) under a device budget of a third of the parameters;
    ``prefetch``: the disk homes read ahead in the schedule's fetch order and the next chunk's
    states staged during an update (False: each read when it is needed)."""
    batch = _batch(s)
    m = gpt_of(s)
    n_params = sum(p.numel() for p in m.parameters())
    host = disk_staging_bytes(s["chunk"], 4) + 4 * 4 * s["chunk"]          # the staging and 4 chunks
    config = dict(mode="compiled", backend="eager", device="cpu", dtype=torch.float32, chunk_size=s["chunk"],
                  device_memory=max(n_params * 4 // 3, 24 * s["chunk"] * 4))
    engine = pscompile.compile(m, batch, config=pscompile.Config(host_memory=host, disk_dir=folder, **config))
    engine.disk_prefetch = prefetch
    losses, stats = train(engine, [batch] * s["steps"], close=False)
    on_disk = len(engine.param_disk_chunks)
    engine.close()
    return dict(prefetch=prefetch, params=n_params, chunks=engine.layout.num_chunks, param_chunks_on_disk=on_disk,
                step_s=median_after(stats, "time_s"), losses=losses, config=config,
                disk_bytes_per_step=median_after(stats, lambda x: x.disk_read_bytes + x.disk_write_bytes))


def median_in_ram(s: dict, config: dict, stat: str) -> float:
    """The median ``StepStats.<stat>`` after the first step of the same model with every chunk and
    state in host memory (the update's compute alone, the step in RAM)."""
    batch = _batch(s)
    _, stats = train(pscompile.compile(gpt_of(s), batch, config=pscompile.Config(**config)), [batch] * s["steps"])
    return median_after(stats, stat)


def params_table(s: dict, args) -> list[dict]:
    """Section 3: parameters on disk, read ahead or not, against max(the step in RAM, the disk alone)."""
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        rows = [params_on_disk(s, folder, prefetch) for prefetch in (False, True)]
        moved = rows[1]["disk_bytes_per_step"]
        slot = 4 * s["chunk"]
        disk_s = disk_alone(folder, max(1, int(moved // (2 * slot))), slot, reps=3)   # as many bytes, written and read
    ram_s = median_in_ram(s, rows[0]["config"], "time_s")
    bound = max(ram_s, disk_s)
    cells = [["each read when needed" if not r["prefetch"] else "read ahead", f"{r['params']:,}",
              f"{r['param_chunks_on_disk']}/{r['chunks']}", f"{r['step_s'] * 1000:.0f}",
              format_bytes(r["disk_bytes_per_step"]), f"{rows[0]['step_s'] / r['step_s']:.2f}x",
              f"{r['step_s'] / bound:.2f}"] for r in rows]
    print(table(cells, ["parameters on disk", "params", "chunks with parameters on disk", "step ms",
                        "disk bytes/step", "speed-up", "/ bound"], markdown=args.markdown))
    print(f"bound: max(the step with every chunk in RAM {ram_s * 1000:.0f} ms, disk alone {disk_s * 1000:.0f} ms) = "
          f"{bound * 1000:.0f} ms; losses identical: {rows[0]['losses'] == rows[1]['losses']}")
    for r in rows:
        r.update(bound_s=bound, in_ram_step_s=ram_s, disk_alone_s=disk_s,
                 config={k: str(v) for k, v in r["config"].items()})
    return rows


def main(argv=None) -> int:
    p = parser(__doc__, "disk", markdown=True)
    p.add_argument("--dir", default=None, help="folder for the disk tier's file (default: a temporary one)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    s = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        results = [run(s, folder, prefetch) for prefetch in (False, True)]
        serial, overlap = results
        disk_s = disk_alone(folder, 3 * overlap["chunks_on_disk"], 4 * s["chunk"])
    compute_s = median_in_ram(s, dict(mode="hooks", device="cpu", dtype=torch.float32, chunk_size=s["chunk"]),
                              "optimizer_s")
    bound = max(disk_s, compute_s)
    print(table([["serialized" if not r["prefetch"] else "overlapped", f"{r['params']:,}",
                  f"{r['chunks_on_disk']}/{r['chunks']}", "O_DIRECT" if r["direct"] else "buffered",
                  f"{r['optimizer_s'] * 1000:.0f}", format_bytes(r["disk_bytes_per_step"]),
                  f"{r['disk_rate'] / 1e6:.0f} MB/s", f"{serial['optimizer_s'] / r['optimizer_s']:.2f}x",
                  f"{r['optimizer_s'] / bound:.2f}"] for r in results],
                ["disk reads", "params", "chunks on disk", "file", "optimizer ms/step", "disk bytes/step", "rate",
                 "speed-up", "/ bound"], markdown=args.markdown))
    print(f"bound: max(update compute alone {compute_s * 1000:.0f} ms, disk alone {disk_s * 1000:.0f} ms) = "
          f"{bound * 1000:.0f} ms")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        free = run(s, folder, True, lock_free=True)
    print(table([[name, f"{r['step_s'] * 1000:.0f}", f"{r['forward_backward_s'] * 1000:.0f}",
                  f"{r['optimizer_s'] * 1000:.0f}", format_bytes(r["disk_bytes_per_step"]),
                  f"{r['step_s'] / max(r['forward_backward_s'], bound):.2f}"]
                 for name, r in (("synchronous (overlapped reads)", overlap), ("lock-free, staleness 1", free))],
                ["update", "step ms", "forward+backward ms", "optimizer ms on the step", "disk bytes/step",
                 "step / max(fwd+bwd, bound)"], markdown=args.markdown))
    results.append(free)
    params = params_table(s, args)
    same = serial["losses"] == overlap["losses"] and params[0]["losses"] == params[1]["losses"]
    # (lock-free trains on delayed updates: other losses)
    print(f"losses identical in both settings: {same}")
    write_json(args.out, dict(settings=s, results=results, same_losses=same, disk_alone_s=disk_s,
                              compute_alone_s=compute_s, bound_s=bound, params_on_disk=params))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
