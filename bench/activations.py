"""Activations: keep, recompute or offload, and what "auto" picks, by the budget and the link.

One GPT with dropout under one device budget that keeping every saved activation does not fit,
trained in compiled mode with each activation policy (and, for reference, keeping everything with
no budget), over links of three speeds (this machine's
memcpy, and the emulated ``link_bandwidth``). Per row: the policy's least budget, what the plan
chose, the measured step time (median of the steps after the measuring one), the peak device bytes,
and the activation and chunk bytes each step moved, which the engine checks against the plan. All
in one process, interleaved by link, so the times compare as ratios within a link.

    python bench/activations.py [--quick] [--markdown] [--out bench/results/activations.json]

Compiled mode runs the eager backend (Inductor cuts its regions at every offload and reload, and its
compile time would dominate a run this short); float32, one thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.passes.recompute_activations import ActivationPlan

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "activations.json"
POLICIES = ("keep", "recompute", "offload", "auto")
FULL = dict(layers=4, d=256, heads=4, vocab=1024, seq=256, batch=4, steps=5, links=(None, "2GB/s", "200MB/s"),
            budget_at=0.25)
QUICK = dict(layers=2, d=64, heads=2, vocab=256, seq=64, batch=2, steps=2, links=(None, "200MB/s"), budget_at=0.25)


def model_and_batches(p: dict, n: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=p["layers"], n_head=p["heads"], d_model=p["d"], vocab_size=p["vocab"],
                          seq_len=p["seq"], dropout=0.1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, p["vocab"], (p["batch"], p["seq"]), generator=g),
                torch.randint(0, p["vocab"], (p["batch"], p["seq"]), generator=g)) for _ in range(n)]
    return model, batches


def config(policy: str, budget: int | None = None, link: str | None = None) -> pscompile.Config:
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=budget, activations=policy, link_bandwidth=link)


def run(p: dict, policy: str, budget: int, link: str | None) -> dict:
    model, batches = model_and_batches(p, p["steps"])
    row = dict(policy=policy if budget is not None else f"{policy} (no budget)", link=link or "memcpy", budget=budget)
    try:
        engine = pscompile.compile(model, batches[0], config=config(policy, budget, link))
    except pscompile.BudgetError as e:
        return row | dict(ok=False, error=f"BudgetError: {str(e)[:120]}")
    times, peaks = [], []
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        engine.step(b)
        s = engine.stats
        peaks.append(s.peak_device_bytes)
        if i:
            times.append(s.time_s)
    s = engine.stats
    plan = engine.schedule.scheduled.activations       # None: "keep" (nothing chosen)
    engine.close()
    chose = plan.describe().split(": ", 1)[1] if plan is not None else "every saved activation kept"
    if plan is None:
        plan = ActivationPlan(policy, ())
    return row | dict(
        ok=True, step_s=statistics.median(times) if times else s.time_s, peak=max(peaks),
        within_budget=budget is None or max(peaks) <= budget, offload_bytes=s.offload_bytes, reload_bytes=s.reload_bytes,
        chunk_bytes=s.h2d_bytes + s.d2h_bytes - s.offload_bytes - s.reload_bytes, transfer_s=s.transfer_s,
        recomputed=len(plan.recomputed), offloaded=len(plan.offloaded), segments=len(plan.segments),
        overlapped=plan.overlapped, chose=chose, rates=engine.rates.describe())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, two links (a smoke run)")
    ap.add_argument("--markdown", action="store_true", help="print GitHub tables")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    p = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    model, batches = model_and_batches(p, 1)
    least = {pol: pscompile.min_device_memory(model, batches[0], config(pol)) for pol in POLICIES}
    budget = int(least["auto"] + p["budget_at"] * (least["keep"] - least["auto"]))
    print(f"GPT L{p['layers']} d{p['d']} vocab {p['vocab']}, batch {p['batch']} x {p['seq']}, dropout 0.1; "
          f"least budgets (MiB): " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in least.items())
          + f"; device_memory {budget / MiB:.2f} MiB", flush=True)
    rows = []
    for link in p["links"]:
        for policy, b in (("keep", None), *((pol, budget) for pol in POLICIES)):
            r = run(p, policy, b, link)
            rows.append(r)
            print(f"  {r['link']:>8} {r['policy']:18s} " + (f"{r['step_s']:.3f} s/step, {r['chose']}" if r["ok"]
                                                     else r["error"]), flush=True)
    fmt = "github" if args.markdown else "simple"
    table = []
    for r in rows:
        keep = next(x for x in rows if x["link"] == r["link"] and x["policy"] == "recompute")
        table.append([
            r["link"], r["policy"], "yes" if r["ok"] else "NO",
            f"{r['step_s']:.3f}" if r["ok"] else "-",
            f"{r['step_s'] / keep['step_s']:.2f}" if r["ok"] and keep["ok"] else "-",
            f"{r['peak'] / MiB:.2f}" if r["ok"] else "-",
            f"{r['offload_bytes'] / MiB:.2f}" if r["ok"] else "-",
            f"{r['chunk_bytes'] / MiB:.2f}" if r["ok"] else "-",
            r["chose"] if r["ok"] else r["error"][:60]])
    print(tabulate(table, headers=["link", "policy", "trains", "step s", "vs recompute", "peak MiB",
                                   "activations out (= back) MiB", "chunk MiB moved", "plan"], tablefmt=fmt))
    print("\nleast budget per policy (MiB): " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in least.items())
          + f"; rates measured: {next((r['rates'] for r in rows if r['ok']), '-')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(params=p, least=least, budget=budget, rows=rows, seconds=time.perf_counter() - t0,
                                        torch=torch.__version__, python=platform.python_version(),
                                        date=time.strftime("%Y-%m-%d")), indent=1, default=str))
    failed = [r for r in rows if r["ok"] and not r["within_budget"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
