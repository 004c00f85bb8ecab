"""The GPU acceptance run: one command, JSON plus a Markdown table.

    python bench/gpu.py [--dry-run] [--quick] [--markdown] [--out bench/results/gpu.json] [--deadline-s 470]
    python bench/gpu.py --lease [...]      # a short lease's one command: bench/gpu_lease.py
    python bench/gpu.py --peers [...]      # against FSDP2, DeepSpeed, torch.compile: bench/gpu_peers.py

On a CUDA machine (at most 8 minutes on one H100; the lent machines hold torch 2.11):

1. **Parity** of compiled mode (eager and Inductor) and hooks mode against plain PyTorch, float32
   and bfloat16, under a budget that evicts every step: the largest relative loss difference over
   the steps, and the allocator's own peak (``torch.cuda.max_memory_allocated``, reset each step,
   ``StepStats.allocator_peak_bytes``) checked against the budget on every step.
2. **Step time** of plain PyTorch, plain ``torch.compile``, hooks, compiled eager and compiled
   Inductor at no budget, a middle and a tight budget, on a GPT large enough that kernels are not
   launch-bound (24 layers x 2048, bfloat16).
3. **Overlap ratio** per row: step time / max(the same system's step with no budget, bytes moved /
   the measured pinned-copy rate of this machine's link). 1.0 is the limit: every byte hidden
   behind compute, or the link busy the whole step.

The capacity ladder (the largest GPT each system trains under one eighth of the GPU) is
``--peers``'s, where it runs beside FSDP2 and plain PyTorch (``capped_plain`` below).

``--dry-run`` runs the same script end to end on the CPU with tiny shapes (the budget's "GPU" is a
pretend 64 MiB device), so the script cannot rot while no GPU is lent; there the peaks are
pscompile's own accounting (no allocator), the link rate is the host's memcpy, Inductor rows are
skipped unless ``--inductor`` (cold compiles cost 20-45 s each on a small CPU), and the times mean
nothing. Every row that fails carries an ``error`` and the script exits 1; rows the deadline cuts
off are marked ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer
from pscompile.units import format_bytes

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu.json"
GPU = dict(parity=(2, 256), speed=(24, 2048), vocab=8192, seq=512, batch=4, steps=4, warmup=1, chunk=None)
DRY = dict(parity=(2, 64), speed=(2, 64), vocab=256, seq=32, batch=2, steps=2, warmup=1, chunk=4096,
           device_bytes=64 * MiB)


class Clock:
    """The run's deadline: rows started after it are skipped, not run."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def gpt_config(size: tuple[int, int], s: dict) -> GPTConfig:
    """The GPT of ``size`` (layers, width) at ``s``'s vocabulary and sequence length."""
    n_layer, d = size
    return GPTConfig(n_layer=n_layer, n_head=max(1, d // 128), d_model=d, vocab_size=s["vocab"], seq_len=s["seq"])


def model(size: tuple[int, int], s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config(size, s))


def batches(s: dict, n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def link_rate(device: str) -> float:
    """Bytes/s of one pinned host->device copy of 256 MiB (CUDA), or of a host memcpy (dry run)."""
    n = (256 if device == "cuda" else 16) * MiB // 4
    src = torch.ones(n, pin_memory=device == "cuda")
    dst = torch.empty(n, device=device)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return 3 * n * 4 / (time.perf_counter() - t)


SYSTEMS = {"hooks": dict(mode="hooks"), "compiled eager": dict(mode="compiled", backend="eager"),
           "compiled inductor": dict(mode="compiled", backend="inductor")}


def config(device: str, dtype, budget, name: str, chunk) -> pscompile.Config:
    return pscompile.Config(device=device, dtype=dtype, device_memory=budget, chunk_size=chunk or "auto",
                            **SYSTEMS[name])


def timed(step, data, device: str, record=lambda: {}) -> list[dict]:
    """Per batch of ``data``: ``step(batch)``'s loss and wall time (the device synchronized), and ``record()``."""
    rows = []
    for b in data:
        sync(device)
        t0 = time.perf_counter()
        loss = step(b)
        sync(device)
        rows.append(dict(loss=loss, time_s=time.perf_counter() - t0, **record()))
    return rows


def run_pscompile(make, data, device: str, budget) -> dict:
    """Train on ``data``; per step the loss, time, bytes moved and both peaks (ours and the allocator's)."""
    t = time.perf_counter()
    engine = make()
    try:
        rows = timed(engine.step, data, device, lambda: dict(
            moved=engine.stats.bytes_moved, h2d=engine.stats.h2d_bytes, d2h=engine.stats.d2h_bytes,
            peak=engine.stats.peak_device_bytes,
            allocator_peak=engine.stats.allocator_peak_bytes, forward_s=engine.stats.forward_s,
            backward_s=engine.stats.backward_s, optimizer_s=engine.stats.optimizer_s, **op_counts(engine.stats)))
        over = [r for r in rows if budget is not None and max(r["peak"], r["allocator_peak"] or 0) > budget]
        return dict(first_s=time.perf_counter() - t - sum(r["time_s"] for r in rows[1:]), steps=rows,
                    within_budget=not over, min_device_memory=engine.min_device_memory)
    finally:
        engine.close()


def op_counts(stats) -> dict:
    """The step's compute operators and those that ran in compiled code (StepStats fields that newer
    pscompile versions have; None where this one lacks them)."""
    return {k: getattr(stats, k, None) for k in ("compute_ops", "compiled_ops", "compiled_share")}


def run_plain(size, data, s, device: str, dtype, compiled: bool) -> dict:
    trainer = ReferenceTrainer(model(size, s), optimizer=pscompile.AdamW(lr=1e-3), dtype=dtype, device=device,
                               fused=device == "cuda")
    if compiled:
        trainer.model = torch.compile(trainer.model)
    return dict(steps=timed(trainer.step, data, device))


def step_time(row: dict, warmup: int) -> float:
    return statistics.median(r["time_s"] for r in row["steps"][1 + warmup:])


def guarded(clock: Clock, need_s: float, fn, **label) -> dict:
    """``fn()``'s row with ``label``; ``skipped`` past the deadline, ``error`` if it raised."""
    if clock.left() < need_s:
        return dict(label, skipped=f"deadline: {clock.left():.0f} s left, the row needs ~{need_s:.0f} s")
    t = time.perf_counter()
    try:
        row = dict(label, **fn())
    except Exception as e:                    # noqa: BLE001 -- recorded in the row; the script exits 1
        row = dict(label, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    progress(row, time.perf_counter() - t)
    return row


def progress(row: dict, seconds: float) -> None:
    """One line per finished row on stderr, so a run cut off by an outer time limit still shows its
    results so far."""
    brief = {k: v for k, v in row.items() if k != "steps"}
    if "steps" in row:
        brief.update(losses=[round(float(r["loss"]), 4) for r in row["steps"]],
                     times_s=[round(r["time_s"], 4) for r in row["steps"]])
        last = row["steps"][-1]
        brief.update({f"last_{k}": round(last[k], 4) for k in ("forward_s", "backward_s", "optimizer_s") if k in last})
    print(f"[{seconds:6.1f} s] {json.dumps(brief, default=str)}", file=sys.stderr, flush=True)


def minimum_and_full(size, data, s: dict, device: str, dtype) -> tuple[int, int]:
    """compiled mode's minimum budget, and the device bytes of a run with no budget."""
    engine = pscompile.compile(model(size, s), data[0], config=config(device, dtype, None, "compiled eager", s["chunk"]))
    try:
        engine.step(data[0])
        return engine.min_device_memory, engine.stats.peak_device_bytes
    finally:
        engine.close()


def parity_rows(s, device, systems, clock, need=lambda name: 60.0, emit=lambda row: None) -> list[dict]:
    """Per dtype and system, a row; ``need(system)``: the seconds a row needs to start before the
    deadline; ``emit(row)`` sees each row as it ends."""
    out = []
    data = batches(s, 1 + s["steps"])
    for dtype in (torch.float32, torch.bfloat16):
        elsize = torch.empty((), dtype=dtype).element_size()
        ref = run_plain(s["parity"], data, s, device, dtype, compiled=False)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        for name in systems:
            def run() -> dict:
                minimum = pscompile.min_device_memory(model(s["parity"], s), data[0],
                                                      config(device, dtype, None, name, s["chunk"]))
                budget = minimum + 2 * (s["chunk"] or 1 << 20) * elsize       # evicts every step
                return dict(budget=budget, **run_pscompile(lambda: pscompile.compile(
                    model(s["parity"], s), data[0], config=config(device, dtype, budget, name, s["chunk"])),
                    data, device, budget))
            row = guarded(clock, need(name), run, section="parity", system=name, dtype=str(dtype).split(".")[-1])
            if "steps" in row:
                diffs = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(row["steps"], ref["steps"])]
                row.update(max_rel_loss=max(diffs), tracks=max(diffs) <= tol,
                           evicted=sum(r["moved"] for r in row["steps"]) > 0)
            emit(row)
            out.append(row)
    return out


def speed_rows(s, device, systems, clock, rate: float, quick: bool = False) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    data = batches(s, 1 + s["warmup"] + s["steps"])
    out = []
    for name, compiled in (("plain PyTorch", False), ("plain torch.compile", True)):
        if compiled and "compiled inductor" not in systems:
            why = "--quick" if quick else "dry run without --inductor"
            out.append(dict(section="speed", system=name, budget_name="none", skipped=why))
            continue
        row = guarded(clock, 90, lambda: run_plain(s["speed"], data, s, device, dtype, compiled),
                      section="speed", system=name, budget_name="none", budget=None)
        if "steps" in row:
            row["step_s"] = step_time(row, s["warmup"])
        out.append(row)
    minimum, full = minimum_and_full(s["speed"], data, s, device, dtype)
    tight = int(minimum * 1.15)
    budgets = [("none", None), ("mid", (tight + full) // 2), ("tight", tight)]
    if quick:
        budgets = [budgets[0], budgets[2]]
    alone: dict[str, float] = {}
    for bname, budget in budgets:
        for name in systems:
            row = guarded(clock, 90, lambda: run_pscompile(
                lambda: pscompile.compile(model(s["speed"], s), data[0], config=config(device, dtype, budget, name, s["chunk"])),
                data, device, budget), section="speed", system=name, budget_name=bname, budget=budget)
            if "steps" in row:
                row["step_s"] = step_time(row, s["warmup"])
                moved = row["steps"][-1]["moved"]
                if budget is None:
                    alone[name] = row["step_s"]
                if name in alone:
                    row["overlap_ratio"] = row["step_s"] / max(alone[name], moved / rate)
            out.append(row)
    return out


def capped_plain(size, data, s, budget: int) -> dict:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        return run_plain(size, data, s, "cuda", torch.bfloat16, compiled=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def failures(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['section']} {r.get('system')}: {r['error']}")
        elif r.get("within_budget") is False:
            out.append(f"{r['section']} {r.get('system')}: a step's peak went over the budget {r.get('budget')}")
        elif r.get("tracks") is False:
            out.append(f"parity {r['system']} {r['dtype']}: loss {r['max_rel_loss']:.2e} from plain PyTorch")
        elif r.get("evicted") is False:
            out.append(f"parity {r['system']} {r['dtype']}: the budget {r['budget']} moved no bytes")
    return out


def markdown(res: dict) -> str:
    def peak(r, key):
        if "steps" not in r:
            return "-"
        top = max(x[key] or 0 for x in r["steps"])
        return format_bytes(top) if top else "n/a"
    parity = [[r["system"], r["dtype"], format_bytes(r["budget"]) if "budget" in r else "-",
               r.get("skipped") or r.get("error") or f"{r['max_rel_loss']:.1e}", peak(r, "peak"),
               peak(r, "allocator_peak")] for r in res["rows"] if r["section"] == "parity"]
    speed = [[r["system"], r["budget_name"], "-" if r.get("budget") is None else format_bytes(r["budget"]),
              r.get("skipped") or r.get("error") or f"{r['step_s']:.3f}",
              f"{r['overlap_ratio']:.2f}" if "overlap_ratio" in r else "-"]
             for r in res["rows"] if r["section"] == "speed"]
    meta = res["meta"]
    head = (f"device: {meta['device']}, torch {meta['torch']}, link {meta['link_GBps']:.1f} GB/s, "
            f"{meta['date']}{' (dry run on the CPU: times mean nothing)' if meta['dry_run'] else ''}\n\n")
    return head + "\n\n".join([
        tabulate(parity, ["parity", "dtype", "budget", "max rel loss diff", "peak (ours)", "peak (allocator)"], "github"),
        tabulate(speed, ["speed", "budget", "bytes", "step s", "overlap ratio"], "github")])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--lease" in argv:                  # the short lease's one command: bench/gpu_lease.py
        from gpu_lease import main as lease
        return lease([a for a in argv if a != "--lease"])
    if "--peers" in argv:                  # against FSDP2, DeepSpeed and plain torch.compile: bench/gpu_peers.py
        from gpu_peers import main as peers
        return peers([a for a in argv if a != "--peers"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lease", action="store_true",
                    help="the one command of a lent GPU (tests/gpu, then speed and parity rows, in at most 5 "
                         "minutes): bench/gpu_lease.py, whose flags follow (--lease --help lists them)")
    ap.add_argument("--peers", action="store_true",
                    help="pscompile against FSDP2 + CPU offload, DeepSpeed ZeRO-3 offload and plain torch.compile on "
                         "one GPU (about 8 minutes): bench/gpu_peers.py, whose flags follow (--peers --help lists them)")
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU with tiny shapes")
    ap.add_argument("--inductor", action="store_true", help="dry run: also the Inductor rows (slow on a CPU)")
    ap.add_argument("--quick", action="store_true",
                    help="a short lease: speed rows for hooks and compiled eager on 12 layers (not 24) at no and a "
                         "tight budget")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--deadline-s", type=float, default=470.0, help="rows starting later are skipped")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; use --dry-run to run it on the CPU with tiny shapes", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    s = dict(DRY if args.dry_run else GPU)
    if args.quick and not args.dry_run:
        s["speed"] = (12, 2048)          # half the layers: the same kernels, half the time per row
    clock = Clock(args.deadline_s)
    systems = [n for n in SYSTEMS if n != "compiled inductor" or not args.dry_run or args.inductor]
    device_bytes = s["device_bytes"] if args.dry_run else torch.cuda.get_device_properties(0).total_memory
    rate = link_rate(device)
    rows = parity_rows(s, device, systems, clock)
    fast = [n for n in systems if n != "compiled inductor"] if args.quick else systems
    rows += speed_rows(s, device, fast, clock, rate, quick=args.quick)
    meta = dict(device=torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)", torch=torch.__version__,
                dry_run=args.dry_run, link_GBps=rate / 1e9, date=time.strftime("%Y-%m-%d"),
                device_bytes=device_bytes, settings={k: v for k, v in s.items()})
    res = dict(meta=meta, rows=rows, failures=failures(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(markdown(res) if args.markdown else json.dumps(res["failures"], indent=1))
    for f in res["failures"]:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
