"""The optimizer update overlapped with the backward (``Config.overlap_update``), against after it.

Two compiled-mode engines train the same GPT on the same batches under the same budget (its
minimum + 2 chunks), with ``overlap_update`` True and False, their steps alternating (the order
flipped every step) after warm-up. Per engine: the median step, backward and optimizer times and
the chunks updated in the backward; the losses must agree bit for bit. A small batch (1 x 64
tokens) makes the update matter; here the CPU runs the backward, so the update thread takes the
second core (docs/host-optimizer.md).

    python bench/overlap_update.py [--quick] [--markdown] [--size L,D] [--batch B] [--seq T]
                                   [--steps 20] [--out bench/results/overlap_update.json]

bfloat16 and float32 compute, the eager backend, one torch thread.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config, median_after
from harness.specs import adamw, gpt, token_batches

FULL = dict(size=(4, 768), batch=1, seq=64, vocab=8192, warmup=3, steps=20, dtypes=("bfloat16", "float32"))
QUICK = dict(size=(2, 128), batch=1, seq=32, vocab=512, warmup=1, steps=4, dtypes=("bfloat16",))


def run(s: dict, dtype: torch.dtype) -> dict:
    data = token_batches(s["vocab"], s["batch"], s["seq"], s["warmup"] + s["steps"])
    model = partial(gpt, *s["size"], s["vocab"], s["seq"])
    probe = pscompile.compile(model(), data[0], config=cpu_config(dtype=dtype))
    probe.step(data[0])
    least, chunk = probe.min_device_memory, probe.layout.chunk_size
    probe.close()
    budget = least + 2 * chunk * dtype.itemsize
    engines = {ov: pscompile.compile(model(), data[0], optimizer=adamw(1e-3), config=cpu_config(
        dtype=dtype, device_memory=budget, chunk_size=chunk, overlap_update=ov)) for ov in (False, True)}
    stats: dict[bool, list] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    for i, b in enumerate(data):
        for ov in ((False, True) if i % 2 else (True, False)):
            losses[ov].append(engines[ov].step(b))
            stats[ov].append(engines[ov].stats)
    rows, w = {}, s["warmup"]
    for ov, e in engines.items():
        rows[ov] = dict(overlap_update=ov, step_s=median_after(stats[ov], "time_s", w),
                        backward_s=median_after(stats[ov], "backward_s", w),
                        optimizer_s=median_after(stats[ov], "optimizer_s", w), early_chunks=e.early.last_count,
                        chunks=e.layout.num_chunks, peak_host=e.stats.peak_host_bytes,
                        update_nodes=str(e.schedule).count("pscompile.update("))
        e.close()
    return dict(dtype=str(dtype)[6:], budget=budget, chunk=chunk, rows=[rows[False], rows[True]],
                identical=losses[False] == losses[True], step_ratio=rows[True]["step_s"] / rows[False]["step_s"],
                optimizer_ratio=rows[True]["optimizer_s"] / rows[False]["optimizer_s"])


def main(argv=None) -> int:
    ap = parser(__doc__, "overlap_update", markdown=True)
    ap.add_argument("--size", type=lambda v: tuple(int(x) for x in v.split(",")), default=None, help="L,D")
    for name in ("batch", "seq", "steps"):
        ap.add_argument(f"--{name}", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    given = {k: getattr(args, k) for k in ("size", "batch", "seq", "steps") if getattr(args, k) is not None}
    s = {**(QUICK if args.quick else FULL), **given}
    results = [run(s, getattr(torch, d)) for d in s["dtypes"]]
    L, D = s["size"]
    print(f"GPT L{L} d{D}, batch {s['batch']} x {s['seq']}, compiled eager, budget = minimum + 2 chunks; medians "
          f"of {s['steps']} alternating steps")
    print(table([[res["dtype"], "after the backward" if not r["overlap_update"] else "in the backward",
                  f"{res['budget'] / 2**20:.1f}", f"{r['step_s']:.4f}", f"{r['backward_s']:.4f}",
                  f"{r['optimizer_s']:.4f}", f"{r['early_chunks']} / {r['chunks']}", f"{r['peak_host'] / 2**20:.1f}"]
                 for res in results for r in res["rows"]],
                ["compute", "update", "budget MiB", "step s", "backward s", "optimizer s", "chunks updated early",
                 "peak host MiB"], markdown=args.markdown))
    for res in results:
        print(f"\n{res['dtype']}: step {res['step_ratio']:.3f}x, optimizer {res['optimizer_ratio']:.3f}x of updating "
              f"after the backward; losses bit-identical: {res['identical']}")
    write_json(args.out, {"settings": s, "results": results})
    return 0 if all(res["identical"] for res in results) else 1


if __name__ == "__main__":
    sys.exit(main())
