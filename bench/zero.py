"""ZeRO data parallelism by chunk: 1 process against 2 (and 4 where the machine has the cores).

A fixed global batch of GPT sequences, one torch thread per process, gloo on the CPU, the same
device budget per rank, the emulated link (``--link``) applied to host<->device copies *and* to
the collectives (each takes at least bytes / bandwidth), so overlap of communication with compute
shows in the step time. Per run (both modes): median step time and the speed-up over one process,
bytes per step on each link (h2d, d2h, all-gathered, reduce-scattered), model data per rank (its
shards of the fp32 masters, Adam states and compute-dtype chunks), the measured peak against the
budget, and the largest loss difference against the one-process run of the same mode (the ranks'
mean loss over the same global batch).

    python bench/zero.py [--quick] [--link 200MB/s] [--ranks 1,2] [--markdown] [--out bench/results/zero.json]
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pscompile
from compare import probe
from harness.host import meta
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import gpt_of, token_batches
from pscompile.units import format_bytes, parse_rate

FULL = dict(n_layer=4, d=256, vocab=4096, seq=128, batch=8, warmup=2, steps=5, headroom=1.3)
QUICK = dict(n_layer=2, d=64, vocab=256, seq=32, batch=4, warmup=1, steps=2, headroom=1.3)
MODES = ("compiled", "hooks")


def global_batches(s: dict, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(s["vocab"], s["batch"], s["seq"], n, seed=1)


def share(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank].contiguous() for t in batch)


def rank_main(rank: int, world: int, port: int, s: dict, mode: str, budget: int, link, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    batches = global_batches(s, s["warmup"] + s["steps"])
    result: dict = {"world": world, "mode": mode, "budget_bytes": budget}
    try:
        cfg = cpu_config(mode, device_memory=budget, link_bandwidth=link)
        engine = pscompile.compile(gpt_of(s), share(batches[0], rank, world), config=cfg)
        losses, times, stats = [], [], []
        for i, b in enumerate(batches):
            t = time.perf_counter()
            losses.append(engine.step(share(b, rank, world)))
            if i >= s["warmup"]:
                times.append(time.perf_counter() - t)
                stats.append(engine.stats)
        mean = lambda k: statistics.fmean(getattr(x, k) for x in stats)  # noqa: E731
        result.update(
            losses=losses, step_times_s=times, median_step_s=statistics.median(times),
            h2d_bytes_per_step=mean("h2d_bytes"), d2h_bytes_per_step=mean("d2h_bytes"),
            allgather_bytes_per_step=mean("allgather_bytes"),
            reduce_scatter_bytes_per_step=mean("reduce_scatter_bytes"),
            peak_device_bytes=max(x.peak_device_bytes for x in stats),
            model_bytes_per_rank=sum(engine.model_data().values()),
            min_device_memory=engine.min_device_memory,
            chunk_elements=engine.layout.chunk_size // world, chunks=engine.layout.num_chunks * world)
        engine.close()
    except Exception as e:            # a failed configuration is a row with its error
        result["error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if world > 1:                # every rank done with every collective before any tears down
        dist.barrier()
        dist.destroy_process_group()
    # the result is on disk; end the process at once. The interpreter's own teardown after a gloo
    # group aborted a rank in CI ("terminate called without an active exception": a C++ thread of
    # torch's destroyed while joinable), which is no part of what this benchmark measures
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(s: dict, mode: str, world: int, budget: int, link) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(rank_main, args=(world, free_port(), s, mode, budget, link, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = parser(__doc__, "zero", quick="a tiny model (the smoke test)", markdown=True)
    ap.add_argument("--link", default="200MB/s", help="emulated bandwidth of every link, or 'none' (default 200MB/s)")
    ap.add_argument("--ranks", default=None, help="comma-separated world sizes (default 1,2, and 4 with >= 4 cores)")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    link = None if args.link.lower() == "none" else parse_rate(args.link, "--link")
    worlds = ([int(x) for x in args.ranks.split(",")] if args.ranks else
              [1, 2] + ([4] if (os.cpu_count() or 1) >= 4 else []))
    torch.set_num_threads(1)
    rows, results, failed = [], [], False
    for mode in MODES:
        budget = int(probe(gpt_of(s), global_batches(s, 1)[0], mode)[0] * s["headroom"])   # one process's minimum
        base = None
        for world in worlds:
            r = run_world(s, mode, world, budget, link)
            results.append(r)
            if "error" in r:
                failed = True
                rows.append([world, mode, "error: " + r["error"][:80]] + [""] * 8)
                continue
            if world == 1:
                base = r
            r["speedup_vs_1_rank"] = base["median_step_s"] / r["median_step_s"] if base else None
            r["max_rel_loss_diff_vs_1_rank"] = (max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"]))
                                                if base else None)
            r["within_budget"] = r["peak_device_bytes"] <= budget
            failed |= not r["within_budget"]
            rows.append([world, mode, f"{r['median_step_s']:.3f}",
                         "-" if r["speedup_vs_1_rank"] is None else f"{r['speedup_vs_1_rank']:.2f}x",
                         format_bytes(r["h2d_bytes_per_step"]), format_bytes(r["d2h_bytes_per_step"]),
                         format_bytes(r["allgather_bytes_per_step"]), format_bytes(r["reduce_scatter_bytes_per_step"]),
                         format_bytes(r["model_bytes_per_rank"]),
                         f"{format_bytes(r['peak_device_bytes'])} / {format_bytes(budget)}",
                         "-" if base is None else f"{r['max_rel_loss_diff_vs_1_rank']:.1e}"])
    headers = ["ranks", "mode", "step s", "speed-up", "h2d/step", "d2h/step", "all-gathered", "reduce-scattered",
               "model data/rank", "peak / budget", "loss diff vs 1"]
    print(f"GPT L{s['n_layer']} d{s['d']} vocab {s['vocab']}, global batch {s['batch']} x {s['seq']}, float32, "
          f"1 thread per process, link {args.link} (host<->device and collectives), budget per rank = "
          f"{s['headroom']}x the one-process minimum")
    print(table(rows, headers, markdown=args.markdown))
    write_json(args.out, {"meta": meta(settings=s, link=args.link, worlds=worlds), "runs": results})
    print(f"results written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
