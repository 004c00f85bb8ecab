"""Compare execution modes on GPT: plain PyTorch, plain torch.compile, hooks, compiled.

For each GPT size and device budget, in one run with the same data and seed:

- plain PyTorch eager and plain ``torch.compile`` (no budget: everything on the device);
- pscompile hooks mode, compiled mode with ``backend="eager"`` and, when available, ``"inductor"``;
- with and without the emulated device<->host link (``link_bandwidth``), which makes every byte
  moved cost wall time as it would over PCIe, so prefetch/overlap shows up in step time.

Reported per row: compile time (engine construction + the first, measuring step), step time
(median of N steps after warm-up), peak device bytes (measured), bytes moved per step, and the
ratio of bytes moved to a lower bound: the fewest fetch bytes any schedule can have for that access
order and capacity (Belady, as planned) plus the gradient bytes that must reach the host for the
host-side update.

    python bench/compare.py [--quick] [--markdown] [--out bench/results/compare.json]

Float32, one torch thread (see bench/foundation.py for why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer
from pscompile.memory.tiers import Tier
from pscompile.units import format_bytes

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compare.json"

FULL = dict(sizes=[(2, 128), (4, 256)], vocab=4096, seq=128, batch=4, warmup=2, steps=5,
            link="100MB/s")
QUICK = dict(sizes=[(2, 64)], vocab=512, seq=64, batch=2, warmup=1, steps=2, link="50MB/s")


def make_model(n_layer: int, d: int, s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, d // 64), d_model=d, vocab_size=s["vocab"],
                         seq_len=s["seq"]))


def batches(s: dict, n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(n)]


def lower_bound(engine) -> int:
    """Bytes any schedule must move per step for this access order and budget (see module doc)."""
    plan = engine.last_plan
    elsize = torch.empty((), dtype=engine.dtype).element_size()
    host_grads = sum(e.numel * elsize for e in engine.layout.entries
                     if engine.store.os_tier[e.pieces[0].chunk] is Tier.HOST)
    return plan.h2d_bytes + host_grads


def run_engine(make, data, s) -> dict:
    t0 = time.perf_counter()
    engine = make()
    engine.step(data[0])                      # compiled mode measures non-model memory here
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for i, b in enumerate(data[1:]):
        losses.append(engine.step(b))
        if i >= s["warmup"] - 1:
            times.append(engine.stats.time_s)
    st = engine.stats
    row = dict(compile_s=compile_s, step_s=statistics.median(times), peak=st.peak_device_bytes,
               moved=st.bytes_moved, transfer_s=st.transfer_s, losses=losses, engine=engine)
    return row


def run_plain(model, data, s, compiled: bool) -> dict:
    t0 = time.perf_counter()
    trainer = ReferenceTrainer(model, optimizer=pscompile.AdamW(lr=1e-3), dtype=torch.float32)
    if compiled:
        trainer.model = torch.compile(trainer.model)
    trainer.step(data[0])
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for i, b in enumerate(data[1:]):
        t = time.perf_counter()
        losses.append(trainer.step(b))
        if i >= s["warmup"] - 1:
            times.append(time.perf_counter() - t)
    return dict(compile_s=compile_s, step_s=statistics.median(times), peak=None, moved=0, transfer_s=0.0,
                losses=losses)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--inductor", action="store_true", help="also run compiled mode with backend='inductor'")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    data = batches(s, 1 + s["warmup"] + s["steps"])
    rows, raw = [], []
    for n_layer, d in s["sizes"]:
        params = make_model(n_layer, d, s).config.num_params()
        ref_rows = {}
        for name, compiled in (("plain PyTorch", False), ("plain torch.compile", True)):
            r = run_plain(make_model(n_layer, d, s), data, s, compiled)
            ref_rows[name] = r
            rows.append([f"L{n_layer} d{d}", f"{params / 1e6:.1f}M", name, "-", "-", f"{r['compile_s']:.1f}",
                         f"{r['step_s']:.3f}", "-", "-", "-", "-"])
            raw.append(dict(size=[n_layer, d], system=name, **{k: v for k, v in r.items()}))
        base = ref_rows["plain PyTorch"]
        probe = pscompile.compile(make_model(n_layer, d, s), data[0], config=pscompile.Config(
            mode="compiled", backend="eager", device="cpu", dtype=torch.float32))
        probe.step(data[0])
        minimum, chunk = probe.min_device_memory, probe.layout.chunk_size
        everything = probe.stats.peak_device_bytes
        probe.close()
        budgets = [("tight", minimum + 2 * chunk * 4), ("mid", (minimum + everything) // 2)]
        systems = [("hooks", dict(mode="hooks")), ("compiled eager", dict(mode="compiled", backend="eager"))]
        if args.inductor:
            systems.append(("compiled inductor", dict(mode="compiled", backend="inductor")))
        for bname, budget in budgets:
            for link in (None, s["link"]):
                for sname, kw in systems:
                    cfg = pscompile.Config(device="cpu", dtype=torch.float32, device_memory=budget,
                                           chunk_size=chunk, link_bandwidth=link, **kw)
                    try:
                        r = run_engine(lambda: pscompile.compile(make_model(n_layer, d, s), data[0], config=cfg),
                                       data, s)
                    except (ValueError, NotImplementedError) as e:
                        rows.append([f"L{n_layer} d{d}", "", sname, bname, link or "-", "-", "-", "-", "-", "-",
                                     f"error: {str(e)[:60]}"])
                        continue
                    engine = r.pop("engine")
                    lb = lower_bound(engine) if hasattr(engine, "last_plan") else None
                    dloss = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
                    rows.append([f"L{n_layer} d{d}", "", sname, f"{bname} {format_bytes(budget)}", link or "-",
                                 f"{r['compile_s']:.1f}", f"{r['step_s']:.3f}",
                                 f"{r['step_s'] / base['step_s']:.2f}", f"{r['peak'] / MiB:.1f}",
                                 f"{r['moved'] / MiB:.2f}", f"{dloss:.1e}"])
                    raw.append(dict(size=[n_layer, d], system=sname, budget=budget, link=link, lower_bound=lb,
                                    max_dloss=dloss, **r))
                    engine.close()
        # the lower bound is a property of the (budget, layout, access order): report it per budget
    headers = ["model", "params", "system", "budget", "link", "compile s", "step s", "step / plain",
               "peak MiB", "MiB moved", "max |dloss|"]
    caption = ("GPT, float32, one thread; step = median of steps after warm-up; compile = engine construction + "
               "first (measuring) step; |dloss| = max loss difference vs plain PyTorch")
    print(caption)
    print(tabulate(rows, headers=headers))
    lbs = {(tuple(r["size"]), r["budget"]): r["lower_bound"] for r in raw if r.get("lower_bound")}
    bounds = []
    for r in raw:
        if "budget" not in r or r["link"] is not None:
            continue
        lb = lbs.get((tuple(r["size"]), r["budget"]))
        bounds.append([f"L{r['size'][0]} d{r['size'][1]}", r["system"], format_bytes(r["budget"]),
                       f"{r['moved'] / MiB:.2f}", f"{lb / MiB:.2f}" if lb else "-",
                       f"{r['moved'] / lb:.2f}" if lb else "-"])
    bcaption = ("bytes moved per step vs a lower bound: Belady's fetches for this access order and capacity "
                "+ the gradient bytes the host-side update needs")
    print("\n" + bcaption)
    bheaders = ["model", "system", "budget", "MiB moved", "lower bound MiB", "moved / bound"]
    print(tabulate(bounds, headers=bheaders))
    if args.markdown:
        print("\n" + caption + "\n")
        print(tabulate(rows, headers=headers, tablefmt="github"))
        print("\n" + bcaption + "\n")
        print(tabulate(bounds, headers=bheaders, tablefmt="github"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, rows=raw), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
