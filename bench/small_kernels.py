"""The executor on small kernels: a tight-budget 2-layer d=64 GPT against plain PyTorch, interleaved.

On a GPU a d=64 layer's kernels take microseconds, so what compiled mode adds per step (running the
memory nodes, sampling the peak, calling each region, the chunked update) is what the step costs.
The CPU stands in: the same GPT as ``pscompile bench --quick`` (2 layers, d=64, vocabulary 512,
batch 2 x 64 tokens), trained by plain PyTorch (``torch.optim.AdamW``, everything resident, no
budget; the reference) and by compiled mode with ``backend="eager"`` and ``backend="inductor"`` at
the tight budget (the minimum + 2 chunks, as compare.py's "tight") and with no budget.

Every engine takes one step per round, the order rotated every round, after warm-up; the table
gives each one's median step and its ratio to plain PyTorch's median, and every compiled step's
measured peak against its budget (the peak is measured every step, as always).

    python bench/small_kernels.py [--quick] [--markdown] [--rounds 60] [--out bench/results/small_kernels.json]

Float32, one torch thread.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pscompile
from compare import QUICK as SHAPE, batches, probe, tight     # (the model and data of bench --quick)
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt
from pscompile.testing import ReferenceTrainer

FULL = dict(rounds=60, warmup=5)
QUICK = dict(rounds=8, warmup=2)


def model():
    return gpt(2, 64, SHAPE["vocab"], SHAPE["seq"])


def _engines(data, backends: list[str]) -> dict:
    """name -> (step function, budget or None, engine or None): plain PyTorch and each compiled configuration."""
    minimum, chunk, _ = probe(model(), data[0])
    plain = ReferenceTrainer(model(), optimizer=adamw(1e-3), dtype=torch.float32)
    out = {"plain PyTorch": (plain.step, None, None)}
    for backend in backends:
        for bname, budget in (("tight", tight(minimum, chunk)), ("none", None)):
            e = pscompile.compile(model(), data[0], config=cpu_config(backend=backend, device_memory=budget,
                                                                      chunk_size=chunk))
            out[f"compiled {backend}, {bname}"] = (e.step, budget, e)
    return out


def measure(s: dict, backends: list[str]) -> list[dict]:
    data = batches(SHAPE, s["warmup"] + s["rounds"])
    engines = _engines(data, backends)
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    try:
        for i, b in enumerate(data):
            order = names[i % len(names):] + names[:i % len(names)]
            for n in order:
                step, _, engine = engines[n]
                t = time.perf_counter()
                step(b)
                if i >= s["warmup"]:
                    times[n].append(time.perf_counter() - t)
                if engine is not None:
                    peaks[n].append(engine.stats.peak_device_bytes)
    finally:
        for _, _, engine in engines.values():
            if engine is not None:
                engine.close()
    base = statistics.median(times["plain PyTorch"])
    return [dict(system=n, budget=engines[n][1], step_s=statistics.median(times[n]),
                 ratio=statistics.median(times[n]) / base, peak=max(peaks[n]) if peaks[n] else None,
                 within_budget=engines[n][1] is None or max(peaks[n]) <= engines[n][1]) for n in names]


def main(argv=None) -> int:
    ap = parser(__doc__, "small_kernels", markdown=True)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 60, quick 8)")
    ap.add_argument("--eager-only", action="store_true", help="leave out the Inductor rows")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = dict(QUICK if args.quick else FULL)
    if args.rounds:
        s["rounds"] = args.rounds
    rows = measure(s, ["eager"] if args.eager_only else ["eager", "inductor"])
    cells = [[r["system"], "-" if r["budget"] is None else f"{r['budget'] / 2**20:.2f}",
              f"{r['step_s'] * 1e3:.2f}", f"{r['ratio']:.2f}",
              "-" if r["peak"] is None else f"{r['peak'] / 2**20:.2f}"] for r in rows]
    print(f"GPT L2 d64 (bench --quick's), float32, one thread; median of {s['rounds']} interleaved rounds "
          f"after {s['warmup']} warm-up\n")
    print(table(cells, ["system", "budget MiB", "step ms", "step / plain", "peak MiB (max of every step)"],
                markdown=args.markdown))
    write_json(args.out, dict(settings=s, rows=rows))
    over = [r["system"] for r in rows if not r["within_budget"]]
    for n in over:
        print(f"FAILED {n}: a measured peak over the budget")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
