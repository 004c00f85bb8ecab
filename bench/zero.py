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

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.units import format_bytes, parse_rate

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero.json"
FULL = dict(n_layer=4, d=256, vocab=4096, seq=128, batch=8, warmup=2, steps=5, headroom=1.3)
QUICK = dict(n_layer=2, d=64, vocab=256, seq=32, batch=4, warmup=1, steps=2, headroom=1.3)
MODES = ("compiled", "hooks")


def make_model(s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=s["n_layer"], n_head=max(1, s["d"] // 64), d_model=s["d"],
                         vocab_size=s["vocab"], seq_len=s["seq"]))


def global_batches(s: dict, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(n)]


def share(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank].contiguous() for t in batch)


def config(mode: str, budget, link) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=budget, link_bandwidth=link)


def one_rank_minimum(s: dict, mode: str) -> int:
    """The measured minimum of one process on the whole global batch."""
    batch = global_batches(s, 1)[0]
    engine = pscompile.compile(make_model(s), batch, config=config(mode, None, None))
    engine.step(batch)
    least = engine.min_device_memory
    engine.close()
    return least


def rank_main(rank: int, world: int, port: int, s: dict, mode: str, budget: int, link, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    batches = global_batches(s, s["warmup"] + s["steps"])
    result: dict = {"world": world, "mode": mode, "budget_bytes": budget}
    try:
        engine = pscompile.compile(make_model(s), share(batches[0], rank, world), config=config(mode, budget, link))
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
            allgather_bytes_per_step=mean("allgather_bytes"), reduce_scatter_bytes_per_step=mean("reduce_scatter_bytes"),
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model (the smoke test)")
    ap.add_argument("--link", default="200MB/s", help="emulated bandwidth of every link, or 'none' (default 200MB/s)")
    ap.add_argument("--ranks", default=None, help="comma-separated world sizes (default 1,2, and 4 with >= 4 cores)")
    ap.add_argument("--markdown", action="store_true", help="print the table as GitHub markdown")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"JSON results (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    link = None if args.link.lower() == "none" else parse_rate(args.link, "--link")
    worlds = ([int(x) for x in args.ranks.split(",")] if args.ranks else
              [1, 2] + ([4] if (os.cpu_count() or 1) >= 4 else []))
    torch.set_num_threads(1)
    rows, results, failed = [], [], False
    for mode in MODES:
        budget = int(one_rank_minimum(s, mode) * s["headroom"])
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
                         "-" if r["max_rel_loss_diff_vs_1_rank"] is None else f"{r['max_rel_loss_diff_vs_1_rank']:.1e}"])
    headers = ["ranks", "mode", "step s", "speed-up", "h2d/step", "d2h/step", "all-gathered", "reduce-scattered",
               "model data/rank", "peak / budget", "loss diff vs 1"]
    m = s
    print(f"GPT L{m['n_layer']} d{m['d']} vocab {m['vocab']}, global batch {m['batch']} x {m['seq']}, float32, "
          f"1 thread per process, link {args.link} (host<->device and collectives), budget per rank = "
          f"{m['headroom']}x the one-process minimum")
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple"))
    meta = {"settings": s, "link": args.link, "worlds": worlds, "cpu_count": os.cpu_count(), "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "runs": results}, f, indent=2)
    print(f"results written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
