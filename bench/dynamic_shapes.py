"""Batches whose length changes (issue 60; docs/dynamic-shapes.md explains the tables): every
system on the same ten lengths (``LENGTHS``), one after another, with a cold Inductor cache.

A GPT (4 layers, d=128, vocabulary 2048; quick: 2 layers, d=64, vocabulary 256), batch 2, float32,
one thread, through plain PyTorch, plain torch.compile (automatic dynamic, fused AdamW), hooks mode
and compiled mode (eager and Inductor backends), pscompile under 1.5x its minimum for the longest
batch. Per system: the ten steps' total (and over plain torch.compile's), the first and slowest
warm step, the captures, the budget kept, the loss difference from plain PyTorch, the share of
compute operators inside Inductor's code; then each length's step under the range's schedule once
warm beside a compiled engine planned for that length alone (target: at most 1.1x).

    python bench/dynamic_shapes.py [--quick] [--markdown] [--out bench/results/dynamic_shapes.json]

``--quick`` leaves out the systems that compile with Inductor.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt_of, token_batches
from harness.timing import time_reps

LENGTHS = (124, 65, 113, 69, 21, 49, 81, 78, 67, 116)
BASELINE = "plain torch.compile"
FULL = dict(n_layer=4, d=128, vocab=2048, seq=128)
QUICK = dict(n_layer=2, d=64, vocab=256, seq=128)


class Captures(logging.Handler):
    """Counts the captures pscompile logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("capture_joint:")


def batch(length: int, seed: int, vocab: int):
    return token_batches(vocab, 2, length, 1, seed=seed)[0]


def plain(shape: dict, compiled: bool):
    m = gpt_of(shape)
    fn = torch.compile(m) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=compiled or None)

    def step(b) -> float:
        opt.zero_grad(set_to_none=True)
        loss = fn(*b)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def engine(shape: dict, mode: str, backend: str, longest, **kw):
    budget = int(1.5 * pscompile.min_device_memory(gpt_of(shape), longest, cpu_config(mode, backend=backend)))
    eng = pscompile.compile(gpt_of(shape), optimizer=adamw(1e-3),
                            config=cpu_config(mode, backend=backend, device_memory=budget, **kw))
    return eng, budget


def run(name: str, shape: dict, lengths) -> dict:
    """One system's ten steps: times, losses, captures, peaks; a compiled run then takes the ten
    lengths twice more, the range's schedule once warm (a schedule's warm variant first runs in the
    first pass): ``warm``, the faster of each length's two steps and the bytes it fetched."""
    data = [batch(n, i, shape["vocab"]) for i, n in enumerate(lengths)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = budget = None
    if name.startswith("plain"):
        step = plain(shape, compiled=name == BASELINE)
    else:
        mode, backend = ("hooks", "eager") if name == "hooks" else ("compiled", name.split()[1])
        eng, budget = engine(shape, mode, backend, data[lengths.index(max(lengths))])
        step = eng.step
    counter = Captures()                 # (after min_device_memory's own capture)
    logging.getLogger("pscompile").addHandler(counter)
    logging.getLogger("pscompile").setLevel(logging.INFO)
    times, losses, stats = [], [], []
    try:
        for b in data * (3 if name.startswith("compiled") else 1):
            t = time.perf_counter()
            losses.append(step(b))
            times.append(time.perf_counter() - t)
            stats.append(eng and eng.stats)
    finally:
        logging.getLogger("pscompile").removeHandler(counter)
        if eng is not None:
            eng.close()
    n = len(data)
    warm = [min((times[i + k * n], stats[i + k * n].h2d_bytes) for k in (1, 2)) for i in range(n)] if stats[n:] else []
    captures = counter.count if eng is not None else (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] if name == BASELINE else 0)
    return dict(system=name, total_s=sum(times[:n]), first_s=times[0], step_s=times[:n], losses=losses[:n],
                warm=warm, compiled_share=[s and s.compiled_share for s in stats[:n]], slowest_warm_s=max(times[2:n]),
                captures=captures, budget=budget,
                within_budget=eng is None or all(s.peak_device_bytes <= budget for s in stats))


def fixed_length(shape: dict, lengths, backend: str, runs: int = 3) -> list[tuple[float, int]]:
    """Each length's step planned for that length alone: the fastest of ``runs`` steps after three
    (the measuring run, the regions' first run, the warm plan), and the bytes its last step fetched."""
    out = []
    for i, n in enumerate(lengths):
        b = batch(n, i, shape["vocab"])
        eng, _ = engine(shape, "compiled", backend, b, dynamic=False)
        out.append((min(time_reps(lambda: eng.step(b), runs, warmup=3)), eng.stats.h2d_bytes))
        eng.close()
    return out


def main(argv=None) -> int:
    args = parser(__doc__, "dynamic_shapes", markdown=True).parse_args(argv)
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pscompile-bench-inductor-")   # cold
    shape = QUICK if args.quick else FULL
    systems = ["plain PyTorch", "hooks", "compiled eager"] if args.quick else \
        ["plain PyTorch", BASELINE, "hooks", "compiled eager", "compiled inductor"]
    rows = [run(name, shape, LENGTHS) for name in systems]
    base = next((r["total_s"] for r in rows if r["system"] == BASELINE), None)
    for r in rows:
        r["vs_torch_compile"] = None if base is None else r["total_s"] / base
        r["max_dloss"] = max(abs(a - b) for a, b in zip(r["losses"], rows[0]["losses"]))
    per_length = {}
    for backend in ("eager",) if args.quick else ("eager", "inductor"):
        ranged = next(r for r in rows if r["system"] == f"compiled {backend}")
        fixed = fixed_length(shape, LENGTHS, backend)
        per_length[backend] = [dict(length=n, ranged_s=ranged["warm"][i][0], fixed_s=fixed[i][0],
                                    ratio=ranged["warm"][i][0] / fixed[i][0], ranged_h2d=ranged["warm"][i][1],
                                    fixed_h2d=fixed[i][1]) for i, n in enumerate(LENGTHS)]
    print(f"lengths {list(LENGTHS)}, GPT {shape}, batch 2, float32, one thread, cold Inductor cache")
    print(table([[r["system"], f"{r['total_s']:.2f}", "-" if r["vs_torch_compile"] is None else
                  f"{r['vs_torch_compile']:.2f}", f"{r['first_s']:.2f}", f"{r['slowest_warm_s'] * 1e3:.0f}",
                  r["captures"], "-" if r["budget"] is None else ("yes" if r["within_budget"] else "NO"),
                  f"{r['max_dloss']:.1e}", _share(r["compiled_share"][2:])] for r in rows],
                ["system", "10 steps s", "/ torch.compile", "first step s", "slowest of 3-10 ms", "captures",
                 "within budget", "max |dloss|", "compiled ops, steps 3-10"], markdown=args.markdown))
    for backend, cells in per_length.items():
        print(f"\nonce warm, backend={backend}: the range's step beside a plan for that length alone")
        print(table([[p["length"], f"{p['ranged_s'] * 1e3:.1f}", f"{p['fixed_s'] * 1e3:.1f}", f"{p['ratio']:.2f}",
                      f"{p['ranged_h2d'] / 2**20:.2f}", f"{p['fixed_h2d'] / 2**20:.2f}"] for p in cells],
                    ["length", "range's step ms", "fixed-length step ms", "ratio", "range's MiB in",
                     "fixed-length MiB in"], markdown=args.markdown))
    write_json(args.out, dict(lengths=LENGTHS, shape=shape, rows=rows, per_length=per_length))
    bad = [r["system"] for r in rows if r["max_dloss"] > 1e-3 or not r["within_budget"]]
    if bad:
        print("loss differs from plain PyTorch or a step went over the budget:", bad)
        return 1
    return 0


def _share(shares: list) -> str:
    """The compiled operators' share over steps, as min-max (- where nothing compiles)."""
    known = [s for s in shares if s is not None]
    return "-" if not known or not any(known) else f"{min(known):.0%}-{max(known):.0%}"


if __name__ == "__main__":
    sys.exit(main())
