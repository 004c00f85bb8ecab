"""Two residency planners on the same graphs: Belady (the default) against ANGEL-PTM's unified
scheduler (``Config(planner="angel")``, Algorithm 1 of the ANGEL-PTM paper; docs/design.md).

For each architecture of ``pscompile.testing.ARCHITECTURES`` (the Hugging Face ones need
transformers), one capture, and budgets from the minimum to twice it: the schedule each planner
makes with the layout the engine picks (verified, as the engine does), its bytes moved per step,
its fetches, and how many nodes ahead of their readers its fetches start. Planning only, so the
numbers repeat run to run; step times are ``bench/compare.py --planners belady,angel``.

    python bench/planners.py [--quick] [--markdown] [--arch NAME ...] [--out bench/results/planners.json]

``--quick``: "gpt" and "bert" only, three budgets. Float32.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from pscompile.graph.pipeline import BudgetSweep
from pscompile.kinds import MemKind
from pscompile.testing import ARCHITECTURES, HF_ARCHITECTURES, tiny_model

HAVE_HF = importlib.util.find_spec("transformers") is not None
PLANNERS = ("belady", "angel")
FACTORS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0)      # budgets, as multiples of the minimum
QUICK_FACTORS = (1.0, 1.25, 2.0)


def lead(plan) -> float:
    """Nodes between a fetch's issue and its first reader, averaged over the plan's fetches: an
    asynchronous fetch is read after its ``wait``, a synchronous one right after it (0)."""
    issued, gaps = {}, []
    for a in plan.actions:
        if a.kind is MemKind.FETCH:
            if a.asynchronous:
                issued[(a.chunk, a.slot)] = a.before
            else:
                gaps.append(0)
        elif a.kind is MemKind.WAIT and (a.chunk, a.slot) in issued:
            gaps.append(a.before - issued.pop((a.chunk, a.slot)))
    return statistics.fmean(gaps) if gaps else 0.0


def sweep(arch: str, factors) -> list[dict]:
    model, batch = tiny_model(arch)
    rows = []
    sweeps = {planner: BudgetSweep(model, batch, cpu_config(planner=planner)) for planner in PLANNERS}
    minimum = pscompile.min_device_memory(model, batch, cpu_config())
    for f in factors:
        budget = int(minimum * f)
        row = dict(arch=arch, factor=f, budget=budget)
        for planner, s in sweeps.items():
            plan = s.plan(budget).plan          # verify_schedule runs inside: a broken schedule raises
            assert plan.peak_device_bytes <= budget, (arch, planner, budget)
            row[planner] = dict(moved=plan.h2d_bytes + plan.d2h_bytes, fetches=plan.num_fetches,
                                evictions=plan.num_evictions, lead=lead(plan), chunk=s.layout(budget).chunk_size)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = parser(__doc__, "planners", quick='"gpt" and "bert" only, three budgets', markdown=True)
    ap.add_argument("--arch", nargs="*", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    archs = args.arch or (["gpt", "bert"] if args.quick else
                          [a for a in ARCHITECTURES if HAVE_HF or a not in HF_ARCHITECTURES])
    factors = QUICK_FACTORS if args.quick else FACTORS
    raw = [r for a in archs for r in sweep(a, factors)]
    rows = []
    for r in raw:
        b, a = r["belady"], r["angel"]
        rows.append([r["arch"], f"{r['factor']:.2f}x", f"{r['budget'] / 2**10:.0f}",
                     f"{b['moved'] / 2**10:.0f}", f"{a['moved'] / 2**10:.0f}", f"{a['moved'] / b['moved']:.3f}"
                     if b["moved"] else "-", b["fetches"], a["fetches"], f"{b['lead']:.1f}", f"{a['lead']:.1f}"])
    ratios = [r["angel"]["moved"] / r["belady"]["moved"] for r in raw if r["belady"]["moved"]]
    print("bytes moved per training step (fetches + writebacks + gradients to the host), planned at each "
          "budget with the layout the engine picks; lead = nodes between a fetch's issue and its first "
          "reader, on average")
    print(table(rows, ["model", "budget / min", "budget KiB", "belady KiB moved", "angel KiB moved", "angel / belady",
                       "belady fetches", "angel fetches", "belady lead", "angel lead"], markdown=args.markdown))
    print(f"angel / belady bytes moved: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"max {max(ratios):.3f} over {len(ratios)} budgets")
    per_model = []
    for arch in archs:
        rs = [r for r in raw if r["arch"] == arch]
        q = [r["angel"]["moved"] / r["belady"]["moved"] for r in rs]
        per_model.append([arch, len(rs), f"{min(q):.3f}", f"{statistics.median(q):.3f}", f"{max(q):.3f}",
                          f"{statistics.fmean(r['belady']['lead'] for r in rs):.1f}",
                          f"{statistics.fmean(r['angel']['lead'] for r in rs):.1f}"])
    print("\nper model (budgets " + ", ".join(f"{f}x" for f in factors) + " the minimum)")
    print(table(per_model, ["model", "budgets", "angel / belady moved: min", "median", "max", "belady lead",
                            "angel lead"], markdown=args.markdown))
    worse = [r for r in raw if r["belady"]["moved"] > r["angel"]["moved"]]
    write_json(args.out, dict(rows=raw, belady_moves_more=len(worse)))
    for r in worse:        # not a failure: reported, since the default is the planner that moves less
        print(f"note: belady moves more than angel for {r['arch']} at {r['factor']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
