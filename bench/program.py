"""One compiled program per schedule: time to a steady step, and the steady step, against plain PyTorch.

The setup of issue 62: a GPT of the project's own model code (width 128, vocabulary 2048, batch
2 x 64, float32, one torch thread) at 2, 4, 8 and 16 layers; the budget is 1.15x (``--factor``) the
minimum ``pscompile.min_device_memory`` names with the default ``Config`` (Inductor), in a process
of its own.

- **cold** (a fresh process and an empty Inductor cache per row): the seconds from
  ``pscompile.compile`` to the end of the first steady step of compiled mode with Inductor (a step
  is steady when it and every later one take at most 1.5x the median of the last four; 12 steps),
  against plain ``torch.compile``'s first step (model built, compiled, one step with fused AdamW);
- **steady** (one process per depth, every system warmed, then their steps interleaved, round by
  round): the median step of pscompile's Inductor program at the budget, over compiled eager's at
  the same budget, over plain PyTorch's eager step with fused AdamW and no budget, and pscompile's
  program with no budget over plain ``torch.compile``'s. The spread is the smallest and largest
  ratio of a round. Every pscompile row says how many of its steps ran compiled code.

- **shares** (``--shares``: the cold runs only, at each budget of ``--factors`` and head count of
  ``--heads``): what each step ran (``StepStats.compiled_share``), the largest peak over the
  budget, how many programs were compiled, and how many of those never ran (their buffers did not
  fit the plan: paid for, then planned again).

    python bench/program.py [--quick] [--layers 2 4 8 16] [--factor 1.15] [--out bench/results/program.json]
    python bench/program.py --shares [--layers 2 4 8 16] [--heads 4 2] [--factors 1.0 1.15 1.5 2.0]
"""

from __future__ import annotations

import logging
import statistics
import time
from functools import partial

from harness.output import parser, table, write_json
from harness.runner import ChildFailed, child, run_fresh
from harness.timing import interleave, ratio, spread, steady_at

SHAPE = dict(d=128, vocab=2048, seq=64, batch=2)
QUICK = dict(d=64, vocab=256, seq=32, batch=2)
STEPS, ROUNDS = 12, 15


def _child(spec: dict) -> dict:
    import torch
    from harness.systems import compiled, plain_step
    from harness.specs import gpt, token_batches
    torch.set_num_threads(1)
    kind, s, budget = spec["kind"], spec["s"], spec["budget"]
    model = partial(gpt, spec["n_layer"], s["d"], s["vocab"], s["seq"], **_heads(spec))
    data = token_batches(s["vocab"], s["batch"], s["seq"], 4, seed=1)
    if kind == "probe":            # the minimum a user is told for the default backend
        import pscompile
        m = pscompile.min_device_memory(model(), data[0], pscompile.Config(device="cpu", dtype=torch.float32))
        return dict(minimum=m, budget=int(spec["factor"] * m))
    if kind == "torch.compile":
        t0 = time.perf_counter()
        step = plain_step(model(), "inductor")
        step(data[0])
        return dict(first_step_s=time.perf_counter() - t0)
    if kind == "cold":
        programs = _ProgramCount()
        t0 = time.perf_counter()
        e = compiled(model(), data[0], "inductor", budget)
        times, ends, share, peaks = [], [], [], []
        for i in range(STEPS):
            t = time.perf_counter()
            e.step(data[i % len(data)])
            times.append(time.perf_counter() - t)
            ends.append(time.perf_counter() - t0)
            share.append(e.stats.compiled_share)
            peaks.append(e.stats.peak_device_bytes)
        e.close()
        k = steady_at(times)
        return dict(steady_step=k, to_steady_s=ends[k], step_s=times, compiled_share=share, peak=max(peaks),
                    peaks=peaks, programs=programs.close())
    systems = {"inductor@budget": compiled(model(), data[0], "inductor", budget),
               "eager@budget": compiled(model(), data[0], "eager", budget),
               "inductor@none": compiled(model(), data[0], "inductor", None)}
    steps = {name: e.step for name, e in systems.items()}
    steps["plain"] = plain_step(model())
    steps["torch.compile"] = plain_step(model(), "inductor")
    for _ in range(6):                       # warm: measuring step, compiles, warm variants
        for i, f in enumerate(steps.values()):
            f(data[i % len(data)])
    times = interleave({k: (lambda r, f=f: f(data[r % len(data)])) for k, f in steps.items()}, ROUNDS)
    share = {k: e.stats.compiled_share for k, e in systems.items()}
    peaks = {k: e.stats.peak_device_bytes for k, e in systems.items()}
    for e in systems.values():
        e.close()
    return dict(times=times, compiled_share=share, peaks=peaks)


def _heads(spec: dict) -> dict:
    """The GPT's head count where the run names one (``--heads``); else the bench GPT's own."""
    return {"n_head": spec["heads"]} if spec.get("heads") else {}


class _ProgramCount(logging.Handler):
    """Counts the programs compiled in this process (pscompile's INFO record of each compile), and
    those whose buffers did not fit the plan (the record says so): paid for, never run."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = self.unused = 0
        self._log = logging.getLogger("pscompile")
        self._level = self._log.level
        self._log.addHandler(self)
        self._log.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "compiled as one program" in message:
            self.count += 1
            self.unused += "over the plan at" in message    # its buffers did not fit: planned again, not run

    def close(self) -> dict:
        self._log.removeHandler(self)
        self._log.setLevel(self._level)
        super().close()
        return dict(compiled=self.count, not_run=self.unused)


def _run(kind: str, n_layer: int, s: dict, budget, timeout: float, factor: float = 1.15, heads: int | None = None) -> dict:
    """``_child`` in a fresh process with an empty Inductor cache, one thread."""
    try:
        return run_fresh(__file__, dict(kind=kind, n_layer=n_layer, s=s, budget=budget, factor=factor, heads=heads),
                         timeout=timeout, cold_inductor=True, threads=1)
    except ChildFailed as e:
        raise SystemExit(f"{kind} L{n_layer} failed:\n{e.tail}") from None


def main(argv=None) -> int:
    ap = parser(__doc__, "program", quick="2 layers of a d=64 GPT (the smoke test)", child=True)
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--factor", type=float, default=1.15, help="the budget, as a multiple of the named minimum")
    ap.add_argument("--shares", action="store_true",
                    help="only the cold runs, at each of --factors and --heads: what ran, and within which budget")
    ap.add_argument("--factors", type=float, nargs="*", default=[1.0, 1.15, 1.5, 2.0])
    ap.add_argument("--heads", type=int, nargs="*", default=[4])
    args = ap.parse_args(argv)
    if child(args.child, _child):
        return 0
    s = QUICK if args.quick else SHAPE
    layers = args.layers or ([2] if args.quick else [2, 4, 8, 16])
    if args.shares:
        return _shares(args, s, layers)
    rows, raw = [], []
    for n in layers:
        probe = _run("probe", n, s, None, args.timeout, args.factor)
        cold = _run("cold", n, s, probe["budget"], args.timeout)
        tc = _run("torch.compile", n, s, None, args.timeout)
        st = _run("steady", n, s, probe["budget"], args.timeout)
        t = st["times"]
        ratios = (ratio(t, "inductor@budget", "eager@budget"), ratio(t, "inductor@budget", "plain"),
                  ratio(t, "inductor@none", "torch.compile"))
        rows.append([n, f"{cold['to_steady_s']:.1f} (step {cold['steady_step'] + 1})", f"{tc['first_step_s']:.1f}",
                     f"{cold['to_steady_s'] / tc['first_step_s']:.2f}", *map(spread, ratios),
                     f"{st['compiled_share']['inductor@budget']:.2f}", f"{statistics.median(t['plain']) * 1e3:.1f}"])
        raw.append(dict(layers=n, probe=probe, cold=cold, torch_compile=tc, steady=st))
        print(f"L{n}: {rows[-1]}", flush=True)
    headers = ["layers", "pscompile: s to a steady step", "torch.compile first step s", "ratio",
               "steady / compiled eager (same budget)", "steady / plain PyTorch (no budget)",
               "no budget: / torch.compile", "compiled share", "plain step ms"]
    md = table(rows, headers)
    print(f"GPT d={s['d']}, vocabulary {s['vocab']}, batch {s['batch']} x {s['seq']}, float32, one thread; budget "
          f"{args.factor}x the minimum min_device_memory names (default Config: {', '.join(str(r['probe']['minimum']) for r in raw)} "
          f"bytes); steady ratios: medians of {ROUNDS} interleaved rounds (smallest-largest round)")
    print(md)
    write_json(args.out, dict(shape=s, rows=raw, table=md))
    return 0


def _shares(args, s: dict, layers: list[int]) -> int:
    """``--shares``: per depth, head count and budget factor, the cold run of compiled mode with
    Inductor (its own process, an empty cache): the compiled share of its last step, the steps
    from the first that ran the program on, the largest peak over the budget, the programs
    compiled and those of them never run, and the seconds to a steady step."""
    rows, raw = [], []
    for n in layers:
        for h in args.heads:
            for f in args.factors:
                probe = _run("probe", n, s, None, args.timeout, f, heads=h)
                cold = _run("cold", n, s, probe["budget"], args.timeout, heads=h)
                share = cold["compiled_share"]
                first = next((i for i, x in enumerate(share) if x == 1.0), None)
                rows.append([n, h, f"{f:.2f}x", f"{probe['minimum']:,}", f"{share[-1]:.2f}",
                             "-" if first is None else f"{first + 1}-{len(share)}" if min(share[first:]) == 1.0
                             else f"{first + 1} (not all later)", f"{cold['peak'] / probe['budget']:.3f}",
                             cold["programs"]["compiled"], cold["programs"]["not_run"], f"{cold['to_steady_s']:.1f}"])
                raw.append(dict(layers=n, heads=h, factor=f, probe=probe, cold=cold))
                print(f"L{n} h{h} x{f}: {rows[-1]}", flush=True)
    headers = ["layers", "heads", "x minimum", "minimum bytes", "last step's compiled share",
               "steps that ran the program", "peak / budget (largest)", "programs compiled", "of them not run",
               "s to a steady step"]
    md = table(rows, headers)
    print(f"GPT d={s['d']}, vocabulary {s['vocab']}, batch {s['batch']} x {s['seq']}, float32, one thread; "
          f"{STEPS} steps of compiled mode with Inductor per row, each in a fresh process with a cold cache")
    print(md)
    write_json(args.out, dict(shape=s, rows=raw, table=md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
