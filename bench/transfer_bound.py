"""Where does each mode become transfer-bound? Batch size against the link, at a tight budget.

For a GPT of ``bench/compare.py`` (L2 d128 by default), at batch sizes 1 to 64 (sequence 128) and a
tight budget for each (that batch's minimum + 2 chunks, the chunk size of an unbudgeted probe, as
compare.py does), hooks mode and compiled mode (Inductor; ``--eager``: the eager backend) train
with no link, with the emulated 100 MB/s link and with the ``v100`` preset (a link as slow,
relative to this machine's measured matmul rate, as a V100's PCIe 3 link is to a V100;
calibrated once, here). Per row:

- step s: median step time after warm-up; bytes moved per step;
- link s: the busier direction's bytes over the link rate, the time the copies take if nothing
  else runs (a copy engine per direction, as on full-duplex PCIe, so the two directions overlap);
- slowdown: step s with the link over step s without it, same mode and batch; **transfer-bound**:
  a slowdown of at least ``BOUND`` (1.5: a third of the step or more waits for copies that compute
  does not hide);
- step / bound: step s over max(the same mode's step with no link, link s), the physical bound;
  step / dep. bound: over the larger of that and the no-link forward plus the chunk bytes sent to
  the host over the rate (no gradient leaves the device before the forward is done).

Each configuration runs its steps alone, one after the other, not interleaved: a step returns while
the next step's fetches may still be landing (``plan_lookahead``), and those copies would run during
another engine's step, a link time the step gets for free. A larger batch does more compute per
chunk read, but at a tight budget it also leaves less room for chunks (activations grow with the
batch), so the bytes moved grow too; the table shows which wins.

    python bench/transfer_bound.py [--quick] [--markdown] [--eager] [--overlap-update] [--size L,D]
                                   [--batches 1,2,4,8,16,32,64] [--out bench/results/transfer_bound.json]

Float32, one torch thread.
"""

from __future__ import annotations

import sys

import torch

import pscompile
from compare import batches, probe, run_engine, tight    # (the same models and data as bench/compare.py)
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import gpt
from pscompile.memory.rates import calibrated_link

BOUND = 1.5
FULL = dict(size=(2, 128), vocab=4096, seq=128, batches=(1, 2, 4, 8, 16, 32, 64), warmup=2, steps=5)
QUICK = dict(size=(2, 64), vocab=512, seq=64, batches=(1, 4), warmup=1, steps=2)


def main(argv=None) -> int:
    ap = parser(__doc__, "transfer_bound", markdown=True)
    ap.add_argument("--eager", action="store_true", help="compiled mode with backend='eager' instead of Inductor")
    ap.add_argument("--size", default=None, help="L,D: layers and width of the GPT (default: the settings')")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the settings')")
    ap.add_argument("--overlap-update", action="store_true",
                    help="add compiled mode with Config(overlap_update=True) (chunks updated in the backward)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = dict(QUICK if args.quick else FULL)
    if args.size:
        s["size"] = tuple(int(x) for x in args.size.split(","))
    if args.batches:
        s["batches"] = tuple(int(x) for x in args.batches.split(","))
    v100 = calibrated_link("v100", "cpu", torch.float32)
    links = [("none", None), ("100MB/s", 100e6), (f"v100 {v100 / 1e6:.1f}MB/s", v100)]
    backend = "eager" if args.eager or args.quick else "inductor"
    systems = [("hooks", dict(mode="hooks")), (f"compiled {backend}", dict(mode="compiled", backend=backend))]
    if args.overlap_update:
        systems.append((f"compiled {backend} overlap_update",
                        dict(mode="compiled", backend=backend, overlap_update=True)))

    def model():
        return gpt(*s["size"], s["vocab"], s["seq"])
    raw = []
    for bs in s["batches"]:
        data = batches(s, 1 + s["warmup"] + s["steps"], batch=bs)
        minimum, chunk, _ = probe(model(), data[0])          # (that batch's minimum, an unbudgeted chunk size)
        budget = tight(minimum, chunk)
        for sname, kw in systems:
            base = None
            for lname, rate in links:
                cfg = cpu_config(device_memory=budget, chunk_size=chunk, link_bandwidth=rate, **kw)
                r = run_engine(lambda: pscompile.compile(model(), data[0], config=cfg), data, s["warmup"])
                assert r["peak"] <= budget, (sname, bs, lname, r["peak"], budget)
                base = base or r
                r.update(batch=bs, system=sname, link=lname, rate=rate, budget=budget,
                         link_s=max(r["h2d"], r["d2h"]) / rate if rate else 0.0, slowdown=r["step_s"] / base["step_s"])
                r["bound_s"] = max(base["step_s"], r["link_s"])     # the step with no link, or the link busy
                r["of_bound"] = r["step_s"] / r["bound_s"]
                # gradients leave only once the forward is done: no chunk is dirty before the backward
                r["dep_bound_s"] = max(r["bound_s"], base["forward_s"] + r["chunk_d2h"] / rate if rate else 0.0)
                r["of_dep_bound"] = r["step_s"] / r["dep_bound_s"]
                r["transfer_bound"] = rate is not None and r["slowdown"] >= BOUND
                raw.append(r)
    rows = [[r["batch"], r["system"], r["link"], f"{r['budget'] / 2**20:.1f}", f"{r['moved'] / 2**20:.2f}",
             f"{r['step_s']:.3f}", f"{r['link_s']:.3f}", f"{r['slowdown']:.2f}", f"{r['of_bound']:.2f}",
             f"{r['dep_bound_s']:.3f}", f"{r['of_dep_bound']:.2f}",
             "yes" if r["transfer_bound"] else ("-" if r["rate"] is None else "no")] for r in raw]
    headers = ["batch", "system", "link", "budget MiB", "MiB moved", "step s", "link s", "slowdown", "step / bound",
               "dep. bound s", "step / dep. bound", "transfer-bound"]
    L, D = s["size"]
    print(f"GPT L{L} d{D}, sequence {s['seq']}, float32, one thread; tight budget = that batch's minimum + 2 "
          f"chunks; step = median of {s['steps']} steps after {s['warmup']} warm-up; link s = the busier direction's "
          f"bytes / link rate; slowdown = step with the link / without; transfer-bound: slowdown >= {BOUND}\n")
    print(table(rows, headers, markdown=args.markdown))
    summary = []
    for sname, _ in systems:
        for lname, rate in links[1:]:
            mine = [r for r in raw if r["system"] == sname and r["link"] == lname]
            bound = [r["batch"] for r in mine if r["transfer_bound"]]
            free = [r["batch"] for r in mine if not r["transfer_bound"]]
            summary.append(f"{sname} at {lname}: transfer-bound at batch {bound or 'none'}, not at {free or 'none'}")
    print("\n" + "\n".join(("- " if args.markdown else "") + line for line in summary))
    write_json(args.out, dict(settings={k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                              bound=BOUND, rows=raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
