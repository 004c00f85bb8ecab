"""Batches whose length changes (issue 60): every system on the same ten lengths, one after another.

A GPT (full: 4 layers, d=128, vocabulary 2048; quick: 2 layers, d=64, vocabulary 256), batch 2,
float32, one torch thread, a cold Inductor cache (a new cache folder for the run), trains ten steps
whose lengths are ``LENGTHS``. pscompile runs under a budget 1.5x its mode's minimum for the longest
batch, which evicts.

- ``plain PyTorch``: the eager model and ``torch.optim.AdamW``;
- ``plain torch.compile``: ``torch.compile(model)`` (automatic dynamic) and fused AdamW, no budget;
- ``hooks``: pscompile's hooks mode;
- ``compiled eager`` / ``compiled inductor``: compiled mode, ``backend="eager"`` / ``"inductor"``;
- ``fixed-length``: for the per-step comparison, compiled mode (each backend, ``dynamic=False``)
  trained on one length at a time: the fastest of three steps after three.

Per system: the ten steps' total and its ratio to plain torch.compile's, the first step, the
slowest of steps 3-10, the captures pscompile made (its log's ``capture_joint`` lines; torch.compile:
the graphs dynamo compiled), whether every step kept the budget (pscompile's measured peak), and the
largest loss difference from plain PyTorch. A last table puts each length's step under the range's
schedule once warm (the ten lengths twice again, steps 11-30 of each compiled run, the faster of
each length's two steps) beside a run planned
for that length alone with the same backend (the target: at most 1.1x), with the bytes each
fetched. The compiled-ops column says whether compiled code ran: the share of each step's compute
operators that ran inside Inductor's code, smallest and largest over steps 3-10.

    python bench/dynamic_shapes.py [--quick] [--markdown] [--out bench/results/dynamic_shapes.json]

``--quick`` leaves out the systems that compile with Inductor.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "dynamic_shapes.json"
LENGTHS = (124, 65, 113, 69, 21, 49, 81, 78, 67, 116)
BASELINE = "plain torch.compile"
FULL = dict(n_layer=4, n_head=4, d_model=128, vocab_size=2048)
QUICK = dict(n_layer=2, n_head=2, d_model=64, vocab_size=256)


class Captures(logging.Handler):
    """Counts the captures pscompile logs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("capture_joint:")


def batch(length: int, seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (2, length), generator=g)
    return (idx, torch.roll(idx, -1, dims=1))


def model(shape: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=128, **shape))


def plain(shape: dict, compiled: bool):
    m = model(shape)
    fn = torch.compile(m) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=compiled or None)

    def step(b) -> float:
        opt.zero_grad(set_to_none=True)
        loss = fn(*b)
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def config(mode: str, backend: str, **kw) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend=backend, device="cpu", dtype=torch.float32, **kw)


def engine(shape: dict, mode: str, backend: str, longest, **kw):
    budget = int(1.5 * pscompile.min_device_memory(model(shape), longest, config(mode, backend)))
    eng = pscompile.compile(model(shape), optimizer=pscompile.AdamW(lr=1e-3),
                            config=config(mode, backend, device_memory=budget, **kw))
    return eng, budget


def run(name: str, shape: dict, lengths) -> dict:
    """One system's ten steps: times, losses, captures, peaks."""
    data = [batch(n, i, shape["vocab_size"]) for i, n in enumerate(lengths)]
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
    times, losses, within, shares = [], [], True, []
    try:
        for b in data:
            t = time.perf_counter()
            losses.append(step(b))
            times.append(time.perf_counter() - t)
            within &= eng is None or eng.stats.peak_device_bytes <= budget
            shares.append(eng.stats.compiled_share if eng is not None else None)

        warm = []                        # the same lengths twice more: the range's schedule once warm (a
        for rep in range(2) if name.startswith("compiled") else ():     # schedule's warm variant first
            for i, b in enumerate(data):                                # runs in the first pass)
                t = time.perf_counter()
                step(b)
                got = (time.perf_counter() - t, eng.stats.h2d_bytes)
                if rep == 0:
                    warm.append(got)
                else:
                    warm[i] = min(warm[i], got)
                within &= eng.stats.peak_device_bytes <= budget
    finally:
        logging.getLogger("pscompile").removeHandler(counter)
        if eng is not None:
            eng.close()
    captures = counter.count if eng is not None else (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] if name == BASELINE else 0)
    return dict(system=name, total_s=sum(times), first_s=times[0], step_s=times, losses=losses, warm=warm,
                compiled_share=shares,
                slowest_warm_s=max(times[2:]), captures=captures, budget=budget, within_budget=within)


def fixed_length(shape: dict, lengths, backend: str, runs: int = 3) -> list[tuple[float, int]]:
    """Each length's step in a compiled engine planned for that length alone (``backend``): the
    fastest of ``runs`` steps after three (the measuring run, the regions' first run, the warm plan),
    and the bytes its last step fetched."""
    out = []
    for i, n in enumerate(lengths):
        b = batch(n, i, shape["vocab_size"])
        eng, _ = engine(shape, "compiled", backend, b, dynamic=False)
        times = []
        for k in range(3 + runs):
            t = time.perf_counter()
            eng.step(b)
            times.append(time.perf_counter() - t)
        out.append((min(times[3:]), eng.stats.h2d_bytes))
        eng.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
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
    fmt = "github" if args.markdown else "simple"
    print(f"lengths {list(LENGTHS)}, GPT {shape}, batch 2, float32, one thread, cold Inductor cache")
    print(tabulate([[r["system"], f"{r['total_s']:.2f}", "-" if r["vs_torch_compile"] is None else
                     f"{r['vs_torch_compile']:.2f}", f"{r['first_s']:.2f}", f"{r['slowest_warm_s'] * 1e3:.0f}",
                     r["captures"], "-" if r["budget"] is None else ("yes" if r["within_budget"] else "NO"),
                     f"{r['max_dloss']:.1e}", _share(r["compiled_share"][2:])] for r in rows],
                   headers=["system", "10 steps s", "/ torch.compile", "first step s", "slowest of 3-10 ms",
                            "captures", "within budget", "max |dloss|", "compiled ops, steps 3-10"], tablefmt=fmt))
    for backend, table in per_length.items():
        print(f"\nonce warm, backend={backend}: the range's step beside a plan for that length alone")
        print(tabulate([[p["length"], f"{p['ranged_s'] * 1e3:.1f}", f"{p['fixed_s'] * 1e3:.1f}", f"{p['ratio']:.2f}",
                         f"{p['ranged_h2d'] / 2**20:.2f}", f"{p['fixed_h2d'] / 2**20:.2f}"] for p in table],
                       headers=["length", "range's step ms", "fixed-length step ms", "ratio", "range's MiB in",
                                "fixed-length MiB in"], tablefmt=fmt))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(lengths=LENGTHS, shape=shape, rows=rows, per_length=per_length), indent=1))
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
