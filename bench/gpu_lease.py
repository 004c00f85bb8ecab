"""The lease: the one command to run when a GPU is lent, in at most 5 minutes on one H100.

    python bench/gpu.py --lease [--dry-run [--inductor]] [--out bench/results/lease.jsonl]
        [--deadline-s 270] [--hard-s 290] [--tests-s 100] [--test-s 60] [--parity-s 45]

In this order, no row started that its estimate says would end past the deadline:

1. **tests/gpu**, in a pytest subprocess (``-o addopts=``: one process, whether or not pytest-xdist
   is installed). bench/lease_pytest.py writes each test's outcome and first error line as the
   test ends. A test that runs past ``--test-s`` (or the phase's end) is stopped by ``faulthandler``
   (the threads' stacks go to ``<out>.stacks.txt``) and recorded as failed; pytest starts again on
   the tests left while the phase has time. At most ``--tests-s``.
2. **Speed**, on a GPT of 8 layers x 2048, bfloat16, batch 4 x 512, vocabulary 8192 (420M
   parameters). Wide, so that the kernels are not launch-bound: a layer's matmuls are 17-69 GFLOP
   (30-120 us on an H100, against ~5 us a launch) and its elementwise kernels read 8-32 MiB each;
   12 layers of 1024 would have 4x smaller kernels, the norms' ~2 us ones launch-bound. Shallow,
   because the compile cost grows with depth (capture, planning, Dynamo: 1-1.5 s a layer, measured
   at 24 layers), so torch.compile and compiled eager compile in ~15-20 s and compiled Inductor in
   about a minute. The rows, most wanted first, are ``SPEED``; the tight budget is 1.15x the
   system's ``min_device_memory``. They leave ``--parity-s`` before the deadline to the parity rows.
3. **Parity**: bench/gpu.py's parity rows (hooks, compiled eager and compiled Inductor against
   plain PyTorch, float32 and bfloat16, under a budget that moves chunks every step), until the
   deadline.

A row starts only if its estimate (``COSTS``: a cost per row kind, with its reason, scaled by the
model's layers and step) fits in the time its phase leaves; otherwise it is
written as skipped, with why. A row still running at ``--hard-s`` is written as cut off (stacks
to ``<out>.stacks.txt``) and the process exits 1 at once.

Everything goes to ``--out`` as JSON lines, each flushed as it ends: ``meta``, ``collected`` (the
tests in the order they run), ``test`` (one a test), ``link``, ``row`` (one a row: ``budget``,
``peak_max``, ``allocator_peak_max``, ``over_budget_bytes``, ``compute_ops``, ``compiled_ops``,
``compiled_share``, ``step_s``, ``first_s``, ``estimate_s``, or ``skipped`` / ``error``) and
``end``. Every row and test is also printed as one line. The exit status is 1 when a test or a row
failed. ``--dry-run`` runs it all on the CPU with tiny shapes (tests/gpu skips there; the Inductor
rows are skipped unless ``--inductor``).
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

import gpu
import pscompile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "lease.jsonl"
LEASE = dict(gpu.GPU, speed=(8, 2048), steps=5)    # 7 steps a speed row: compiled regions run eager in the
                                                   # first two or three, and 3+ steps are left to time
TIGHT = 1.15                  # the tight budget: this times compiled mode's minimum
RESTART_MIN_S = 20.0          # a new pytest process on the tests left needs this much of the phase:
                              # python, torch, CUDA's context and the first test's model (~10 s)
SEARCH_S = 4.0                # a budgeted row's pscompile.min_device_memory first (hooks mode traces a
                              # forward and backward per chunk size it tries; compiled mode plans on fake
                              # tensors, or reads the no-budget row's): counted for every budgeted row


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
# most wanted first: the baseline; compiled eager with nothing to move (docs/gpu.md's 17x, and the
# minimum the tight rows need, at the cost of a capture); compiled mode as it is meant to run
# (Inductor, tight; its compiled share says whether regions fell back to eager code); the same with
# eager regions and in hooks mode; then Inductor's own reference and compiled Inductor with no budget
SPEED = (("plain PyTorch", "none"), ("compiled eager", "none"), ("compiled inductor", "tight"),
         ("compiled eager", "tight"), ("hooks", "tight"), ("plain torch.compile", "none"),
         ("compiled inductor", "none"))


@dataclass(frozen=True, eq=False)
class Lease:
    out: Path                 # the results, JSON lines
    device: str               # "cuda", or "cpu" (dry run)
    s: dict                   # shapes and steps: LEASE, or gpu.DRY
    inductor: bool            # the Inductor rows run (on CUDA always)
    warm: set = field(default_factory=set)      # systems a row of which ran: their caches are warm
    running: dict = field(default_factory=dict)  # the label of the row that runs now
    start: float = field(default_factory=time.perf_counter)
    wheels: Path | None = None                   # DeepSpeed's wheels, for bench/gpu_peers.py's row

    @property
    def stacks(self) -> Path:
        return self.out.with_suffix(".stacks.txt")

    def write(self, record: dict) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps(dict(record, t_s=round(time.perf_counter() - self.start, 1)), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def lines(self, since: int = 0) -> list[dict]:
        with self.out.open() as f:
            f.seek(since)
            return [json.loads(x) for x in f.read().splitlines() if x.strip()]


# ================================================================== estimates

def step_estimate_s(size: tuple[int, int], s: dict, budget: bool) -> float:
    """One step: its FLOPs at EFFECTIVE_FLOPS; under a budget, at least its chunk copies (forward's
    fetches, backward's again, the gradients back) over the link, plus the host's update."""
    params = gpu.gpt_config(size, s).num_params()
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

def run_row(lease: Lease, clock: gpu.Clock, need_s: float, fn, **label) -> dict:
    """``fn()``'s row if ``need_s`` fits before ``clock``'s end (bench/gpu.py's ``guarded``), else a
    skipped one; written to the results and printed either way."""
    system = label["system"]
    if system in INDUCTOR and not lease.inductor:
        row = dict(label, skipped="dry run without --inductor")
    else:
        lease.running.update(label)
        row = gpu.guarded(clock, need_s, fn, **label)
        lease.running.clear()
    row["estimate_s"] = round(need_s, 1)
    if "steps" in row:
        lease.warm.add(system)
    record(lease, row, shown="steps" in row or "error" in row)       # guarded printed those
    gc.collect()
    if lease.device == "cuda":
        torch.cuda.empty_cache()
    return row


def record(lease: Lease, row: dict, shown: bool = False) -> None:
    """``row`` to the results, and printed as one line unless it was already."""
    if not shown:
        print(f"[{'skipped' if 'skipped' in row else 'row'}] {json.dumps(row, default=str)}", file=sys.stderr,
              flush=True)
    lease.write(dict(kind="row", **row))


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


def plain(lease: Lease, data, dtype, compiled: bool) -> dict:
    """bench/gpu.py's plain row, with the allocator's peak over its steps (CUDA)."""
    if lease.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    row = gpu.run_plain(lease.s["speed"], data, lease.s, lease.device, dtype, compiled)
    if lease.device == "cuda":
        row["steps"][-1]["allocator_peak"] = torch.cuda.max_memory_allocated()
    return dict(summarized(row, None, lease.s["warmup"]), first_s=row["steps"][0]["time_s"])


def ours(lease: Lease, system: str, data, dtype, rate: float, budget: int | None) -> dict:
    """bench/gpu.py's pscompile row, with ``transfer_s``: the last step's bytes over the link's rate."""
    s = lease.s
    make = lambda: pscompile.compile(gpu.model(s["speed"], s), data[0],            # noqa: E731
                                     config=gpu.config(lease.device, dtype, budget, system, s["chunk"]))
    row = summarized(gpu.run_pscompile(make, data, lease.device, budget), budget, s["warmup"])
    return dict(row, transfer_s=row["steps"][-1]["moved"] / rate)


def minimum(lease: Lease, system: str, rows: list[dict], data, dtype) -> int:
    """The system's minimum. Compiled mode plans it on fake tensors, the same for both backends: the
    no-budget compiled eager row's, or computed here; hooks mode's is its own."""
    s = lease.s
    base = "hooks" if system == "hooks" else "compiled eager"
    known = [r["min_device_memory"] for r in rows if r["system"] == base and "min_device_memory" in r]
    return known[0] if known else pscompile.min_device_memory(
        gpu.model(s["speed"], s), data[0], gpu.config(lease.device, dtype, None, base, s["chunk"]))


def tight(lease: Lease, system: str, rows: list[dict], data, dtype) -> int:
    """TIGHT x the system's minimum."""
    return int(minimum(lease, system, rows, data, dtype) * TIGHT)


def speed_phase(lease: Lease, clock: gpu.Clock, rate: float, plan=SPEED) -> list[dict]:
    s = lease.s
    dtype = torch.bfloat16 if lease.device == "cuda" else torch.float32
    data = gpu.batches(s, 1 + s["warmup"] + s["steps"])
    rows: list[dict] = []
    for system, bname in plan:
        limited = bname == "tight"
        need = SEARCH_S * limited + estimate_s(system, s["speed"], s, limited, system in lease.warm)
        if system.startswith("plain"):
            fn = lambda: plain(lease, data, dtype, system == "plain torch.compile")        # noqa: E731
        else:
            fn = lambda: ours(lease, system, data, dtype, rate,                                 # noqa: E731
                              tight(lease, system, rows, data, dtype) if limited else None)
        rows.append(run_row(lease, clock, need, fn, section="speed", system=system, budget_name=bname))
    return rows


def parity_phase(lease: Lease, clock: gpu.Clock) -> list[dict]:
    """bench/gpu.py's parity rows, each written as it ends; Inductor's skipped on a dry run without it."""
    s = lease.s
    systems = [n for n in gpu.SYSTEMS if n not in INDUCTOR or lease.inductor]

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
        rows = gpu.parity_rows(s, lease.device, systems, clock, need=need, emit=emit)
    return rows + skipped_parity(lease, [n for n in gpu.SYSTEMS if n not in systems], "dry run without --inductor")


def skipped_parity(lease: Lease, systems: list[str], why: str) -> list[dict]:
    rows = [dict(section="parity", system=n, dtype=d, skipped=why) for d in ("float32", "bfloat16") for n in systems]
    for r in rows:
        record(lease, r)
    return rows


# ================================================================== tests

def pytest_once(lease: Lease, targets: list[str], end: float, test_s: float, cwd: Path) -> tuple[int, list[str]]:
    """One pytest process on ``targets``, its output echoed; its exit status and last lines."""
    env = dict(os.environ, PSCOMPILE_LEASE_RESULTS=str(lease.out), PSCOMPILE_LEASE_STACKS=str(lease.stacks),
               PSCOMPILE_LEASE_END=str(end), PSCOMPILE_LEASE_TEST_S=str(test_s),
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if lease.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=",
           "-p", "lease_pytest", *targets]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque = collections.deque(maxlen=200)
    pump = threading.Thread(target=echo, args=(proc.stdout, tail), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=max(1.0, end - time.time()) + 15)      # faulthandler stops it first
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    pump.join(timeout=5)
    return rc, list(tail)


def echo(stream, tail) -> None:
    for line in stream:
        print(line.rstrip("\n"), flush=True)
        tail.append(line.rstrip())


def first_frame(stacks: str) -> str:
    """The innermost frame of this repository in the test's thread (the one running pytest) of a
    faulthandler dump (threads one after another, each most recent call first)."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)
    main = [s for s in threads if "_pytest" in s] or threads
    mine = [x.strip() for x in main[-1].splitlines() if str(ROOT) in x and "site-packages" not in x]
    return mine[0].replace(str(ROOT) + os.sep, "") if mine else "no frame of this repository"


def missing_reason(lease: Lease, rc: int, tail: list[str], stacks: str, end: float, test_s: float) -> str:
    if stacks.strip():
        limit = "the tests phase's end" if time.time() >= end - 2 else f"its limit of {test_s:.0f} s"
        return f"stopped: ran past {limit} (stacks in {lease.stacks.name}); innermost: {first_frame(stacks)}"
    fatal = [x[x.index("Fatal"):] for x in tail if "Fatal Python error" in x] or tail[-1:] or ["no output"]
    return f"the pytest process ended (exit status {rc}) while it ran: {fatal[0]}"


def tests_phase(lease: Lease, limit_s: float, test_s: float, targets=("tests/gpu",), cwd: Path = ROOT) -> list[dict]:
    """Runs ``targets`` until each test has a line; a test that hangs or kills pytest gets one here,
    and pytest starts again on the tests after it while the phase has RESTART_MIN_S left."""
    end = time.time() + limit_s
    pending, out = list(targets), []
    lease.stacks.touch()
    while pending:
        since, stacks_at = lease.out.stat().st_size, lease.stacks.stat().st_size
        rc, tail = pytest_once(lease, pending, end, test_s, cwd)
        new = lease.lines(since)
        out += [r for r in new if r["kind"] == "test"]
        collected = [t for r in new if r["kind"] == "collected" for t in r["tests"]]
        if not collected and not any(r["kind"] == "test" for r in new):
            return out + [account(lease, " ".join(pending), "error",
                                  f"pytest collected nothing (exit status {rc}): {tail[-1] if tail else ''}")]
        done = {r["test"] for r in out}
        missing = [t for t in collected if t not in done]
        if not missing:
            break
        stacks = lease.stacks.read_bytes()[stacks_at:].decode(errors="replace")
        out.append(account(lease, missing[0], "failed", missing_reason(lease, rc, tail, stacks, end, test_s)))
        pending = missing[1:]
        if pending and end - time.time() < RESTART_MIN_S:
            why = (f"the tests phase had {end - time.time():.0f} s left, under the {RESTART_MIN_S:.0f} s a new "
                   "pytest process needs")
            return out + [account(lease, t, "not run", why) for t in pending]
    return out


def account(lease: Lease, test: str, outcome: str, error: str) -> dict:
    """A test's line that pytest could not write (it was stopped, or died, or never started)."""
    line = dict(kind="test", test=test, outcome=outcome, error=error, duration_s=None)
    lease.write(line)
    print(f"[test] {outcome}: {test}: {error}", flush=True)
    return line


# ================================================================== the command

def result(row: dict) -> str:
    if "skipped" in row or "error" in row:
        return row.get("skipped") or row["error"]
    return f"{row['max_rel_loss']:.1e}" if row["section"] == "parity" else f"{row['step_s']:.3f}"


def summary(tests: list[dict], rows: list[dict]) -> str:
    bad = [[t["test"], t["outcome"], t.get("error") or ""] for t in tests if t["outcome"] not in ("passed", "skipped")]
    counts = collections.Counter(t["outcome"] for t in tests)
    table = [[r["section"], r["system"], r.get("budget_name") or r.get("dtype"), result(r),
              r.get("first_s") and f"{r['first_s']:.1f}", r.get("allocator_peak_max"), r.get("budget"),
              r.get("compiled_share")] for r in rows]
    return "\n\n".join([
        "tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
        tabulate(bad, ["test", "outcome", "first error line"], "github") if bad else "no test failed",
        tabulate(table, ["section", "system", "budget / dtype", "step s / max rel loss", "first s",
                         "allocator peak", "budget", "compiled share"], "github")])


def arguments(prog: str, doc: str, out: Path, deadline_s: float, hard_s: float) -> argparse.ArgumentParser:
    """The flags a timed GPU command shares (this one, bench/gpu_peers.py)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="all of it on the CPU with tiny shapes")
    ap.add_argument("--inductor", action="store_true", help="dry run: also the Inductor rows (slow on a CPU)")
    ap.add_argument("--out", type=Path, default=out, help="the results, JSON lines")
    ap.add_argument("--deadline-s", type=float, default=deadline_s, help="no row starts that would end later")
    ap.add_argument("--hard-s", type=float, default=hard_s,
                    help="a row still running then is written as cut off, and the process ends")
    return ap


def parse(argv) -> argparse.Namespace:
    ap = arguments("bench/gpu.py --lease", __doc__, DEFAULT_OUT, 270.0, 290.0)
    ap.add_argument("--tests-s", type=float, default=100.0, help="the tests phase's limit")
    ap.add_argument("--test-s", type=float, default=60.0, help="one test's limit")
    ap.add_argument("--parity-s", type=float, default=45.0,
                    help="the time the speed rows leave before the deadline, for the parity rows (float32's: ~45 s)")
    return ap.parse_args(argv)


def abort(lease: Lease, hard_s: float) -> None:
    """The hard limit: the running row is written as cut off, every thread's stack dumped, the process ended."""
    row = dict(lease.running or dict(section="lease", system="between rows"),
               error=f"cut off: still running at the hard limit of {hard_s:.0f} s (stacks in {lease.stacks.name})")
    record(lease, row)
    with lease.stacks.open("a") as f:
        faulthandler.dump_traceback(file=f)
    lease.write(dict(kind="end", failures=[f"{row['section']} {row['system']}: {row['error']}"]))
    sys.stdout.flush()
    os._exit(1)


def start(args, settings: dict = LEASE, dry: dict = gpu.DRY, costs: dict = COSTS, **lease_kw) -> Lease:
    """The results file emptied, the Lease, and its ``meta`` line (``settings`` on CUDA, ``dry`` on a
    dry run)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    lease = Lease(args.out, "cpu" if args.dry_run else "cuda", dict(dry if args.dry_run else settings),
                  inductor=not args.dry_run or args.inductor, **lease_kw)
    lease.stacks.write_text("")
    lease.write(dict(kind="meta", torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"), dry_run=args.dry_run,
                     device=torch.cuda.get_device_name(0) if lease.device == "cuda" else "CPU (dry run)",
                     args=vars(args), settings=lease.s, host_threads=torch.get_num_threads(),
                     costs={k: asdict(c) for k, c in costs.items()}))
    return lease


def refused(args, prog: str) -> bool:
    """No CUDA here and no ``--dry-run``: says so; otherwise a dry run gets one torch thread."""
    if not args.dry_run and not torch.cuda.is_available():
        print(f"{prog}: no CUDA device here; add --dry-run to run it on the CPU", file=sys.stderr)
        return True
    if args.dry_run:
        torch.set_num_threads(1)
    return False


def main(argv=None) -> int:
    args = parse(argv)
    if refused(args, "bench/gpu.py --lease"):
        return 2
    clock = gpu.Clock(args.deadline_s)
    lease = start(args)
    tests = tests_phase(lease, min(args.tests_s, clock.left()), args.test_s)
    watchdog = threading.Timer(args.hard_s - (args.deadline_s - clock.left()), abort, (lease, args.hard_s))
    watchdog.daemon = True
    watchdog.start()
    lease.running.update(section="link", system="the pinned-copy rate")
    rate = gpu.link_rate(lease.device)
    lease.running.clear()
    lease.write(dict(kind="link", GBps=rate / 1e9))
    rows = speed_phase(lease, gpu.Clock(clock.left() - args.parity_s), rate)
    rows += parity_phase(lease, clock)
    watchdog.cancel()
    failed = [f"test {t['test']}: {t.get('error')}" for t in tests if t["outcome"] in ("failed", "error")]
    failed += gpu.failures(rows)
    lease.write(dict(kind="end", failures=failed))
    print(summary(tests, rows))
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
