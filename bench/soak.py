"""Soak: thousands of steps with eviction on every step, both modes; nothing may grow or drift.

Per mode (compiled with Inductor, and hooks), a 2-layer GPT (``--quick``: 1 layer, d=64, 200 steps)
trains ``--steps`` steps under 1.1x its minimum, with an ``evaluate`` every 100 and a
``pscompile.save`` every 500. Every step is checked (peak within budget, evictions, a finite loss,
the chunk bytes of the plan or of hooks mode's first steady step); every 50 steps the RSS, the
model data on the device, the Python objects and the threads are sampled, and after the warm-up
(10% of the steps) they must be flat (docs/benchmarks.md gives the limits).

    python bench/soak.py [--steps 2000] [--quick] [--modes compiled hooks] [--markdown]
                         [--out bench/results/soak.json]

Float32, one torch thread. Exits 1 if a check fails.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import gpt, token_batches
from pscompile.units import format_bytes

MiB = 2**20
SAMPLE_EVERY = 50
EVAL_EVERY = 100
SAVE_EVERY = 500
FULL_MODEL = (2, 128)       # (n_layer, d_model)
QUICK_MODEL = (1, 64)       # still evicts on every step at 1.1x its minimum


def make_model(quick: bool = False):
    return gpt(*(QUICK_MODEL if quick else FULL_MODEL), 512, 64, dropout=0.1)


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def device_model_bytes(engine) -> int:
    """Model data on the device now: compiled mode's slots and device-homed states, or the store's."""
    if hasattr(engine, "moves"):
        return engine.moves.model_bytes()
    return engine.store.device_model_bytes()


def soak(mode: str, steps: int, quick: bool = False) -> dict:
    data = token_batches(512, 4, 64, 4)
    config = cpu_config(mode, backend="inductor")
    least = pscompile.min_device_memory(make_model(quick), data[0], config)
    budget = int(least * 1.1)
    engine = pscompile.compile(make_model(quick), data[0], config=dataclasses.replace(config, device_memory=budget))
    warmup = max(SAMPLE_EVERY, steps // 10)
    samples, violations, losses = [], [], []
    steady_bytes = None
    t0 = time.perf_counter()
    t_warm = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(steps):
            loss = engine.step(data[i % len(data)])
            s = engine.stats
            losses.append(loss)
            moved = (s.chunk_h2d_bytes, s.chunk_d2h_bytes)
            if mode == "compiled":
                want = (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
            else:                     # the same trace every step; after an evaluate() its chunks are warm
                steady_bytes = steady_bytes or (moved if i >= 1 else None)
                want = steady_bytes or moved
                if i % EVAL_EVERY == 0 and moved[0] <= want[0] and moved[1] == want[1]:
                    want = moved
            problems = [p for p, bad in ((f"peak {s.peak_device_bytes} > budget {budget}",
                                          s.peak_device_bytes > budget), ("no eviction", s.num_evictions == 0),
                                         (f"moved {moved}, planned {want}", moved != want),
                                         (f"loss {loss}", not math.isfinite(loss))) if bad]
            if problems:
                violations.append((i, problems))
            if i + 1 == warmup:
                t_warm = time.perf_counter()
            if (i + 1) % SAMPLE_EVERY == 0:      # at a step's end (an evaluate leaves warm chunks)
                gc.collect()
                samples.append(dict(step=i + 1, rss=rss_bytes(), resident=len(engine.store.resident_chunks()),
                                    device_bytes=device_model_bytes(engine), objects=len(gc.get_objects()),
                                    threads=threading.active_count()))
            if (i + 1) % EVAL_EVERY == 0:
                engine.evaluate(data[0])
            if (i + 1) % SAVE_EVERY == 0:
                pscompile.save(engine, Path(tmp) / "soak.ckpt")
    t_end = time.perf_counter()
    engine.close()
    after = [x for x in samples if x["step"] > warmup]
    first = after[0]
    rss = [x["rss"] for x in after]
    growth = max(rss) - first["rss"]
    slope = 1000 * statistics.linear_regression([x["step"] for x in after], rss).slope if len(after) > 1 else 0.0
    checks = {
        "rss_flat": growth <= max(16 * MiB, 0.03 * first["rss"]) and slope <= 4 * MiB,
        "occupancy_flat": len({(x["resident"], x["device_bytes"]) for x in after}) == 1,
        "objects_flat": max(x["objects"] for x in after) <= first["objects"] * 1.01,
        "threads_flat": len({x["threads"] for x in after}) == 1,
        "stats_consistent": not violations,
    }
    return dict(mode=mode, steps=steps, warmup=warmup, budget=budget, minimum=least,
                step_ms=1000 * (t_end - (t_warm or t0)) / max(1, steps - warmup),
                rss_first=first["rss"], rss_last=rss[-1], rss_growth=growth, rss_slope_per_1000=slope,
                resident=sorted({x["resident"] for x in after}),
                device_bytes=sorted({x["device_bytes"] for x in after}),
                objects=(first["objects"], after[-1]["objects"]), threads=sorted({x["threads"] for x in after}),
                evictions_per_step=engine.stats.num_evictions, loss_first=losses[0], loss_last=losses[-1],
                violations=violations[:5], num_violations=len(violations), checks=checks, samples=samples)


def main(argv=None) -> int:
    p = parser(__doc__, "soak", quick="a 1-layer d=64 GPT, 200 steps by default (a smoke run)", markdown=True)
    p.add_argument("--steps", type=int, default=None, help="default 2000 (--quick: 200)")
    p.add_argument("--modes", nargs="+", default=["compiled", "hooks"], choices=["compiled", "hooks"])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (200 if args.quick else 2000)
    results = []
    for mode in args.modes:
        print(f"soak: {mode} mode, {steps} steps ...", flush=True)
        results.append(soak(mode, steps, args.quick))
    rows = [[r["mode"], r["steps"], f"{r['step_ms']:.1f}", format_bytes(r["budget"]), r["evictions_per_step"],
             f"{r['rss_first'] / MiB:.1f} -> {r['rss_last'] / MiB:.1f} MiB",
             f"{r['rss_growth'] / MiB:+.1f} MiB", f"{r['rss_slope_per_1000'] / MiB:+.2f} MiB",
             "/".join(str(v) for v in r["resident"]), f"{r['objects'][0]} -> {r['objects'][1]}",
             "/".join(str(v) for v in r["threads"]), r["num_violations"],
             "yes" if all(r["checks"].values()) else "NO: " + ", ".join(k for k, v in r["checks"].items() if not v)]
            for r in results]
    print(table(rows, ["mode", "steps", "ms/step", "budget", "evictions/step", "RSS after warm-up -> end", "RSS growth",
                       "RSS slope /1000 steps", "resident chunks", "Python objects", "threads", "stat violations",
                       "flat"], markdown=args.markdown))
    write_json(args.out, dict(steps=steps, results=results))
    return 0 if all(all(r["checks"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
