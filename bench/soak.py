"""Soak: thousands of steps with eviction on every step, both modes; nothing may grow or drift.

For each mode (compiled with the Inductor backend, and hooks), a 2-layer GPT trains under a
budget 10% above its minimum, so chunks are evicted and fetched on every step, for ``--steps``
steps (default 2,000) cycling over a few batches, with an ``evaluate`` every 100 steps and a
``pscompile.save`` every 500 (those paths run in the soak too). Every step is checked:

- the measured peak device bytes stay within the budget and chunks were evicted;
- the chunk bytes moved equal the plan's (compiled) or the first steady step's (hooks: the same
  trace every step; the step after an ``evaluate`` may fetch less, its chunks being warm), and the
  loss is finite.

Every 50 steps it samples the process RSS (``/proc/self/status``), the model data on the device
at the step's end (resident chunks and their bytes), the number of Python objects and of threads.
After the warm-up (the first 10% of steps) those must be flat: RSS within max(16 MiB, 3%) of its
first sample, its least-squares slope under 4 MiB per 1,000 steps, and the occupancy, objects and
threads unchanged (objects within 1%).

    python bench/soak.py [--steps 2000] [--quick] [--modes compiled hooks] [--markdown]
                         [--out bench/results/soak.json]

``--quick`` (a smoke run): a 1-layer d=64 GPT, 200 steps unless ``--steps`` says otherwise.

Float32, one torch thread. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.units import format_bytes

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "soak.json"
SAMPLE_EVERY = 50
EVAL_EVERY = 100
SAVE_EVERY = 500


FULL_MODEL = dict(n_layer=2, d_model=128)
QUICK_MODEL = dict(n_layer=1, d_model=64)       # still evicts on every step at 1.1x its minimum


def make_model(quick: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_head=2, vocab_size=512, seq_len=64, dropout=0.1, **(QUICK_MODEL if quick else FULL_MODEL)))


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, 512, (4, 64), generator=g)
        out.append((idx, torch.roll(idx, -1, dims=1)))
    return out


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def config(mode: str, budget: int | None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="inductor", device="cpu", dtype=torch.float32, device_memory=budget)


def device_model_bytes(engine) -> int:
    """Model data on the device now: compiled mode's slots and device-homed states, or the store's."""
    if hasattr(engine, "_model_bytes"):
        return engine._model_bytes()
    return engine.store.device_model_bytes()


def slope_per_1000(xs: list[int], ys: list[int]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def soak(mode: str, steps: int, quick: bool = False) -> dict:
    data = batches()
    least = pscompile.min_device_memory(make_model(quick), data[0], config(mode, None))
    budget = int(least * 1.1)
    engine = pscompile.compile(make_model(quick), data[0], config=config(mode, budget))
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
            problems = []
            if s.peak_device_bytes > budget:
                problems.append(f"peak {s.peak_device_bytes} > budget {budget}")
            if s.num_evictions == 0:
                problems.append("no eviction")
            if moved != want:
                problems.append(f"moved {moved}, planned {want}")
            if not math.isfinite(loss):
                problems.append(f"loss {loss}")
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
    slope = slope_per_1000([x["step"] for x in after], rss)
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
                resident=sorted({x["resident"] for x in after}), device_bytes=sorted({x["device_bytes"] for x in after}),
                objects=(first["objects"], after[-1]["objects"]), threads=sorted({x["threads"] for x in after}),
                evictions_per_step=engine.stats.num_evictions, loss_first=losses[0], loss_last=losses[-1],
                violations=violations[:5], num_violations=len(violations), checks=checks, samples=samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default 2000 (--quick: 200)")
    p.add_argument("--quick", action="store_true", help="a 1-layer d=64 GPT, 200 steps by default (a smoke run)")
    p.add_argument("--modes", nargs="+", default=["compiled", "hooks"], choices=["compiled", "hooks"])
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (200 if args.quick else 2000)
    results = []
    for mode in args.modes:
        print(f"soak: {mode} mode, {steps} steps ...", flush=True)
        results.append(soak(mode, steps, args.quick))
    fmt = "github" if args.markdown else "simple"
    rows = [[r["mode"], r["steps"], f"{r['step_ms']:.1f}", format_bytes(r["budget"]), r["evictions_per_step"],
             f"{r['rss_first'] / MiB:.1f} -> {r['rss_last'] / MiB:.1f} MiB",
             f"{r['rss_growth'] / MiB:+.1f} MiB", f"{r['rss_slope_per_1000'] / MiB:+.2f} MiB",
             "/".join(str(v) for v in r["resident"]), f"{r['objects'][0]} -> {r['objects'][1]}",
             "/".join(str(v) for v in r["threads"]), r["num_violations"],
             "yes" if all(r["checks"].values()) else "NO: " + ", ".join(k for k, v in r["checks"].items() if not v)]
            for r in results]
    print(tabulate(rows, headers=["mode", "steps", "ms/step", "budget", "evictions/step", "RSS after warm-up -> end",
                                  "RSS growth", "RSS slope /1000 steps", "resident chunks", "Python objects",
                                  "threads", "stat violations", "flat"], tablefmt=fmt))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(steps=steps, results=results), indent=1))
    return 0 if all(all(r["checks"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
