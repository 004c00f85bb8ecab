"""Activations: keep, recompute or offload, and what "auto" picks, by the budget and the link.

One GPT with dropout, under a budget that keeping every saved activation does not fit, trains in
compiled mode with each activation policy (and keep with no budget, for reference) over links of
three speeds (this machine's memcpy and the emulated ``link_bandwidth``), interleaved by link in
one process. Per row: what the plan chose, the step time (median after the measuring step), the
peak device bytes, and the activation and chunk bytes each step moved (docs/activations.md).

    python bench/activations.py [--quick] [--markdown] [--out bench/results/activations.json]

The eager backend (Inductor cuts its regions at every offload and reload), float32, one thread.
"""

from __future__ import annotations

import sys
import time

import torch

import pscompile
from harness.host import meta
from harness.output import parser, table, write_json
from harness.runs import cpu_config, median_after
from harness.specs import gpt_of, token_batches
from pscompile.passes.recompute_activations import ActivationPlan

MiB = 2**20
POLICIES = ("keep", "recompute", "offload", "auto")
FULL = dict(layers=4, d=256, vocab=1024, seq=256, batch=4, steps=5, links=(None, "2GB/s", "200MB/s"), budget_at=0.25)
QUICK = dict(layers=2, d=64, vocab=256, seq=64, batch=2, steps=2, links=(None, "200MB/s"), budget_at=0.25)


def model_and_batches(p: dict, n: int):
    return gpt_of(p, dropout=0.1), token_batches(p["vocab"], p["batch"], p["seq"], n)


def config(policy: str, budget: int | None = None, link: str | None = None) -> pscompile.Config:
    return cpu_config(device_memory=budget, activations=policy, link_bandwidth=link)


def run(p: dict, policy: str, budget: int, link: str | None) -> dict:
    model, batches = model_and_batches(p, p["steps"])
    row = dict(policy=policy if budget is not None else f"{policy} (no budget)", link=link or "memcpy", budget=budget)
    try:
        engine = pscompile.compile(model, batches[0], config=config(policy, budget, link))
    except pscompile.BudgetError as e:
        return row | dict(ok=False, error=f"BudgetError: {str(e)[:120]}")
    stats = []
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)              # (the same dropout masks for every policy)
        engine.step(b)
        stats.append(engine.stats)
    s, peak = stats[-1], max(x.peak_device_bytes for x in stats)
    plan = engine.schedule.scheduled.activations       # None: "keep" (nothing chosen)
    engine.close()
    chose = plan.describe().split(": ", 1)[1] if plan is not None else "every saved activation kept"
    if plan is None:
        plan = ActivationPlan(policy, ())
    return row | dict(
        ok=True, step_s=median_after(stats, "time_s") if len(stats) > 1 else s.time_s, peak=peak,
        within_budget=budget is None or peak <= budget, offload_bytes=s.offload_bytes,
        reload_bytes=s.reload_bytes,
        chunk_bytes=s.h2d_bytes + s.d2h_bytes - s.offload_bytes - s.reload_bytes, transfer_s=s.transfer_s,
        recomputed=len(plan.recomputed), offloaded=len(plan.offloaded), segments=len(plan.segments),
        overlapped=plan.overlapped, chose=chose, rates=engine.rates.describe())


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, "activations", quick="a tiny model, two links (a smoke run)", markdown=True).parse_args(argv)
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
    cells = []
    for r in rows:
        ref = next(x for x in rows if x["link"] == r["link"] and x["policy"] == "recompute")
        if not r["ok"]:
            cells.append([r["link"], r["policy"], "NO", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        cells.append([r["link"], r["policy"], "yes", f"{r['step_s']:.3f}",
                      f"{r['step_s'] / ref['step_s']:.2f}" if ref["ok"] else "-", f"{r['peak'] / MiB:.2f}",
                      f"{r['offload_bytes'] / MiB:.2f}", f"{r['chunk_bytes'] / MiB:.2f}", r["chose"]])
    print(table(cells, ["link", "policy", "trains", "step s", "vs recompute", "peak MiB",
                        "activations out (= back) MiB", "chunk MiB moved", "plan"], markdown=args.markdown))
    print("\nleast budget per policy (MiB): " + ", ".join(f"{k} {v / MiB:.2f}" for k, v in least.items())
          + f"; rates measured: {next((r['rates'] for r in rows if r['ok']), '-')}")
    write_json(args.out, dict(params=p, least=least, budget=budget, rows=rows, seconds=time.perf_counter() - t0,
                              meta=meta()))
    return 1 if any(r["ok"] and not r["within_budget"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
