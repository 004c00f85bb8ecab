"""Pages in compiled mode: bytes moved per step against hooks mode and the Belady lower bound, and
how ``chunk_size="auto"`` chooses.

Two tables, GPT models, float32, one thread, one run:

1. **Same model, same budget, default settings.** For each model and two budgets (tight: 10% above
   the larger of the two modes' minima; mid: 1.5x it), hooks mode and compiled mode (eager backend)
   with ``chunk_size="auto"`` train ``--steps`` steps; the row shows the chunk size each picked, how
   many tensors span chunks, the bytes moved in the last step (at least the third: compiled mode's
   second step runs its cold plan and also fetches the third's first chunks), compiled / hooks, and compiled mode's
   bytes against the lower bound of ``bench/compare.py`` (Belady's fewest whole-chunk fetches for its
   access sequence and capacities + the gradient bytes the host-side update needs), computed for the
   layout it ran. The row "compiled, whole tensors" runs the layout compiled mode had to use before
   pages (chunk >= the largest tensor) at the same budget.
2. **Why the default.** For one model at the tight and mid budgets, compiled mode's static plan (no
   training: ``pipeline.BudgetSweep``-style planning on one capture) for several chunk sizes: the
   candidates "auto" weighs (``pipeline.layout_candidates``: the least-waste paged sizes with chunks
   of at most 1/8, 1/16 and 1/32 of the budget, and the whole-tensor size) and twice the first. Shown:
   the least budget of each layout, its padding, and the bytes its plan moves per step ("-": it does
   not fit). "auto" plans every candidate and keeps the one that moves the fewest bytes.

    python bench/pages.py [--quick] [--markdown] [--out bench/results/pages.json]
"""

from __future__ import annotations

import sys

import torch

import pscompile
from compare import lower_bound
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import gpt, token_batches
from pscompile.graph.pipeline import (PlanRequest, capture_and_analyze, config_least, gather_bytes,
                                      layout_candidates, plan_at_budget, regather)
from pscompile.memory.layout import build_layout
from pscompile.runtime.batching import call_model
from pscompile.runtime.params import choose_layout, collect_params
from pscompile.units import format_bytes

MiB = 2**20
# (name, n_layer, d_model, vocab): the GPT of the issue (a 512 x 192 embedding) and bench/compare's sizes
FULL = dict(models=[("L2 d192 v512", 2, 192, 512), ("L2 d128 v4096", 2, 128, 4096), ("L4 d256 v4096", 4, 256, 4096)],
            seq=128, batch=4, steps=3)
QUICK = dict(models=[("L2 d192 v512", 2, 192, 512)], seq=32, batch=2, steps=3)


def config(mode: str, budget: int | None, chunk_size="auto") -> pscompile.Config:
    return cpu_config(mode, device_memory=budget, chunk_size=chunk_size)


def train(make, data, cfg: pscompile.Config) -> dict:
    engine = pscompile.compile(make(), data[0], config=cfg)
    try:
        for b in data:
            engine.step(b)
        st = engine.stats
        row = dict(chunk=engine.layout.chunk_size, spans=sum(e.spans for e in engine.layout.entries),
                   moved=st.bytes_moved, peak=st.peak_device_bytes, within=st.peak_device_bytes <= cfg.device_memory)
        if cfg.mode == "compiled":
            row["bound"] = lower_bound(engine).nbytes
            row["planned"] = engine.last_plan.h2d_bytes + engine.last_plan.d2h_bytes
        return row
    finally:
        engine.close()


def same_budget_rows(s: dict) -> tuple[list[list], list[dict]]:
    rows, raw = [], []
    for name, n_layer, d, vocab in s["models"]:
        data = token_batches(vocab, s["batch"], s["seq"], s["steps"], seed=1)

        def make():
            return gpt(n_layer, d, vocab, s["seq"])
        minima = {m: pscompile.min_device_memory(make(), data[0], config(m, None)) for m in ("compiled", "hooks")}
        base = int(1.1 * max(minima.values()))
        mp = collect_params(make(), call_model, data[0])
        whole = choose_layout(mp, config("compiled", None), None, pages=False).chunk_size
        for bname, budget in (("tight", base), ("mid", int(1.5 * base))):
            got = {}
            for system, cfg in (("hooks", config("hooks", budget)), ("compiled", config("compiled", budget)),
                                ("compiled, whole tensors", config("compiled", budget, whole))):
                try:
                    got[system] = r = train(make, data, cfg)
                except Exception as e:          # noqa: BLE001 - recorded; the script exits 1
                    got[system] = r = dict(error=f"{type(e).__name__}: {e}")
                raw.append(dict(model=name, budget=budget, budget_name=bname, system=system, minima=minima, **r))
            h = got["hooks"].get("moved")
            for system, r in got.items():
                if "error" in r:
                    rows.append([name, f"{bname} {format_bytes(budget)}", system, f"error: {r['error'][:60]}"]
                                + ["-"] * 5)
                    continue
                rows.append([name, f"{bname} {format_bytes(budget)}", system, f"{r['chunk']:,}", r["spans"],
                             f"{r['moved'] / MiB:.2f}", f"{r['moved'] / h:.3f}" if h else "-",
                             f"{r['moved'] / r['bound']:.3f}" if r.get("bound") else "-",
                             "yes" if r["within"] else "NO"])
    return rows, raw


def chunk_size_rows(s: dict) -> tuple[list[list], list[dict]]:
    name, n_layer, d, vocab = s["models"][0]
    data = token_batches(vocab, s["batch"], s["seq"], 1, seed=1)
    model = gpt(n_layer, d, vocab, s["seq"])
    cfg = config("compiled", None)
    mp = collect_params(model, call_model, data[0])
    analyzed = capture_and_analyze(model, data[0], params=mp.params, dtype=torch.float32)
    minimum = pscompile.min_device_memory(gpt(n_layer, d, vocab, s["seq"]), data[0], cfg)
    rows, raw = [], []
    for bname, budget in (("tight", int(1.1 * minimum)), ("mid", int(1.65 * minimum))):
        candidates = [x.chunk_size for x in layout_candidates(mp, config("compiled", budget), budget)]
        whole = choose_layout(mp, cfg, budget, pages=False).chunk_size
        engine = pscompile.compile(gpt(n_layer, d, vocab, s["seq"]), data[0], config=config("compiled", budget))
        picked = engine.layout.chunk_size
        engine.close()
        paged = choose_layout(mp, cfg, budget).chunk_size
        sizes = sorted(set(candidates) | {2 * paged})
        for cs in sizes:
            layout = build_layout(((f, tuple(p.shape)) for f, p in mp.params.items()), cs, mp.aliases)
            a = regather(analyzed, gather_bytes(layout, torch.float32))
            least = config_least(a, layout, cfg)
            moved = None
            if least <= budget:
                request = PlanRequest(budget=budget, dtype=torch.float32, activations=cfg.activations)
                sched = plan_at_budget(a, layout, request)
                moved = sched.plan.h2d_bytes + sched.plan.d2h_bytes + 2 * sched.offload_bytes
            what = ("picked" if cs == picked else "candidate" if cs in candidates else "-") + \
                (" (whole)" if cs == whole else "")
            raw.append(dict(model=name, budget=budget, chunk=cs, least=least, moved=moved,
                            utilisation=layout.utilisation, spans=sum(e.spans for e in layout.entries), what=what))
            rows.append([name, f"{bname} {format_bytes(budget)}", f"{cs:,}", what,
                         sum(e.spans for e in layout.entries), f"{layout.utilisation:.1%}", format_bytes(least),
                         f"{moved / MiB:.2f}" if moved is not None else "-"])
    return rows, raw


def main(argv=None) -> int:
    args = parser(__doc__, "pages", markdown=True).parse_args(argv)
    torch.set_num_threads(1)
    s = QUICK if args.quick else FULL
    rows, raw = same_budget_rows(s)
    crows, craw = chunk_size_rows(s)
    print("same model, same budget, chunk_size='auto' (bytes moved in the last step)\n")
    print(table(rows, ["model", "budget", "system", "chunk", "spanning", "MiB moved", "/ hooks", "/ Belady bound",
                       "within budget"], markdown=args.markdown))
    print("\ncompiled mode's static plan per chunk size\n")
    print(table(crows, ["model", "budget", "chunk", "chosen by", "spanning", "utilised", "least budget",
                        "planned MiB/step"], markdown=args.markdown))
    failed = [r for r in raw if "error" in r or not r.get("within", True)
              or (r["system"] == "compiled" and r.get("bound") and r["moved"] < r["bound"])]
    for r in failed:
        print(f"FAILED {r['model']} {r['budget_name']} {r['system']}: {r.get('error') or r}")
    write_json(args.out, dict(settings=s, rows=raw, chunk_sizes=craw, failed=len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
