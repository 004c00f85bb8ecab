"""A lent GPU's one command, in at most 5 minutes on one H100 (``bench/gpu.py --lease``, docs/gpu.md).

tests/gpu (``gputests``), the speed rows of ``SPEED``, then the acceptance run's parity rows. No
row starts that its estimate (``COSTS``) says would end past ``--deadline-s``: it is written as
skipped, with why; one still running at ``--hard-s`` is written as cut off and the process exits 1.
Each line goes to ``--out`` (JSON lines) as it ends. ``--peers`` shares this frame.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import pscompile
from harness.output import RESULTS, table

from .acceptance import parity_rows
from .gputests import tests_phase
from .lease_pytest import append
from .rows import DRY, GPU, SYSTEMS, Clock, batches, config, failures, guarded, link_rate, model, params_of, \
    run_plain, run_pscompile

# 8 layers x 2048: wide, so that the kernels are not launch-bound; shallow, because compiling grows
# with depth. 7 steps a speed row: compiled regions run eager in the first two or three.
LEASE = dict(GPU, speed=(8, 2048), steps=5)
TIGHT = 1.15                  # the tight budget: this times compiled mode's minimum
SEARCH_S = 4.0                # a budgeted row's pscompile.min_device_memory first: counted for every one


@dataclass(frozen=True)
class Cost:
    """A row's cost before its steps: ``fixed_s`` (setup, a cold compile) plus ``per_layer_s`` a
    layer (capture, planning and compiling what grows with depth); ``warm_s`` replaces ``fixed_s``
    once a row of the same system ran in this process (its compile caches and workers are warm)."""

    fixed_s: float
    per_layer_s: float
    warm_s: float
    why: str


COSTS = {
    "plain PyTorch": Cost(4, 0.2, 2, "build, move to the device, fused AdamW's first step; nothing compiles"),
    "plain torch.compile": Cost(10, 1.2, 6, "Dynamo and Inductor over the whole model, cold: its first step took "
                                            "27.7 s at 24 layers of 2048 on an H200 (docs/gpu.md, 2026-11-26)"),
    "hooks": Cost(5, 0.6, 3, "a traced forward and backward lays out the chunks; nothing compiles"),
    "compiled eager": Cost(6, 1.5, 4, "capture, plan and first step: 36 s at 24 layers of 2048 on an H200 "
                                      "(docs/gpu.md, 2026-11-26)"),
    "compiled inductor": Cost(40, 2.5, 15, "compiled eager's capture, then a cold Triton compile of each distinct "
                                           "region (identical layers compile once, so it is mostly fixed); not yet "
                                           "measured on a GPU: a guess, generous"),
}
INDUCTOR = ("compiled inductor", "plain torch.compile")
EFFECTIVE_FLOPS = 100e12      # a bf16 GPT step on an H100: a sixth of its dense matmul peak (norms,
                              # attention and pscompile's per-op dispatch run far below it)
LINK_BPS = 20e9               # host <-> device while compute runs: under half the 53.9 GB/s pinned H200 copy
HOST_UPDATE_BPS = 10e9        # the host AdamW of evicted chunks: ~16 bytes read and written a parameter
# most wanted first: the baseline; compiled eager with nothing to move (and the minimum the tight
# rows need); compiled mode as it is meant to run (Inductor, tight); the same with eager regions and
# in hooks mode; then Inductor's own reference and compiled Inductor with no budget
SPEED = (("plain PyTorch", "none"), ("compiled eager", "none"), ("compiled inductor", "tight"),
         ("compiled eager", "tight"), ("hooks", "tight"), ("plain torch.compile", "none"),
         ("compiled inductor", "none"))


@dataclass(frozen=True, eq=False)
class Lease:
    out: Path                 # the results, JSON lines
    device: str               # "cuda", or "cpu" (dry run)
    s: dict                   # shapes and steps: LEASE, or DRY
    inductor: bool            # the Inductor rows run (on CUDA always)
    warm: set = field(default_factory=set)      # systems a row of which ran: their caches are warm
    running: dict = field(default_factory=dict)  # the label of the row that runs now
    start: float = field(default_factory=time.perf_counter)
    wheels: Path | None = None                   # DeepSpeed's wheels, for --peers's row

    @property
    def stacks(self) -> Path:
        return self.out.with_suffix(".stacks.txt")

    def write(self, record: dict) -> None:
        append(self.out, dict(record, t_s=round(time.perf_counter() - self.start, 1)))

    def lines(self, since: int = 0) -> list[dict]:
        with self.out.open() as f:
            f.seek(since)
            return [json.loads(x) for x in f.read().splitlines() if x.strip()]

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32


# ================================================================== estimates

def step_estimate_s(size: tuple[int, int], s: dict, budget: bool) -> float:
    """One step: its FLOPs at EFFECTIVE_FLOPS; under a budget, at least its chunk copies (forward's
    fetches, backward's again, the gradients back) over the link, plus the host's update."""
    params = params_of(size, s)
    compute = 6 * params * s["batch"] * s["seq"] / EFFECTIVE_FLOPS
    if not budget:
        return compute
    return max(compute, 3 * params * 2 / LINK_BPS) + params * 16 / HOST_UPDATE_BPS


def estimate_s(system: str, size: tuple[int, int], s: dict, budget: bool, warm: bool) -> float:
    """A row of ``system`` on a GPT of ``size``: its setup and compile (``COSTS``), then its steps."""
    c = COSTS[system]
    steps = 1 + s["warmup"] + s["steps"]
    return (c.warm_s if warm else c.fixed_s) + c.per_layer_s * size[0] + steps * step_estimate_s(size, s, budget)


# ================================================================== rows

def run_row(lease: Lease, clock: Clock, need_s: float, fn, **label) -> dict:
    """``fn()``'s row if ``need_s`` fits before ``clock``'s end (``rows.guarded``), else a skipped
    one; written to the results and printed either way."""
    system = label["system"]
    if system in INDUCTOR and not lease.inductor:
        row = dict(label, skipped="dry run without --inductor")
    else:
        lease.running.update(label)
        row = guarded(clock, need_s, fn, **label)
        lease.running.clear()
    row["estimate_s"] = round(need_s, 1)
    if "steps" in row:
        lease.warm.add(system)
    record(lease, row, shown="steps" in row or "error" in row)       # guarded printed those
    gc.collect()
    if lease.device == "cuda":
        torch.cuda.empty_cache()
    return row


def record(lease: Lease, row: dict, shown: bool = False) -> dict:
    """``row`` to the results, and printed as one line unless it was already."""
    if not shown:
        print(f"[{'skipped' if 'skipped' in row else 'row'}] {json.dumps(row, default=str)}", file=sys.stderr,
              flush=True)
    lease.write(dict(kind="row", **row))
    return row


def summarized(row: dict, budget: int | None, warmup: int) -> dict:
    """``row`` with its step time, its peaks against ``budget`` and the last step's operator counts.
    Compiled mode runs its first steps' regions as eager code (probing, measuring; pscompile/compiled/
    probe.py): ``step_s`` is the median of the steps after the warmup that ran as many operators
    compiled as the last one, from ``settled_step`` on."""
    steps = row["steps"]
    ops = [r.get("compiled_ops") or 0 for r in steps]
    settled = ops.index(ops[-1])
    timed = steps[max(1 + warmup, settled):] or steps[-1:]
    allocator = max((r.get("allocator_peak") or 0 for r in steps), default=0) or None
    row.update(step_s=statistics.median(r["time_s"] for r in timed), settled_step=settled, budget=budget,
               allocator_peak_max=allocator,
               peak_max=max((r.get("peak") or 0 for r in steps), default=0) or None,
               **{k: steps[-1].get(k) for k in ("compute_ops", "compiled_ops", "compiled_share")})
    if budget is not None:
        row["over_budget_bytes"] = max(0, max(row["peak_max"] or 0, allocator or 0) - budget)
    return row


def plain(lease: Lease, data, compiled: bool) -> dict:
    """The plain PyTorch (or ``torch.compile``) row, with the allocator's peak over its steps (CUDA)."""
    row = run_plain(lease.s["speed"], data, lease.s, lease.device, lease.dtype, compiled)
    return dict(summarized(row, None, lease.s["warmup"]), first_s=row["steps"][0]["time_s"])


def ours(lease: Lease, system: str, data, rate: float, budget: int | None, extra: dict | None = None) -> dict:
    """A pscompile row (``extra``: more Config fields), with ``transfer_s`` (the last step's bytes over
    the link's rate) and ``busier_bytes`` (its busier direction's)."""
    s = lease.s
    make = lambda: pscompile.compile(model(s["speed"], s), data[0], config=config(         # noqa: E731
        lease.device, lease.dtype, budget, system, s["chunk"], **(extra or {})))
    row = summarized(run_pscompile(make, data, lease.device, budget), budget, s["warmup"])
    last = row["steps"][-1]
    return dict(row, transfer_s=last["moved"] / rate, busier_bytes=max(last["h2d"], last["d2h"]), rate=rate)


def minimum(lease: Lease, system: str, rows: list[dict], data) -> int:
    """The system's minimum. Compiled mode plans it on fake tensors, the same for both backends: the
    no-budget compiled eager row's, or computed here; hooks mode's is its own."""
    s = lease.s
    base = "hooks" if system == "hooks" else "compiled eager"
    known = [r["min_device_memory"] for r in rows if r["system"] == base and "min_device_memory" in r]
    return known[0] if known else pscompile.min_device_memory(
        model(s["speed"], s), data[0], config(lease.device, lease.dtype, None, base, s["chunk"]))


def speed_phase(lease: Lease, clock: Clock, rate: float, plan=SPEED) -> list[dict]:
    s = lease.s
    data = batches(s, 1 + s["warmup"] + s["steps"])
    rows: list[dict] = []
    for system, bname in plan:
        limited = bname == "tight"
        need = SEARCH_S * limited + estimate_s(system, s["speed"], s, limited, system in lease.warm)
        if system.startswith("plain"):
            fn = lambda: plain(lease, data, system == "plain torch.compile")        # noqa: E731
        else:
            fn = lambda: ours(lease, system, data, rate,                              # noqa: E731
                              int(minimum(lease, system, rows, data) * TIGHT) if limited else None)
        rows.append(run_row(lease, clock, need, fn, section="speed", system=system, budget_name=bname))
    return rows


def parity_phase(lease: Lease, clock: Clock) -> list[dict]:
    """The acceptance run's parity rows, each written as it ends; Inductor's skipped on a dry run without it."""
    s = lease.s
    systems = [n for n in SYSTEMS if n not in INDUCTOR or lease.inductor]

    def need(name: str) -> float:              # asked just before the row starts (if it fits)
        lease.running.update(section="parity", system=name)
        return SEARCH_S + estimate_s(name, s["parity"], s, True, name in lease.warm)

    def emit(row: dict) -> None:
        row["estimate_s"] = round(need(row["system"]), 1)
        lease.running.clear()
        if "steps" in row:
            lease.warm.add(row["system"])
            summarized(row, row["budget"], 0)
            print(f"[parity] {row['system']} {row['dtype']}: max rel loss {row['max_rel_loss']:.1e}, "
                  f"over budget {row['over_budget_bytes']} B, compiled share {row['compiled_share']}",
                  file=sys.stderr, flush=True)
        record(lease, row, shown="skipped" not in row)

    cheapest = min(SEARCH_S + estimate_s(n, s["parity"], s, True, n in lease.warm) for n in systems)
    if clock.left() < cheapest:                 # not even the plain PyTorch references are worth running
        rows = skipped_parity(lease, systems, f"deadline: {clock.left():.0f} s left, the cheapest row needs "
                                              f"~{cheapest:.0f} s")
    else:
        rows = parity_rows(s, lease.device, systems, clock, need=need, emit=emit)
    return rows + skipped_parity(lease, [n for n in SYSTEMS if n not in systems], "dry run without --inductor")


def skipped_parity(lease: Lease, systems: list[str], why: str) -> list[dict]:
    return [record(lease, dict(section="parity", system=n, dtype=d, skipped=why))
            for d in ("float32", "bfloat16") for n in systems]


# ================================================================== the frame of a timed command

def arguments(prog: str, doc: str, name: str, deadline_s: float, hard_s: float) -> argparse.ArgumentParser:
    """The flags a timed GPU command shares (this one, ``--peers``); ``--out``: results/NAME.jsonl."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="all of it on the CPU with tiny shapes")
    ap.add_argument("--inductor", action="store_true", help="dry run: also the Inductor rows (slow on a CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.jsonl", help="the results, JSON lines")
    ap.add_argument("--deadline-s", type=float, default=deadline_s, help="no row starts that would end later")
    ap.add_argument("--hard-s", type=float, default=hard_s,
                    help="a row still running then is written as cut off, and the process ends")
    return ap


def start(args, prog: str, settings: dict = LEASE, dry: dict = DRY, costs: dict = COSTS,
          **lease_kw) -> tuple[Lease, Clock] | None:
    """None (said why) with no CUDA here and no ``--dry-run``; else the deadline's clock and the
    Lease (``settings`` on CUDA, ``dry`` on a dry run, which gets one torch thread), its results file
    emptied and its ``meta`` line written."""
    if not args.dry_run and not torch.cuda.is_available():
        print(f"{prog}: no CUDA device here; add --dry-run to run it on the CPU", file=sys.stderr)
        return None
    if args.dry_run:
        torch.set_num_threads(1)
    clock = Clock(args.deadline_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    lease = Lease(args.out, "cpu" if args.dry_run else "cuda", dict(dry if args.dry_run else settings),
                  inductor=not args.dry_run or args.inductor, **lease_kw)
    lease.stacks.write_text("")
    lease.write(dict(kind="meta", torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"), dry_run=args.dry_run,
                     device=torch.cuda.get_device_name(0) if lease.device == "cuda" else "CPU (dry run)",
                     args=vars(args), settings=lease.s, host_threads=torch.get_num_threads(),
                     costs={k: asdict(c) for k, c in costs.items()}))
    return lease, clock


def watchdog(lease: Lease, args, clock: Clock) -> threading.Timer:
    """The hard limit, ``--hard-s`` after the run began: the running row is written as cut off, every
    thread's stack dumped, the process ended."""
    def abort() -> None:
        row = dict(lease.running or dict(section="lease", system="between rows"),
                   error=f"cut off: still running at the hard limit of {args.hard_s:.0f} s (stacks in "
                         f"{lease.stacks.name})")
        record(lease, row)
        with lease.stacks.open("a") as f:
            faulthandler.dump_traceback(file=f)
        lease.write(dict(kind="end", failures=[f"{row['section']} {row['system']}: {row['error']}"]))
        sys.stdout.flush()
        os._exit(1)
    timer = threading.Timer(args.hard_s - (args.deadline_s - clock.left()), abort)
    timer.daemon = True
    timer.start()
    return timer


def link(lease: Lease) -> float:
    """The pinned-copy rate, written as the ``link`` line."""
    lease.running.update(section="link", system="the pinned-copy rate")
    rate = link_rate(lease.device)
    lease.running.clear()
    lease.write(dict(kind="link", GBps=rate / 1e9))
    return rate


def finish(lease: Lease, failed: list[str], summary: str) -> int:
    """The ``end`` line, the summary, each failure on stderr; the exit status."""
    lease.write(dict(kind="end", failures=failed))
    print(summary)
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


# ================================================================== the command

def result(row: dict) -> str:
    if "skipped" in row or "error" in row:
        return row.get("skipped") or row["error"]
    return f"{row['max_rel_loss']:.1e}" if row["section"] == "parity" else f"{row['step_s']:.3f}"


def summary(tests: list[dict], rows: list[dict]) -> str:
    bad = [[t["test"], t["outcome"], t.get("error") or ""] for t in tests if t["outcome"] not in ("passed", "skipped")]
    counts = collections.Counter(t["outcome"] for t in tests)
    rows = [[r["section"], r["system"], r.get("budget_name") or r.get("dtype"), result(r),
             r.get("first_s") and f"{r['first_s']:.1f}", r.get("allocator_peak_max"), r.get("budget"),
             r.get("compiled_share")] for r in rows]
    return "\n\n".join([
        "tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        table(bad, ["test", "outcome", "first error line"]) if bad else "no test failed",
        table(rows, ["section", "system", "budget / dtype", "step s / max rel loss", "first s", "allocator peak",
                     "budget", "compiled share"])])


def main(argv=None) -> int:
    ap = arguments("bench/gpu.py --lease", __doc__, "lease", 270.0, 290.0)
    ap.add_argument("--tests-s", type=float, default=100.0, help="the tests phase's limit")
    ap.add_argument("--test-s", type=float, default=60.0, help="one test's limit")
    ap.add_argument("--parity-s", type=float, default=45.0,
                    help="the time the speed rows leave before the deadline, for the parity rows (float32's: ~45 s)")
    args = ap.parse_args(argv)
    if (started := start(args, "bench/gpu.py --lease")) is None:
        return 2
    lease, clock = started
    tests = tests_phase(lease, min(args.tests_s, clock.left()), args.test_s)
    timer = watchdog(lease, args, clock)
    rate = link(lease)
    rows = speed_phase(lease, Clock(clock.left() - args.parity_s), rate)
    rows += parity_phase(lease, clock)
    timer.cancel()
    failed = [f"test {t['test']}: {t.get('error')}" for t in tests if t["outcome"] in ("failed", "error")]
    return finish(lease, failed + failures(rows), summary(tests, rows))
