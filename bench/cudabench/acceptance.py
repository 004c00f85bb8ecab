"""The acceptance run (``python bench/gpu.py``, docs/gpu.md): parity under a budget that evicts every
step, step time at no, a middle and a tight budget, and each row's overlap ratio. On a dry run the
peaks are pscompile's own accounting and the link rate is the host's memcpy."""

from __future__ import annotations

import json
import sys
import time

import torch

import pscompile
from harness.output import parser, table, write_json
from pscompile.units import format_bytes

from .rows import DRY, GPU, SYSTEMS, Clock, batches, config, failures, guarded, link_rate, model, run_plain, \
    run_pscompile, step_time


def minimum_and_full(size, data, s: dict, device: str, dtype) -> tuple[int, int]:
    """compiled mode's minimum budget, and the device bytes of a run with no budget."""
    cfg = config(device, dtype, None, "compiled eager", s["chunk"])
    engine = pscompile.compile(model(size, s), data[0], config=cfg)
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
            row = guarded(clock, 90, lambda: run_pscompile(lambda: pscompile.compile(
                model(s["speed"], s), data[0], config=config(device, dtype, budget, name, s["chunk"])),
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
        table(parity, ["parity", "dtype", "budget", "max rel loss diff", "peak (ours)", "peak (allocator)"]),
        table(speed, ["speed", "budget", "bytes", "step s", "overlap ratio"])])


def main(argv, doc: str) -> int:
    """The acceptance run; ``doc``: bench/gpu.py's, whose ``--lease`` and ``--peers`` are listed here."""
    ap = parser(doc, "gpu", markdown=True, quick="a short lease: speed rows for hooks and compiled eager on 12 "
                                                 "layers (not 24) at no and a tight budget")
    ap.add_argument("--lease", action="store_true",
                    help="the one command of a lent GPU (tests/gpu, then speed and parity rows, in at most 5 "
                         "minutes): cudabench/lease.py, whose flags follow (--lease --help lists them)")
    ap.add_argument("--peers", action="store_true",
                    help="pscompile against FSDP2 + CPU offload, DeepSpeed ZeRO-3 offload and plain torch.compile on "
                         "one GPU (about 8 minutes): cudabench/versus.py, whose flags follow (--peers --help lists "
                         "them)")
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU with tiny shapes")
    ap.add_argument("--inductor", action="store_true", help="dry run: also the Inductor rows (slow on a CPU)")
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
                device_bytes=device_bytes, settings=s)
    res = dict(meta=meta, rows=rows, failures=failures(rows))
    write_json(args.out, res)
    print(markdown(res) if args.markdown else json.dumps(res["failures"], indent=1))
    for f in res["failures"]:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if res["failures"] else 0
