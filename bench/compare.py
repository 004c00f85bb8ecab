"""Compare execution modes on GPT: plain PyTorch, plain torch.compile, hooks, compiled.

For each GPT size and device budget, in one run with the same data and seed: plain PyTorch eager and
plain ``torch.compile`` with ``torch.optim.AdamW(fused=True)`` (no budget: everything on the device);
pscompile hooks mode and compiled mode with ``backend="eager"`` (``--inductor``: also ``"inductor"``)
at a tight budget, a middle one and none, with and without the emulated device<->host link
(``link_bandwidth``: every byte moved costs wall time as it would over PCIe, so prefetch/overlap
shows in step time).

Reported per row: compile time (engine construction + the first, measuring step), step time
(median of N steps after warm-up), peak device bytes (measured), bytes moved per step, and the
ratio of bytes moved to a lower bound computed here, independently of the planner (``lower_bound``):

**The lower bound.** Compiled mode's iteration is a fixed sequence of nodes (the captured graph);
node ``i`` reads the parameter chunks of the parameters in its ``reads`` metadata, and while it runs
the device holds ``window_i`` bytes of non-model data: the larger of the last executed node's bytes
and its own (parameter views and the output execute nothing at their place), from the schedule's
``nonmodel`` curve (measured in the first step). The chunks resident at node ``i`` must fit in
``(budget - window_i - optimizer-state bytes on the device) // slot_bytes`` slots; the chunks whose
optimizer states live on the device occupy theirs for the whole iteration, and every other chunk
starts the iteration on the host. Every read needs its chunk resident, so a chunk that is not must
be fetched (a whole chunk, ``slot_bytes``). With equal-size pages, the access sequence known in
advance and demand fetching, evicting the page whose next use is farthest away (Belady) gives the
fewest fetches, also when the capacity changes from step to step (the exchange argument works step
by step on caches of equal size); ``min_fetches`` simulates it with its own loop. Then the
gradients: a chunk whose optimizer states are on the host is updated there, so each gradient it
holds crosses to the host at least once, at least its own bytes (a host-side ``store_grad`` moves
exactly those, a writeback the whole chunk). Fetches are host->device and gradients device->host,
so neither pays for the other:

    bound = min_fetches x slot_bytes + sum of the gradient bytes of host-updated chunks

It is a lower bound for every schedule that keeps pscompile's memory model: whole-chunk transfers,
the same chunk layout, access order and non-model curve, the same optimizer-state placement and
the rule above for which non-model bytes a chunk must fit next to, and no recomputation. A plan
moves more when a dirty chunk is evicted and fetched back (its gradients go home twice), when a
writeback carries a chunk's padding, or when its evictions are not farthest-next-use. Hooks mode
has its own access order (moments) and non-model curve, so the bound of compiled mode at the same
budget is only a reference for it: hooks mode may move less.

    python bench/compare.py [--quick] [--markdown] [--inductor] [--links 100MB/s,v100] [--planners belady,angel]
                            [--out bench/results/compare.json]

Float32, one torch thread (see bench/foundation.py for why).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt, token_batches
from harness.timing import time_reps
from pscompile.graph import meta
from pscompile.memory.rates import LINK_PRESETS, calibrated_link
from pscompile.testing import ReferenceTrainer
from pscompile.units import format_bytes

MiB = 2**20
FULL = dict(sizes=[(2, 128), (4, 256)], vocab=4096, seq=128, batch=4, warmup=2, steps=5,
            link="100MB/s")
QUICK = dict(sizes=[(2, 64)], vocab=512, seq=64, batch=2, warmup=2, steps=7, link="50MB/s")


def batches(s: dict, n: int, batch: int | None = None):
    """``n`` batches of ``batch`` (default ``s["batch"]``) sequences: the data of every script on these settings."""
    return token_batches(s["vocab"], batch or s["batch"], s["seq"], n, seed=1)


def probe(model, batch, mode: str = "compiled") -> tuple[int, int, int]:
    """``mode`` (eager backend) with no budget, after its first (measuring) step: its minimum budget,
    its chunk size and its measured peak. The "tight" budget is ``tight(minimum, chunk)``."""
    engine = pscompile.compile(model, batch, config=cpu_config(mode))
    try:
        engine.step(batch)
        return engine.min_device_memory, engine.layout.chunk_size, engine.stats.peak_device_bytes
    finally:
        engine.close()


def tight(minimum: int, chunk: int) -> int:
    """The minimum + 2 float32 chunks."""
    return minimum + 2 * chunk * 4


def access_sequence(schedule) -> tuple[list[list[int]], list[bool]]:
    """Per node of the captured graph: the chunks it reads (through its parameter views), and
    whether it executes at its place (not a parameter or a view of one, not the output)."""
    reads, executed = [], []
    for node in schedule.captured.gm.graph.nodes:
        chunks: list[int] = []
        for fqn in meta.get(node, "reads", ()):
            chunks += [c for c in schedule.layout.entry(fqn).chunks if c not in chunks]
        reads.append(chunks)
        executed.append(node.op != "output" and meta.get(node, "param") is None)
    return reads, executed


def capacities(schedule, executed: list[bool]) -> list[int]:
    """Chunks that fit on the device at each node: (budget - window - optimizer states) // slot, the
    window being the larger of the last executed node's non-model bytes and the node's own."""
    out, last = [], 0
    for n, ran in zip(schedule.nonmodel, executed):
        window = max(last, n) if ran else last
        if schedule.budget is None:
            out.append(schedule.layout.num_chunks)
        else:
            out.append((schedule.budget - window - schedule.os_device_bytes) // schedule.slot_bytes)
        if ran:
            last = n
    return out


def min_fetches(reads: list[list[int]], capacity: list[int], pinned: frozenset[int]) -> int:
    """The fewest fetches for this access sequence: demand fetching, farthest-next-use eviction.
    ``pinned`` chunks are resident throughout and count against the capacity."""
    never = len(reads)
    following: list[dict[int, int]] = [{} for _ in reads]    # node -> chunk -> the next node reading it
    upcoming: dict[int, int] = {}
    for i in range(len(reads) - 1, -1, -1):
        for c in reads[i]:
            following[i][c] = upcoming.get(c, never)
            upcoming[c] = i
    resident = {c: upcoming.get(c, never) for c in pinned}   # chunk -> its next use
    fetches = 0
    for i, need in enumerate(reads):
        if len(set(need) | pinned) > capacity[i]:
            raise ValueError(f"node {i} reads {len(need)} chunks; only {capacity[i]} fit (with {len(pinned)} pinned)")
        missing = [c for c in need if c not in resident]
        while len(resident) + len(missing) > capacity[i]:
            victims = [c for c in resident if c not in pinned and c not in need]
            del resident[max(victims, key=lambda c: resident[c])]
        fetches += len(missing)
        for c in need:
            resident[c] = following[i][c]
    return fetches


def host_grad_bytes(schedule) -> int:
    """The gradient bytes of parameters whose chunk is updated on the host."""
    elsize = schedule.slot_bytes // schedule.layout.chunk_size
    total = 0
    for fqn in schedule.captured.grad_fqns:
        entry = schedule.layout.entry(fqn)
        total += sum(p.numel for p in entry.pieces if p.chunk not in schedule.scheduled.os_device) * elsize
    return total


@dataclass(frozen=True)
class Bound:
    fetches: int            # fewest fetches (Belady over the access sequence)
    fetch_bytes: int
    grad_bytes: int         # gradient bytes the host-side update needs
    nbytes: int             # fetch_bytes + grad_bytes


def lower_bound(engine) -> Bound:
    """The fewest bytes any schedule moves per training step for the access order, capacities and
    optimizer-state placement of ``engine``'s training schedule (see the module docstring)."""
    schedule = engine.schedule
    reads, executed = access_sequence(schedule)
    fetches = min_fetches(reads, capacities(schedule, executed), frozenset(schedule.scheduled.os_device))
    fetch_bytes, grad_bytes = fetches * schedule.slot_bytes, host_grad_bytes(schedule)
    return Bound(fetches, fetch_bytes, grad_bytes, fetch_bytes + grad_bytes)


def run_engine(make, data, warmup: int, measure=None) -> dict:
    """Build an engine (``make()``) and train it on ``data``: compile s = construction + the first
    (measuring) step; step s = the median ``StepStats.time_s`` from step ``warmup`` on (the first is 0); the peak over
    every step, the first included. ``measure(engine)`` adds to the row before the engine closes."""
    t0 = time.perf_counter()
    engine = make()
    try:
        engine.step(data[0])                      # compiled mode measures non-model memory here
        compile_s = time.perf_counter() - t0
        times, forwards, losses, peaks = [], [], [], [engine.stats.peak_device_bytes]
        for i, b in enumerate(data[1:]):
            losses.append(engine.step(b))
            peaks.append(engine.stats.peak_device_bytes)
            if i >= warmup - 1:
                times.append(engine.stats.time_s)
                forwards.append(engine.stats.forward_s)
        st = engine.stats
        return dict(compile_s=compile_s, step_s=statistics.median(times), forward_s=statistics.median(forwards),
                    peak=max(peaks), peaks=peaks, moved=st.bytes_moved, h2d=st.h2d_bytes, d2h=st.d2h_bytes,
                    chunk_d2h=st.chunk_d2h_bytes, transfer_s=st.transfer_s, losses=losses,
                    **(measure(engine) if measure else {}))
    finally:
        engine.close()


def run_plain(model, data, s, compiled: bool) -> dict:
    t0 = time.perf_counter()
    trainer = ReferenceTrainer(model, optimizer=adamw(1e-3), dtype=torch.float32, fused=compiled)
    if compiled:
        trainer.model = torch.compile(trainer.model)
    trainer.step(data[0])
    compile_s = time.perf_counter() - t0
    rest, losses, skip = iter(data[1:]), [], max(s["warmup"] - 1, 0)     # (as run_engine times)
    times = time_reps(lambda: losses.append(trainer.step(next(rest))), len(data) - 1 - skip, warmup=skip)
    return dict(compile_s=compile_s, step_s=statistics.median(times), peak=None, moved=0, transfer_s=0.0,
                losses=losses)


def bound_of(engine) -> dict:
    bound = lower_bound(engine)
    return dict(lower_bound=bound.nbytes, bound=asdict(bound), planned_fetches=engine.last_plan.num_fetches)


def run_system(name: str, cfg: pscompile.Config, link: str | None, n_layer: int, d: int, data, s: dict,
               base: dict) -> dict:
    """One pscompile system at one budget: its raw row, with an ``error`` field if it failed. A
    compiled row carries its lower bound (``lower_bound``)."""
    row = dict(size=[n_layer, d], system=name, budget=cfg.device_memory, link=link)
    budgeted = cfg.device_memory is not None
    try:
        r = run_engine(lambda: pscompile.compile(gpt(n_layer, d, s["vocab"], s["seq"]), data[0], config=cfg), data,
                       s["warmup"], bound_of if cfg.mode == "compiled" and budgeted else None)
        row.update(r, max_dloss=max(abs(a - b) for a, b in zip(r["losses"], base["losses"])),
                   within_budget=not budgeted or r["peak"] <= cfg.device_memory)
        if "lower_bound" in r:
            row["at_or_above_bound"] = r["moved"] >= r["lower_bound"]
    except Exception as e:                    # noqa: BLE001 - recorded in the row; the script exits 1
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def problems_of(row: dict) -> list[str]:
    """Why a pscompile row failed: an exception, a peak over the budget, compiled bytes below the bound."""
    if "error" in row:
        return [row["error"]]
    out = []
    if not row["within_budget"]:
        out.append(f"measured peak {row['peak']} > budget {row['budget']} (peaks per step {row['peaks']})")
    if row.get("at_or_above_bound") is False:
        out.append(f"moved {row['moved']} bytes < lower bound {row['lower_bound']}: the bound or the plan is wrong")
    return out


def table_row(row: dict, bname: str, base: dict) -> list:
    size = f"L{row['size'][0]} d{row['size'][1]}"
    if "error" in row:
        return [size, "", row["system"], bname, row["link"] or "-", "-", "-", "-", "-", "-",
                f"error: {row['error'][:60]}"]
    budget = bname if row["budget"] is None else f"{bname} {format_bytes(row['budget'])}"
    return [size, "", row["system"], budget, row["link"] or "-",
            f"{row['compile_s']:.1f}", f"{row['step_s']:.3f}", f"{row['step_s'] / base['step_s']:.2f}",
            f"{row['peak'] / MiB:.1f}", f"{row['moved'] / MiB:.2f}", f"{row['max_dloss']:.1e}"]


def bound_rows(raw: list[dict]) -> list[list]:
    """Bytes moved vs the lower bound, per row without an emulated link. Hooks rows are shown
    against compiled eager's bound at the same size and budget (a reference, see the docstring)."""
    ref = {(tuple(r["size"]), r["budget"]): r["lower_bound"] for r in raw
           if r["system"] == "compiled eager" and "lower_bound" in r}
    out = []
    for r in raw:
        if "budget" not in r or r["budget"] is None or r["link"] is not None or "error" in r:
            continue
        lb = r.get("lower_bound", ref.get((tuple(r["size"]), r["budget"])))
        out.append([f"L{r['size'][0]} d{r['size'][1]}", r["system"], format_bytes(r["budget"]),
                    f"{r['moved'] / MiB:.2f}", f"{lb / MiB:.2f}" if lb is not None else "-",
                    f"{r['moved'] / lb:.3f}" if lb else "-"])
    return out


def parse_links(spec: str) -> list[tuple[str, float | str]]:
    """(label, link_bandwidth) of each comma-separated link: a rate, or a GPU preset calibrated here."""
    links = []
    for name in (n.strip() for n in spec.split(",")):
        if name.lower() in LINK_PRESETS:
            bw = calibrated_link(name, "cpu", torch.float32)
            links.append((f"{name} {bw / 1e6:.1f}MB/s", bw))
        elif name.lower() != "none":
            links.append((name, name))
    return links


def main(argv=None) -> int:
    ap = parser(__doc__, "compare", markdown=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inductor", action="store_true", help="also run compiled mode with backend='inductor'")
    ap.add_argument("--planners", default="belady",
                    help="comma-separated residency planners of the compiled rows (Config.planner: belady, angel); "
                         "each besides belady adds rows named after it")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default: the settings')")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default: the settings')")
    ap.add_argument("--links", default=None,
                    help="comma-separated emulated links to run besides none, rates or GPU presets "
                         "(e.g. 100MB/s,v100; default: the settings' link; 'none': no link rows); a preset "
                         "is calibrated once, here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = dict(QUICK if args.quick else FULL)
    s.update({k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})
    data = batches(s, 1 + s["warmup"] + s["steps"])
    links = parse_links(args.links or s["link"])
    s["links"] = [label for label, _ in links]
    rows, raw = [], []
    for n_layer, d in s["sizes"]:
        params = gpt(n_layer, d, s["vocab"], s["seq"]).config.num_params()
        ref_rows = {}
        for name, compiled in (("plain PyTorch", False), ("plain torch.compile", True)):
            r = run_plain(gpt(n_layer, d, s["vocab"], s["seq"]), data, s, compiled)
            ref_rows[name] = r
            rows.append([f"L{n_layer} d{d}", f"{params / 1e6:.1f}M", name, "-", "-", f"{r['compile_s']:.1f}",
                         f"{r['step_s']:.3f}", "-", "-", "-", "-"])
            raw.append(dict(size=[n_layer, d], system=name, **r))
        base = ref_rows["plain PyTorch"]
        minimum, chunk, everything = probe(gpt(n_layer, d, s["vocab"], s["seq"]), data[0])
        budgets = [("tight", tight(minimum, chunk)), ("mid", (minimum + everything) // 2), ("none", None)]
        systems = [("hooks", dict(mode="hooks")), ("compiled eager", dict(mode="compiled", backend="eager"))]
        if args.inductor:
            systems.append(("compiled inductor", dict(mode="compiled", backend="inductor")))
        compiled = [(n, kw) for n, kw in systems if kw["mode"] == "compiled"]
        for planner in [p.strip() for p in args.planners.split(",") if p.strip() != "belady"]:
            systems += [(f"{n} ({planner})", dict(kw, planner=planner)) for n, kw in compiled]
        for bname, budget in budgets:
            for link, bw in [(None, None), *(links if budget is not None else [])]:
                for sname, kw in systems:
                    cfg = cpu_config(device_memory=budget, chunk_size=chunk, link_bandwidth=bw, **kw)
                    row = run_system(sname, cfg, link, n_layer, d, data, s, base)
                    row["budget_name"] = bname
                    raw.append(row)
                    rows.append(table_row(row, bname, base))
    headers = ["model", "params", "system", "budget", "link", "compile s", "step s", "step / plain",
               "peak MiB", "MiB moved", "max |dloss|"]
    print("GPT, float32, one thread; step = median of steps after warm-up; compile = engine construction + "
          "first (measuring) step; peak = largest measured peak of every step, the first included; "
          "|dloss| = max loss difference vs plain PyTorch\n")
    print(table(rows, headers, markdown=args.markdown))
    print("\nbytes moved per step vs a lower bound computed from compiled mode's access sequence: Belady's "
          "fewest fetches for its capacities + the gradient bytes the host-side update needs (hooks rows: "
          "compiled eager's bound at that budget, a reference)\n")
    print(table(bound_rows(raw), ["model", "system", "budget", "MiB moved", "lower bound MiB", "moved / bound"],
                markdown=args.markdown))
    failed = [(r, p) for r in raw if "budget" in r for p in problems_of(r)]
    for r, p in failed:
        print(f"FAILED L{r['size'][0]} d{r['size'][1]} {r['system']} {r['budget_name']} link={r['link']}: {p}")
    write_json(args.out, dict(settings=s, rows=raw, failed=len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
