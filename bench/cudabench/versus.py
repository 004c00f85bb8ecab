"""pscompile against what a user would pick instead, on one GPU (``bench/gpu.py --peers``, docs/gpu.md).

Every system trains the lease's GPT on the same batches under one cap, ``max(1.15 x compiled
mode's minimum, a quarter of the model data)``: pscompile's budget, a peer's CUDA allocator limit.
The rows: ``PLAN``, then the capacity ladder of ``CAPACITY`` under an eighth of the GPU until
``--ab-s`` before the deadline, then ``AB``'s A/B rows and their ``decision`` lines. Written and
timed as the lease's rows are; a dry run caps no peer (the CPU has no allocator limit).
"""

from __future__ import annotations

from pathlib import Path

import torch

import pscompile
from harness.output import table
from harness.specs import adamw

from . import lease as ls, rows
from .gputests import ROOT
from .lease import COSTS, SEARCH_S, Cost, Lease, estimate_s, run_row, step_estimate_s, summarized
from .peers import device_cap, host_peak, peak_flops, run_deepspeed, run_fsdp2, step_flops
from .rows import SYSTEMS, Clock, batches, config, model, params_of, run_plain, run_pscompile
from .rows import failures as row_failures

SETTINGS = dict(ls.LEASE, steps=4,
                ladder=[(8, 2048), (16, 2048), (32, 2048), (16, 4096), (24, 4096)])   # to 4.9B parameters:
                # ~70 GB of host model data (14 bytes a parameter) plus the fp32 model built first
DRY = dict(rows.DRY, steps=3, ladder=[(1, 64), (2, 128), (8, 512)])    # (the third does not fit 8 MiB)
HP = adamw(1e-3)
TOL = {"float32": 1e-4, "bfloat16": 5e-2}
FSDP2, DEEPSPEED = "FSDP2 + CPU offload", "DeepSpeed ZeRO-3 offload"
COSTS = dict(COSTS, **{
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
DERIVED = ("step_s", "tokens_per_s", "tflops", "peak_fraction", "max_rel_loss", "tracks", "host_peak_bytes",
           "first_s")


def model_bytes(params: int, dtype: torch.dtype) -> int:
    """Model data as pscompile counts it: compute-dtype parameters, fp32 masters and two Adam states."""
    return params * (torch.empty((), dtype=dtype).element_size() + 12)


def peer_estimate_s(system: str, size, s: dict, warm: bool) -> float:
    """A peer's row: setup, then steps that move its fp32 shards in twice and gradients out once and
    update on the host."""
    c = COSTS[system]
    params = params_of(size, s)
    step = max(step_estimate_s(size, s, False), 12 * params / ls.LINK_BPS) + 16 * params / HOST_TORCH_ADAMW_BPS
    return (c.warm_s if warm else c.fixed_s) + c.per_layer_s * size[0] + (1 + s["warmup"] + s["steps"]) * step


def label(system: str, extra: dict) -> str:
    return system + "".join(f", {k}={v}" for k, v in extra.items())


def peer(lease: Lease, system: str, data, cap) -> dict:
    s, device = lease.s, lease.device
    if system.startswith("plain"):
        return ls.plain(lease, data, system == "plain torch.compile")
    run = run_fsdp2 if system == FSDP2 else lambda *a: run_deepspeed(*a, lease.wheels)
    row = run(s["speed"], data, s, device, lease.dtype, cap, HP)
    return dict(summarized(row, None, s["warmup"]), first_s=row["steps"][0]["time_s"], cap=cap,
                cap_enforced=device == "cuda" and cap is not None)


def derive(row: dict, lease: Lease, ref: dict | None, dtype) -> None:
    """Tokens/s, TFLOP/s and the GPU's peak's fraction; the losses against plain PyTorch."""
    s = lease.s
    tokens = s["batch"] * s["seq"]
    row.update(tokens_per_s=tokens / row["step_s"],
               tflops=step_flops(params_of(s["speed"], s), tokens) / row["step_s"] / 1e12)
    peak = peak_flops(torch.cuda.get_device_name(0)) if lease.device == "cuda" else None
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


def speed_phase(lease: Lease, clock: Clock, rate: float, plan=PLAN, rows: list[dict] | None = None,
                cap: dict | None = None) -> list[dict]:
    """``plan``'s rows, appended to ``rows`` (the earlier phase's: plain PyTorch's losses are the
    reference) under ``cap`` (shared by every phase, computed by its first capped row)."""
    s = lease.s
    data = batches(s, 1 + s["warmup"] + s["steps"])
    main = "compiled inductor" if lease.inductor else "compiled eager"
    rows = [] if rows is None else rows
    cap = {} if cap is None else cap
    ref = next((r for r in rows if r["system"] == "plain PyTorch" and "steps" in r), None)
    for system, bname, extra in plan:
        system = main if system == "main" else system
        limited = bname == "cap"
        if system in SYSTEMS:
            need = SEARCH_S * (limited and not cap) + estimate_s(system, s["speed"], s, limited, system in lease.warm)
        elif system.startswith("plain"):
            need = estimate_s(system, s["speed"], s, False, system in lease.warm)
        else:
            need = peer_estimate_s(system, s["speed"], s, system in lease.warm)

        def fn(system=system, limited=limited, extra=extra):
            budget = the_cap(lease, cap, data, rows) if limited else None
            with host_peak({}) as host:
                row = (ls.ours(lease, system, data, rate, budget, extra) if system in SYSTEMS
                       else peer(lease, system, data, budget))
            return dict(host, **row, cap_parts=cap if limited else None)     # (a child's host peak wins)

        row = run_row(lease, clock, need, fn, section="speed", system=system, budget_name=bname,
                      variant=extra or None)
        if "steps" in row:
            ref = row if system == "plain PyTorch" else ref
            derive(row, lease, ref, lease.dtype)
            lease.write(dict(kind="derived", system=label(system, extra), budget_name=bname,
                             **{k: row.get(k) for k in DERIVED}))
        rows.append(row)
    return rows


def the_cap(lease: Lease, cap: dict, data, rows: list[dict]) -> int:
    """The shared device cap (computed once): max(1.15 x compiled mode's minimum, model data / 4)."""
    if not cap:
        minimum = ls.minimum(lease, "compiled eager", rows, data)
        quarter = model_bytes(params_of(lease.s["speed"], lease.s), lease.dtype) // 4
        cap.update(minimum=minimum, quarter_of_model_data=quarter, cap=max(int(minimum * ls.TIGHT), quarter))
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


def rung(lease: Lease, system: str, size, s: dict, budget: int) -> dict:
    """Two steps of ``system`` on a GPT of ``size`` under ``budget``; ``fits`` False when it ran out
    of device memory (the allocator's, or pscompile's plan), which ends the ladder and is no failure."""
    data = batches(s, 2)
    try:
        if system == "plain PyTorch":
            with device_cap("cuda", budget):
                row = run_plain(size, data, s, "cuda", torch.bfloat16, compiled=False)
        elif system == FSDP2:
            row = run_fsdp2(size, data, s, lease.device, lease.dtype, budget, HP)
        else:
            row = run_pscompile(lambda: pscompile.compile(model(size, s), data[0], config=config(
                lease.device, lease.dtype, budget, system, s["chunk"])), data, lease.device, budget)
    except (torch.OutOfMemoryError, pscompile.BudgetError) as e:
        return dict(fits=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return dict(row, fits=row.get("within_budget", True))


def capacity_phase(lease: Lease, clock: Clock, device_bytes: int) -> list[dict]:
    """Per system, the ladder from the smallest GPT up, until one does not fit; a summary row each."""
    budget = device_bytes // 8
    s = dict(lease.s, warmup=0, steps=1)
    out = []
    for system in CAPACITY:
        if system != "compiled eager" and lease.device != "cuda":
            out.append(ls.record(lease, dict(section="capacity", system=system, budget=budget,
                                             skipped="the CPU cannot cap a peer's memory")))
            continue
        largest, stop = None, None
        for size in s["ladder"]:
            need = (estimate_s(system, size, s, True, system in lease.warm) if system in SYSTEMS
                    else peer_estimate_s(system, size, s, system in lease.warm))
            r = run_row(lease, clock, need, lambda: rung(lease, system, size, s, budget), section="capacity rung",
                        system=system, size=list(size), budget=budget)
            if "skipped" in r or "error" in r or not r["fits"]:
                stop = r.get("skipped") or r.get("error") or r.get("why") or "over the budget"
                break
            largest = dict(size=list(size), params=params_of(size, s))
        done = dict(section="capacity", system=system, budget=budget, largest=largest, stopped_by=stop)
        out.append(ls.record(lease, dict(done, error=r["error"]) if "error" in r else done))
    return out


def show(row: dict) -> list:
    fmt = lambda k, f: "-" if row.get(k) is None else format(row[k], f)            # noqa: E731
    return [label(row["system"], row.get("variant") or {}), row.get("budget_name"),
            row.get("skipped") or row.get("error") or fmt("step_s", ".3f"), fmt("tokens_per_s", ".0f"),
            fmt("tflops", ".2f"), fmt("peak_fraction", ".2f"), fmt("overlap_ratio", ".2f"), fmt("max_rel_loss", ".1e"),
            fmt("first_s", ".1f"), fmt("allocator_peak_max", ","), fmt("peak_max", ","),
            fmt("host_peak_bytes", ","), row.get("cap_parts") and row["cap_parts"]["cap"]]


def summary(rows: list[dict], caps: list[dict], verdicts: list[dict]) -> str:
    speed = table([show(r) for r in rows], ["system", "budget", "step s", "tokens/s", "TFLOP/s", "of peak", "overlap",
                                            "max rel loss", "first s", "allocator peak", "pscompile peak",
                                            "host peak", "cap"])
    cap = table([[r["system"], r["budget"], r.get("skipped") or r["largest"] and
                  f"L{r['largest']['size'][0]} d{r['largest']['size'][1]} ({r['largest']['params'] / 1e6:.0f}M)"
                  or "none", r.get("stopped_by")] for r in caps],
                ["capacity", "budget (device / 8)", "largest GPT trained", "the next rung"])
    dec = table([[label("", d["variant"]).lstrip(", "), d.get("step_ratio") and f"{d['step_ratio']:.3f}",
                  d["verdict"], d.get("why")] for d in verdicts],
                ["A/B against the default", "step ratio", "verdict", "why not measured"])
    return "\n\n".join([speed, cap, dec])


def failures(rows: list[dict]) -> list[str]:
    """Rows that raised or went over their budget (``rows.failures``) or off plain PyTorch's losses."""
    out = row_failures([{k: v for k, v in r.items() if k != "tracks"} for r in rows])
    out += [f"speed {label(r['system'], r.get('variant') or {})}: loss {r['max_rel_loss']:.2e} from plain PyTorch"
            for r in rows if r.get("tracks") is False]
    return out


def main(argv=None) -> int:
    ap = ls.arguments("bench/gpu.py --peers", __doc__, "peers", 450.0, 480.0)
    ap.add_argument("--no-capacity", action="store_true", help="no capacity ladder")
    ap.add_argument("--ab-s", type=float, default=135.0,
                    help="the time the capacity ladder leaves before the deadline, for the A/B rows (~45 s each)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".wheels",
                    help="where DeepSpeed's wheels are, if it is not installed (a lent GPU has no network)")
    args = ap.parse_args(argv)
    if (started := ls.start(args, "bench/gpu.py --peers", SETTINGS, DRY, COSTS, wheels=args.wheels)) is None:
        return 2
    lease, clock = started
    timer = ls.watchdog(lease, args, clock)
    rate = ls.link(lease)
    cap: dict = {}
    rows = speed_phase(lease, clock, rate, PLAN, cap=cap)
    device_bytes = lease.s["device_bytes"] if args.dry_run else torch.cuda.get_device_properties(0).total_memory
    caps = [] if args.no_capacity else capacity_phase(lease, Clock(clock.left() - args.ab_s), device_bytes)
    rows = speed_phase(lease, clock, rate, AB, rows, cap)
    overlap_ratios(rows)
    for r in rows:
        if "overlap_ratio" in r:
            lease.write(dict(kind="overlap", system=label(r["system"], r.get("variant") or {}),
                             budget_name=r["budget_name"], overlap_ratio=r["overlap_ratio"]))
    verdicts = decisions(rows, args.dry_run)
    for d in verdicts:
        lease.write(d)
    timer.cancel()
    return ls.finish(lease, failures(rows) + row_failures([c for c in caps if "error" in c]),
                     summary(rows, caps, verdicts))
