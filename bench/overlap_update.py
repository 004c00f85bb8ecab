"""The optimizer update overlapped with the backward (``Config.overlap_update``), against after it.

Two compiled-mode engines train the same GPT on the same batches under the same tight budget (its
minimum + 2 chunks), one with ``overlap_update=True`` (each chunk's update starts on a host thread
as soon as its gradients are home) and one with ``False``. Steps alternate between the two, the
order flipped every step, after warm-up. Per engine: the median step, backward and optimizer
times (``StepStats``), and the chunks updated in the backward. The losses must agree bit for bit.

A small batch makes the update matter: at batch 1 x 64 tokens, a 4-layer d768 GPT's host AdamW
is a tenth (float32) to two fifths (bfloat16 compute, fp32 masters) of the step on this machine.
On a GPU the backward runs on the device and the host is free; here the CPU is both, so the
update thread takes the second core.

    python bench/overlap_update.py [--quick] [--markdown] [--size L,D] [--batch B] [--seq T]
                                   [--steps 20] [--out bench/results/overlap_update.json]

bfloat16 and float32 compute, the eager backend, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overlap_update.json"
FULL = dict(size=(4, 768), batch=1, seq=64, vocab=8192, warmup=3, steps=20, dtypes=("bfloat16", "float32"))
QUICK = dict(size=(2, 128), batch=1, seq=32, vocab=512, warmup=1, steps=4, dtypes=("bfloat16",))


def _model(s: dict) -> GPT:
    torch.manual_seed(0)
    L, D = s["size"]
    return GPT(GPTConfig(n_layer=L, n_head=max(1, D // 64), d_model=D, vocab_size=s["vocab"], seq_len=s["seq"]))


def _batches(s: dict, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    shape = (s["batch"], s["seq"])
    return [(torch.randint(0, s["vocab"], shape, generator=g), torch.randint(0, s["vocab"], shape, generator=g))
            for _ in range(n)]


def run(s: dict, dtype: torch.dtype) -> dict:
    data = _batches(s, s["warmup"] + s["steps"])
    base = dict(mode="compiled", backend="eager", device="cpu", dtype=dtype)
    probe = pscompile.compile(_model(s), data[0], config=pscompile.Config(**base))
    probe.step(data[0])
    least, chunk = probe.min_device_memory, probe.layout.chunk_size
    probe.close()
    budget = least + 2 * chunk * dtype.itemsize
    engines = {ov: pscompile.compile(_model(s), data[0], optimizer=pscompile.AdamW(lr=1e-3),
                                     config=pscompile.Config(**base, device_memory=budget, chunk_size=chunk,
                                                             overlap_update=ov))
               for ov in (False, True)}
    stats: dict[bool, list] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    for i, b in enumerate(data):
        for ov in ((False, True) if i % 2 else (True, False)):
            e = engines[ov]
            losses[ov].append(e.step(b))
            if i >= s["warmup"]:
                stats[ov].append((e.stats.time_s, e.stats.backward_s, e.stats.optimizer_s, e.early.last_count))
    rows = {}
    for ov, e in engines.items():
        st = stats[ov]
        rows[ov] = dict(overlap_update=ov, step_s=statistics.median(x[0] for x in st),
                        backward_s=statistics.median(x[1] for x in st), optimizer_s=statistics.median(x[2] for x in st),
                        early_chunks=st[-1][3], chunks=e.layout.num_chunks,
                        peak_host=e.stats.peak_host_bytes, update_nodes=str(e.schedule).count("pscompile.update("))
        e.close()
    return dict(dtype=str(dtype)[6:], budget=budget, chunk=chunk, rows=[rows[False], rows[True]],
                identical=losses[False] == losses[True], step_ratio=rows[True]["step_s"] / rows[False]["step_s"],
                optimizer_ratio=rows[True]["optimizer_s"] / rows[False]["optimizer_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--size", type=lambda v: tuple(int(x) for x in v.split(",")), default=None, help="L,D")
    for name in ("batch", "seq", "steps"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    given = {k: getattr(args, k) for k in ("size", "batch", "seq", "steps") if getattr(args, k) is not None}
    s = {**(QUICK if args.quick else FULL), **given}
    results = [run(s, getattr(torch, d)) for d in s["dtypes"]]
    table = [[res["dtype"], "after the backward" if not r["overlap_update"] else "in the backward",
              f"{res['budget'] / 2**20:.1f}", f"{r['step_s']:.4f}", f"{r['backward_s']:.4f}", f"{r['optimizer_s']:.4f}",
              f"{r['early_chunks']} / {r['chunks']}", f"{r['peak_host'] / 2**20:.1f}"]
             for res in results for r in res["rows"]]
    L, D = s["size"]
    print(f"GPT L{L} d{D}, batch {s['batch']} x {s['seq']}, compiled eager, budget = minimum + 2 chunks; medians "
          f"of {s['steps']} alternating steps")
    print(tabulate(table, ["compute", "update", "budget MiB", "step s", "backward s", "optimizer s",
                           "chunks updated early", "peak host MiB"], tablefmt="github" if args.markdown else "simple"))
    for res in results:
        print(f"\n{res['dtype']}: step {res['step_ratio']:.3f}x, optimizer {res['optimizer_ratio']:.3f}x of updating "
              f"after the backward; losses bit-identical: {res['identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": s, "results": results}, indent=1))
    return 0 if all(res["identical"] for res in results) else 1


if __name__ == "__main__":
    sys.exit(main())
