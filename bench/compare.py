"""Compare execution modes on GPT: plain PyTorch, plain torch.compile, hooks, compiled.

For each GPT size and device budget, in one run with the same data and seed:

- plain PyTorch eager and plain ``torch.compile`` with ``torch.optim.AdamW(fused=True)`` (no budget:
  everything on the device);
- pscompile hooks mode, compiled mode with ``backend="eager"`` and, when available, ``"inductor"``,
  at a tight budget, a middle one and none;
- with and without the emulated device<->host link (``link_bandwidth``), which makes every byte
  moved cost wall time as it would over PCIe, so prefetch/overlap shows up in step time.

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

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer
from pscompile.graph import meta
from pscompile.memory.rates import LINK_PRESETS, calibrated_link
from pscompile.units import format_bytes

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compare.json"

FULL = dict(sizes=[(2, 128), (4, 256)], vocab=4096, seq=128, batch=4, warmup=2, steps=5,
            link="100MB/s")
QUICK = dict(sizes=[(2, 64)], vocab=512, seq=64, batch=2, warmup=2, steps=7, link="50MB/s")


def make_model(n_layer: int, d: int, s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, d // 64), d_model=d, vocab_size=s["vocab"],
                         seq_len=s["seq"]))


def batches(s: dict, n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(n)]


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


def run_engine(make, data, s) -> dict:
    t0 = time.perf_counter()
    engine = make()
    engine.step(data[0])                      # compiled mode measures non-model memory here
    compile_s = time.perf_counter() - t0
    times, losses, peaks = [], [], [engine.stats.peak_device_bytes]
    for i, b in enumerate(data[1:]):
        losses.append(engine.step(b))
        peaks.append(engine.stats.peak_device_bytes)
        if i >= s["warmup"] - 1:
            times.append(engine.stats.time_s)
    st = engine.stats
    row = dict(compile_s=compile_s, step_s=statistics.median(times), peak=max(peaks), peaks=peaks,
               moved=st.bytes_moved, transfer_s=st.transfer_s, losses=losses, engine=engine)
    return row


def run_plain(model, data, s, compiled: bool) -> dict:
    t0 = time.perf_counter()
    trainer = ReferenceTrainer(model, optimizer=pscompile.AdamW(lr=1e-3), dtype=torch.float32, fused=compiled)
    if compiled:
        trainer.model = torch.compile(trainer.model)
    trainer.step(data[0])
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for i, b in enumerate(data[1:]):
        t = time.perf_counter()
        losses.append(trainer.step(b))
        if i >= s["warmup"] - 1:
            times.append(time.perf_counter() - t)
    return dict(compile_s=compile_s, step_s=statistics.median(times), peak=None, moved=0, transfer_s=0.0,
                losses=losses)


def run_system(name: str, cfg: pscompile.Config, link: str | None, n_layer: int, d: int, data, s: dict,
               base: dict) -> dict:
    """One pscompile system at one budget: its raw row, with an ``error`` field if it failed. A
    compiled row carries its lower bound (``lower_bound``)."""
    row = dict(size=[n_layer, d], system=name, budget=cfg.device_memory, link=link)
    engine = None
    try:
        r = run_engine(lambda: pscompile.compile(make_model(n_layer, d, s), data[0], config=cfg), data, s)
        engine = r.pop("engine")
        row.update(r, max_dloss=max(abs(a - b) for a, b in zip(r["losses"], base["losses"])),
                   within_budget=cfg.device_memory is None or r["peak"] <= cfg.device_memory)
        if cfg.mode == "compiled" and cfg.device_memory is not None:
            bound = lower_bound(engine)
            row.update(lower_bound=bound.nbytes, bound=asdict(bound), planned_fetches=engine.last_plan.num_fetches,
                       at_or_above_bound=r["moved"] >= bound.nbytes)
    except Exception as e:                    # noqa: BLE001 - recorded in the row; the script exits 1
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if engine is not None:
            engine.close()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
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
    links: list[tuple[str, float | str]] = []      # (label, link_bandwidth)
    for name in (args.links or s["link"]).split(","):
        name = name.strip()
        if name.lower() == "none":
            continue
        if name.lower() in LINK_PRESETS:
            bw = calibrated_link(name, "cpu", torch.float32)
            links.append((f"{name} {bw / 1e6:.1f}MB/s", bw))
        else:
            links.append((name, name))
    s["links"] = [label for label, _ in links]
    rows, raw = [], []
    for n_layer, d in s["sizes"]:
        params = make_model(n_layer, d, s).config.num_params()
        ref_rows = {}
        for name, compiled in (("plain PyTorch", False), ("plain torch.compile", True)):
            r = run_plain(make_model(n_layer, d, s), data, s, compiled)
            ref_rows[name] = r
            rows.append([f"L{n_layer} d{d}", f"{params / 1e6:.1f}M", name, "-", "-", f"{r['compile_s']:.1f}",
                         f"{r['step_s']:.3f}", "-", "-", "-", "-"])
            raw.append(dict(size=[n_layer, d], system=name, **{k: v for k, v in r.items()}))
        base = ref_rows["plain PyTorch"]
        probe = pscompile.compile(make_model(n_layer, d, s), data[0], config=pscompile.Config(
            mode="compiled", backend="eager", device="cpu", dtype=torch.float32))
        probe.step(data[0])
        minimum, chunk = probe.min_device_memory, probe.layout.chunk_size
        everything = probe.stats.peak_device_bytes
        probe.close()
        budgets = [("tight", minimum + 2 * chunk * 4), ("mid", (minimum + everything) // 2), ("none", None)]
        systems = [("hooks", dict(mode="hooks")), ("compiled eager", dict(mode="compiled", backend="eager"))]
        if args.inductor:
            systems.append(("compiled inductor", dict(mode="compiled", backend="inductor")))
        compiled = [(n, kw) for n, kw in systems if kw["mode"] == "compiled"]
        for planner in [p.strip() for p in args.planners.split(",") if p.strip() != "belady"]:
            systems += [(f"{n} ({planner})", dict(kw, planner=planner)) for n, kw in compiled]
        for bname, budget in budgets:
            for link, bw in [(None, None), *(links if budget is not None else [])]:
                for sname, kw in systems:
                    cfg = pscompile.Config(device="cpu", dtype=torch.float32, device_memory=budget,
                                           chunk_size=chunk, link_bandwidth=bw, **kw)
                    row = run_system(sname, cfg, link, n_layer, d, data, s, base)
                    row["budget_name"] = bname
                    raw.append(row)
                    rows.append(table_row(row, bname, base))
    headers = ["model", "params", "system", "budget", "link", "compile s", "step s", "step / plain",
               "peak MiB", "MiB moved", "max |dloss|"]
    caption = ("GPT, float32, one thread; step = median of steps after warm-up; compile = engine construction + "
               "first (measuring) step; peak = largest measured peak of every step, the first included; "
               "|dloss| = max loss difference vs plain PyTorch")
    print(caption)
    print(tabulate(rows, headers=headers))
    bounds = bound_rows(raw)
    bcaption = ("bytes moved per step vs a lower bound computed from compiled mode's access sequence: Belady's "
                "fewest fetches for its capacities + the gradient bytes the host-side update needs (hooks rows: "
                "compiled eager's bound at that budget, a reference)")
    print("\n" + bcaption)
    bheaders = ["model", "system", "budget", "MiB moved", "lower bound MiB", "moved / bound"]
    print(tabulate(bounds, headers=bheaders))
    if args.markdown:
        print("\n" + caption + "\n")
        print(tabulate(rows, headers=headers, tablefmt="github"))
        print("\n" + bcaption + "\n")
        print(tabulate(bounds, headers=bheaders, tablefmt="github"))
    failed = [(r, p) for r in raw if "budget" in r for p in problems_of(r)]
    for r, p in failed:
        print(f"FAILED L{r['size'][0]} d{r['size'][1]} {r['system']} {r['budget_name']} link={r['link']}: {p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, rows=raw, failed=len(failed)), indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
