"""pscompile against what a user would pick instead, on one GPU: one command, rows in order of value.

    python bench/gpu.py --peers [--dry-run [--inductor]] [--out bench/results/peers.jsonl]
        [--deadline-s 450] [--hard-s 480]

The same GPT (bench/gpu_lease.py's: 8 layers x 2048, bfloat16, batch 4 x 512, vocabulary 8192;
420M parameters), the same batches and the same device memory for every system. The cap is
``max(1.15 x compiled mode's minimum, a quarter of the model data)``: pscompile's budget, and for a
peer, which has no budget of its own, the CUDA allocator's limit
(``torch.cuda.set_per_process_memory_fraction``). Most wanted first (``PLAN``, then the ladder,
then ``AB``):

1. plain PyTorch with no cap (the reference losses and the compute-bound step);
2. pscompile compiled + Inductor under the cap;
3. FSDP2 + ``CPUOffloadPolicy`` (one rank, NCCL, its AdamW on the host) under the cap;
4. plain ``torch.compile`` and compiled + Inductor with no cap (the first step's cost of each too);
5. DeepSpeed ZeRO-3 with offload, where ``import deepspeed`` works (skipped with the reason if not);
6. capacity: the largest GPT of a ladder each system trains (two steps) under one eighth of the
   GPU, until ``--ab-s`` before the deadline;
7. what only a GPU decides, each an A/B against row 2: ``overlap_update=True`` (which also fetches
   the next step's first chunks across the step boundary, ``plan_lookahead``), ``pinned_host=False``,
   and the host AdamW on one thread less (``optimizer_threads``) beside the copy streams.

Per row: ``step_s`` (median of the settled steps), tokens/s, TFLOP/s (6 x parameters x tokens /
step) and the fraction of the GPU's bf16 peak, the allocator's and pscompile's peaks against the
cap, host memory (the process's peak resident bytes over the row), the first step's time, and the
largest relative loss difference from plain PyTorch (``tracks``: within 5e-2 in bf16, 1e-4 in
fp32, so a fast wrong row cannot win). pscompile rows add the overlap ratio: step / max(the same
system's no-cap step, the busier direction's bytes / the measured pinned-copy rate). After the
rows, ``decision`` lines compare each A/B pair (``DECIDE``).

Each row is written to ``--out`` (JSON lines, bench/gpu_lease.py's format) and printed as it ends;
no row starts that its estimate says would end past ``--deadline-s``, and one still running at
``--hard-s`` is written as cut off and the process exits 1. ``--dry-run`` runs it all on the CPU
with tiny shapes: FSDP2 on gloo over a CPU mesh, no cap enforced for a peer (the CPU has no
allocator limit), the Inductor rows skipped unless ``--inductor``, the A/B rows on compiled eager
instead, and the times mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch
from tabulate import tabulate

import gpu
import gpu_lease
import peers
import pscompile
from gpu_lease import Cost, Lease, estimate_s, run_row, step_estimate_s, summarized

DEFAULT_OUT = gpu_lease.ROOT / "bench" / "results" / "peers.jsonl"
SETTINGS = dict(gpu_lease.LEASE, steps=4,
                ladder=[(8, 2048), (16, 2048), (32, 2048), (16, 4096), (24, 4096)])   # to 4.9B parameters:
                # ~70 GB of host model data (14 bytes a parameter) plus the fp32 model built first
DRY = dict(gpu.DRY, steps=3, ladder=[(1, 64), (2, 128), (8, 512)])    # (the third does not fit 8 MiB)
HP = pscompile.AdamW(lr=1e-3)
TOL = {"float32": 1e-4, "bfloat16": 5e-2}
FSDP2, DEEPSPEED = "FSDP2 + CPU offload", "DeepSpeed ZeRO-3 offload"
COSTS = dict(gpu_lease.COSTS, **{
    FSDP2: Cost(8, 0.3, 4, "one-rank NCCL group, fully_shard per block, host-pinned fp32 shards; nothing "
                           "compiles; not yet measured on a GPU: a guess"),
    DEEPSPEED: Cost(60, 0.5, 20, "DeepSpeedCPUAdam's JIT build (minutes the first time, cached after) and "
                                 "ZeRO-3's partitioning; not yet measured on a GPU: a guess"),
})
HOST_TORCH_ADAMW_BPS = 3e9     # torch.optim.AdamW (foreach) over fp32 host parameters: FSDP2's update
# (system, budget, extra Config fields): most wanted first; "main" is compiled + Inductor (on a dry
# run without --inductor: compiled eager)
PLAN = (("plain PyTorch", "none", {}), ("main", "cap", {}), (FSDP2, "cap", {}),
        ("plain torch.compile", "none", {}), ("main", "none", {}), (DEEPSPEED, "cap", {}))
# after the capacity ladder: what only a GPU decides, each against ("main", "cap", {})
AB = (("main", "cap", {"overlap_update": True}), ("main", "cap", {"pinned_host": False}),
      ("main", "cap", {"optimizer_threads": "one less"}))
# an A/B pair's verdict: the variant's step over the default's; under LOWER it wins, over HIGHER it
# loses, between them the two are within the noise of a few steps and the default stays
LOWER, HIGHER = 0.97, 1.03
CAPACITY = ("compiled eager", FSDP2, "plain PyTorch")


def model_bytes(params: int, dtype: torch.dtype) -> int:
    """Model data as pscompile counts it: compute-dtype parameters, fp32 masters and two Adam states."""
    return params * (torch.empty((), dtype=dtype).element_size() + 12)


def params_of(size, s: dict) -> int:
    """The GPT's parameters, from its config (building a 420M-parameter model to count them costs seconds)."""
    return gpu.gpt_config(size, s).num_params()


def peer_estimate_s(system: str, size, s: dict, warm: bool) -> float:
    """A peer's row: setup, then steps that move its fp32 shards in twice and gradients out once and
    update on the host."""
    c = COSTS[system]
    params = params_of(size, s)
    step = max(step_estimate_s(size, s, False), 12 * params / gpu_lease.LINK_BPS) + 16 * params / HOST_TORCH_ADAMW_BPS
    return (c.warm_s if warm else c.fixed_s) + c.per_layer_s * size[0] + (1 + s["warmup"] + s["steps"]) * step


def label(system: str, extra: dict) -> str:
    return system + "".join(f", {k}={v}" for k, v in extra.items())


def config(lease: Lease, system: str, dtype, budget, extra: dict) -> pscompile.Config:
    extra = dict(extra)
    if extra.get("optimizer_threads") == "one less":
        extra["optimizer_threads"] = max(1, torch.get_num_threads() - 1)
    return pscompile.Config(device=lease.device, dtype=dtype, device_memory=budget,
                            chunk_size=lease.s["chunk"] or "auto", **gpu.SYSTEMS[system], **extra)


def ours(lease: Lease, system: str, data, dtype, budget, extra: dict, rate: float) -> dict:
    make = lambda: pscompile.compile(gpu.model(lease.s["speed"], lease.s), data[0],       # noqa: E731
                                     config=config(lease, system, dtype, budget, extra))
    row = summarized(gpu.run_pscompile(make, data, lease.device, budget), budget, lease.s["warmup"])
    last = row["steps"][-1]
    return dict(row, busier_bytes=max(last["h2d"], last["d2h"]), rate=rate)


def peer(lease: Lease, system: str, data, dtype, cap) -> dict:
    s, device = lease.s, lease.device
    if system.startswith("plain"):
        return gpu_lease.plain(lease, data, dtype, system == "plain torch.compile")
    if system == FSDP2:
        row = peers.run_fsdp2(s["speed"], data, s, device, dtype, cap, HP)
    else:
        row = peers.run_deepspeed(s["speed"], data, s, device, dtype, cap, HP, lease.wheels)
    return dict(summarized(row, None, s["warmup"]), first_s=row["steps"][0]["time_s"], cap=cap,
                cap_enforced=device == "cuda" and cap is not None)


def derive(row: dict, lease: Lease, ref: dict | None, dtype) -> None:
    """Tokens/s, TFLOP/s and the GPU's peak's fraction; the losses against plain PyTorch."""
    s = lease.s
    tokens = s["batch"] * s["seq"]
    params = params_of(s["speed"], s)
    row.update(tokens_per_s=tokens / row["step_s"], tflops=peers.step_flops(params, tokens) / row["step_s"] / 1e12)
    peak = peers.peak_flops(torch.cuda.get_device_name(0)) if lease.device == "cuda" else None
    row["peak_fraction"] = row["tflops"] * 1e12 / peak if peak else None
    if ref is not None and "steps" in ref:
        diffs = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(row["steps"], ref["steps"])]
        row.update(max_rel_loss=max(diffs), tracks=max(diffs) <= TOL[str(dtype).split(".")[-1]])


def overlap_ratios(rows: list[dict]) -> None:
    """Each pscompile row's step / max(the same system's no-cap step (plain PyTorch's where that did
    not run), its busier direction's bytes / the pinned-copy rate), once every row has run."""
    alone = {r["system"]: r["step_s"] for r in rows if r["budget_name"] == "none" and "step_s" in r}
    for r in rows:
        base = alone.get(r["system"]) or alone.get("plain PyTorch")
        if "busier_bytes" in r and "step_s" in r and base:
            r["overlap_ratio"] = r["step_s"] / max(base, r["busier_bytes"] / r["rate"])


def speed_phase(lease: Lease, clock: gpu.Clock, rate: float, plan=PLAN, rows: list[dict] | None = None,
                cap: dict | None = None) -> list[dict]:
    """``plan``'s rows, appended to ``rows`` (the earlier phase's: plain PyTorch's losses are the
    reference) under ``cap`` (shared by every phase, computed by its first capped row)."""
    s = lease.s
    dtype = torch.bfloat16 if lease.device == "cuda" else torch.float32
    data = gpu.batches(s, 1 + s["warmup"] + s["steps"])
    main = "compiled inductor" if lease.inductor else "compiled eager"
    rows = [] if rows is None else rows
    cap = {} if cap is None else cap
    ref = next((r for r in rows if r["system"] == "plain PyTorch" and "steps" in r), None)
    for system, bname, extra in plan:
        system = main if system == "main" else system
        limited = bname == "cap"
        if system in gpu.SYSTEMS:
            need = gpu_lease.SEARCH_S * (limited and not cap) + estimate_s(system, s["speed"], s, limited,
                                                                          system in lease.warm)
        else:
            need = (estimate_s(system, s["speed"], s, False, system in lease.warm) if system.startswith("plain")
                    else peer_estimate_s(system, s["speed"], s, system in lease.warm))

        def fn(system=system, limited=limited, extra=extra):
            budget = the_cap(lease, cap, data, dtype, rows) if limited else None
            with peers.host_peak({}) as host:
                row = (ours(lease, system, data, dtype, budget, extra, rate) if system in gpu.SYSTEMS
                       else peer(lease, system, data, dtype, budget))
            return dict(host, **row, cap_parts=cap if limited else None)     # (a child's host peak wins)

        lease.running.update(section="speed", system=label(system, extra))
        row = guarded_row(lease, clock, need, fn, section="speed", system=system, budget_name=bname,
                          variant=extra or None)
        if "steps" in row:
            ref = row if system == "plain PyTorch" else ref
            derive(row, lease, ref, dtype)
            lease.write(dict(kind="derived", system=label(system, extra), budget_name=bname,
                             **{k: row.get(k) for k in DERIVED}))
        rows.append(row)
    return rows


def write_overlap_ratios(lease: Lease, rows: list[dict]) -> None:
    overlap_ratios(rows)
    for r in rows:
        if "overlap_ratio" in r:
            lease.write(dict(kind="overlap", system=label(r["system"], r.get("variant") or {}),
                             budget_name=r["budget_name"], overlap_ratio=r["overlap_ratio"]))


DERIVED = ("step_s", "tokens_per_s", "tflops", "peak_fraction", "max_rel_loss", "tracks", "host_peak_bytes",
           "first_s")


def guarded_row(lease: Lease, clock: gpu.Clock, need: float, fn, **lab) -> dict:
    """bench/gpu_lease.py's ``run_row``, with a peer that cannot start here skipped, not failed."""
    def run():
        try:
            return fn()
        except peers.Unavailable as e:
            return dict(skipped=str(e))
    return run_row(lease, clock, need, run, **lab)


def the_cap(lease: Lease, cap: dict, data, dtype, rows: list[dict]) -> int:
    """The shared device cap (computed once): max(1.15 x compiled mode's minimum, model data / 4)."""
    if not cap:
        minimum = gpu_lease.minimum(lease, "compiled eager", rows, data, dtype)
        quarter = model_bytes(params_of(lease.s["speed"], lease.s), dtype) // 4
        cap.update(minimum=minimum, quarter_of_model_data=quarter, cap=max(int(minimum * gpu_lease.TIGHT), quarter))
    return cap["cap"]


def decisions(rows: list[dict], dry_run: bool) -> list[dict]:
    """Each A/B row against the default row under the cap: the step ratio and its verdict (none on a
    dry run, whose times mean nothing)."""
    by = {(r["system"], r["budget_name"], repr(r.get("variant"))): r for r in rows}
    out = []
    for r in rows:
        base = by.get((r["system"], r["budget_name"], repr(None)))
        if not r.get("variant") or base is None:
            continue
        if "step_s" not in r or "step_s" not in base:
            out.append(dict(kind="decision", variant=r["variant"], verdict="not measured",
                            why=r.get("skipped") or r.get("error") or base.get("skipped") or base.get("error")))
            continue
        ratio = r["step_s"] / base["step_s"]
        verdict = ("dry run: times mean nothing" if dry_run else "the variant wins" if ratio < LOWER
                   else "the default wins" if ratio > HIGHER else "no difference")
        out.append(dict(kind="decision", variant=r["variant"], step_ratio=ratio, verdict=verdict,
                        first_ratio=r["first_s"] / base["first_s"] if base.get("first_s") else None,
                        host_peak_ratio=(r["host_peak_bytes"] / base["host_peak_bytes"]
                                         if r.get("host_peak_bytes") and base.get("host_peak_bytes") else None)))
    return out


# ================================================================== capacity

def record_row(lease: Lease, row: dict) -> dict:
    gpu_lease.record(lease, row)
    return row


def rung(lease: Lease, system: str, size, s: dict, budget: int) -> dict:
    """Two steps of ``system`` on a GPT of ``size`` under ``budget``; ``fits`` False when it ran out
    of device memory (the allocator's, or pscompile's plan), which ends the ladder and is no failure."""
    data = gpu.batches(s, 2)
    dtype = torch.bfloat16 if lease.device == "cuda" else torch.float32
    try:
        if system == "plain PyTorch":
            row = gpu.capped_plain(size, data, s, budget)
        elif system == FSDP2:
            row = peers.run_fsdp2(size, data, s, lease.device, dtype, budget, HP)
        else:
            row = gpu.run_pscompile(lambda: pscompile.compile(gpu.model(size, s), data[0], config=config(
                lease, system, dtype, budget, {})), data, lease.device, budget)
    except (torch.OutOfMemoryError, pscompile.BudgetError) as e:
        return dict(fits=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return dict(row, fits=row.get("within_budget", True))


def capacity_phase(lease: Lease, clock: gpu.Clock, device_bytes: int) -> list[dict]:
    """Per system, the ladder from the smallest GPT up, until one does not fit; a summary row each."""
    budget = device_bytes // 8
    s = dict(lease.s, warmup=0, steps=1)
    out = []
    for system in CAPACITY:
        if system != "compiled eager" and lease.device != "cuda":
            out.append(record_row(lease, dict(section="capacity", system=system, budget=budget,
                                                        skipped="the CPU cannot cap a peer's memory")))
            continue
        largest, stop = None, None
        for size in s["ladder"]:
            need = (estimate_s(system, size, s, True, system in lease.warm) if system in gpu.SYSTEMS
                    else peer_estimate_s(system, size, s, system in lease.warm))
            r = run_row(lease, clock, need, lambda: rung(lease, system, size, s, budget), section="capacity rung",
                        system=system, size=list(size), budget=budget)
            if "skipped" in r or "error" in r or not r["fits"]:
                stop = r.get("skipped") or r.get("error") or r.get("why") or "over the budget"
                break
            largest = dict(size=list(size), params=params_of(size, s))
        done = dict(section="capacity", system=system, budget=budget, largest=largest, stopped_by=stop)
        out.append(record_row(lease, dict(done, error=r["error"]) if "error" in r else done))
    return out


# ================================================================== the command

def show(row: dict) -> list:
    result = row.get("skipped") or row.get("error")
    fmt = lambda k, f: "-" if row.get(k) is None else format(row[k], f)            # noqa: E731
    return [label(row["system"], row.get("variant") or {}), row.get("budget_name"),
            result or fmt("step_s", ".3f"), fmt("tokens_per_s", ".0f"), fmt("tflops", ".2f"),
            fmt("peak_fraction", ".2f"), fmt("overlap_ratio", ".2f"), fmt("max_rel_loss", ".1e"),
            fmt("first_s", ".1f"), fmt("allocator_peak_max", ","), fmt("peak_max", ","),
            fmt("host_peak_bytes", ","), row.get("cap_parts") and row["cap_parts"]["cap"]]


def summary(rows: list[dict], caps: list[dict], verdicts: list[dict]) -> str:
    speed = tabulate([show(r) for r in rows], ["system", "budget", "step s", "tokens/s", "TFLOP/s", "of peak",
                                               "overlap", "max rel loss", "first s", "allocator peak",
                                               "pscompile peak", "host peak", "cap"], "github")
    cap = tabulate([[r["system"], r["budget"], r.get("skipped") or r["largest"] and
                     f"L{r['largest']['size'][0]} d{r['largest']['size'][1]} ({r['largest']['params'] / 1e6:.0f}M)"
                     or "none", r.get("stopped_by")] for r in caps],
                   ["capacity", "budget (device / 8)", "largest GPT trained", "the next rung"], "github")
    dec = tabulate([[label("", d["variant"]).lstrip(", "), d.get("step_ratio") and f"{d['step_ratio']:.3f}",
                     d["verdict"], d.get("why")] for d in verdicts],
                   ["A/B against the default", "step ratio", "verdict", "why not measured"], "github")
    return "\n\n".join([speed, cap, dec])


def failures(rows: list[dict]) -> list[str]:
    """Rows that raised or went over their budget (bench/gpu.py's ``failures``) or off plain PyTorch's
    losses."""
    out = gpu.failures([{k: v for k, v in r.items() if k != "tracks"} for r in rows])
    out += [f"speed {label(r['system'], r.get('variant') or {})}: loss {r['max_rel_loss']:.2e} from plain PyTorch"
            for r in rows if r.get("tracks") is False]
    return out


def parse(argv) -> argparse.Namespace:
    ap = gpu_lease.arguments("bench/gpu.py --peers", __doc__, DEFAULT_OUT, 450.0, 480.0)
    ap.add_argument("--no-capacity", action="store_true", help="no capacity ladder")
    ap.add_argument("--ab-s", type=float, default=135.0,
                    help="the time the capacity ladder leaves before the deadline, for the A/B rows (~45 s each)")
    ap.add_argument("--wheels", type=Path, default=gpu_lease.ROOT / ".wheels",
                    help="where DeepSpeed's wheels are, if it is not installed (a lent GPU has no network)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if gpu_lease.refused(args, "bench/gpu.py --peers"):
        return 2
    clock = gpu.Clock(args.deadline_s)
    lease = gpu_lease.start(args, SETTINGS, DRY, COSTS, wheels=args.wheels)
    watchdog = threading.Timer(args.hard_s, gpu_lease.abort, (lease, args.hard_s))
    watchdog.daemon = True
    watchdog.start()
    rate = gpu.link_rate(lease.device)
    lease.write(dict(kind="link", GBps=rate / 1e9))
    cap: dict = {}
    rows = speed_phase(lease, clock, rate, PLAN, cap=cap)
    device_bytes = lease.s["device_bytes"] if args.dry_run else torch.cuda.get_device_properties(0).total_memory
    caps = [] if args.no_capacity else capacity_phase(lease, gpu.Clock(clock.left() - args.ab_s), device_bytes)
    rows = speed_phase(lease, clock, rate, AB, rows, cap)
    write_overlap_ratios(lease, rows)
    verdicts = decisions(rows, args.dry_run)
    for d in verdicts:
        lease.write(d)
    watchdog.cancel()
    failed = failures(rows) + gpu.failures([c for c in caps if "error" in c])
    lease.write(dict(kind="end", failures=failed))
    print(summary(rows, caps, verdicts))
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
