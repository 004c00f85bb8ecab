"""Time to first step with a cold Inductor cache: plain torch.compile against pscompile.

Each (system, model) runs in a process of its own whose Inductor cache is a new, empty temporary
directory (``TORCHINDUCTOR_CACHE_DIR``), so nothing compiled before is reused, in memory or on disk.
The clock starts before the model is built and stops when the first training step has returned:

- ``plain torch.compile``: ``torch.compile(model)``, ``torch.optim.AdamW(fused=True)``, one step
  (forward, backward, update; Inductor compiles forward and backward in that step);
- ``pscompile compiled``: ``pscompile.compile(model, batch, Config(mode="compiled",
  backend="inductor", ...))`` and ``engine.step(batch)`` (capture, planning, the measuring step and
  the compile of every region), with no budget and at a tight one (the model's minimum plus two
  chunks, found by an eager probe in a process of its own, so it warms nothing that is timed).

The second step's time is reported beside it (compile work left for later would show there).
Float32, one torch thread, GPT shapes of ``bench/compare.py``.

    python bench/first_step.py [--quick] [--markdown] [--backend eager] [--out bench/results/first_step.json]
"""

from __future__ import annotations

import sys
import time

from harness.output import parser, write_json
from harness.runner import ChildFailed, child, run_fresh

FULL = dict(sizes=[(2, 128), (4, 256)], vocab=4096, seq=128, batch=4)
QUICK = dict(sizes=[(2, 64)], vocab=512, seq=64, batch=2)
SYSTEMS = ("plain torch.compile", "pscompile compiled, no budget", "pscompile compiled, tight")


def _child(spec: dict) -> dict:
    """One measurement, in this (fresh) process; ``system="probe"``: the tight budget (untimed)."""
    import torch

    torch.set_num_threads(1)
    from harness.systems import compiled, plain_step
    from harness.specs import gpt, token_batches

    system, (n_layer, d), s, budget = spec["system"], spec["size"], spec["s"], spec["budget"]
    data = token_batches(s["vocab"], s["batch"], s["seq"], 2, seed=1)
    if system == "probe":
        probe = compiled(gpt(n_layer, d, s["vocab"], s["seq"]), data[0], "eager", None)
        probe.step(data[0])
        return dict(budget=probe.min_device_memory + 2 * probe.layout.chunk_size * 4)
    t0 = time.perf_counter()
    if system == "plain torch.compile":
        step = plain_step(gpt(n_layer, d, s["vocab"], s["seq"]), spec["backend"])
    else:
        engine = compiled(gpt(n_layer, d, s["vocab"], s["seq"]), data[0], spec["backend"], budget)
        step = engine.step
    first_loss = step(data[0])
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    step(data[1])
    second = time.perf_counter() - t1
    return dict(system=system, size=[n_layer, d], budget=budget, first_step_s=first, second_step_s=second,
                first_loss=first_loss)


def measure(system: str, n_layer: int, d: int, s: dict, timeout: float, backend: str = "inductor",
            budget: int | None = None) -> dict:
    """``_child`` in a new process with an empty Inductor cache."""
    spec = dict(system=system, size=[n_layer, d], s=s, backend=backend, budget=budget)
    try:
        return run_fresh(__file__, spec, timeout=timeout, cold_inductor=True, threads=1)
    except ChildFailed as e:
        return dict(system=system, size=[n_layer, d], error=e.tail[-500:])


def main(argv=None) -> int:
    ap = parser(__doc__, "first_step", markdown=True, child=True)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    ap.add_argument("--backend", choices=("inductor", "eager"), default="inductor",
                    help="the compiler backend of every system (eager: the script's own smoke test, no Inductor)")
    args = ap.parse_args(argv)
    if child(args.child, _child):
        return 0
    s = QUICK if args.quick else FULL
    rows, raw = [], []
    for n_layer, d in s["sizes"]:
        base = None
        tight = measure("probe", n_layer, d, s, args.timeout)       # its own process: it warms nothing
        if "error" in tight:
            raise SystemExit(f"probing the tight budget failed: {tight['error']}")
        for system in SYSTEMS:
            r = measure(system, n_layer, d, s, args.timeout, args.backend,
                        tight["budget"] if system.endswith("tight") else None)
            raw.append(r)
            print(f"L{n_layer} d{d} {system}: " + (r["error"].splitlines()[-1] if "error" in r else
                                                   f"{r['first_step_s']:.1f} s"), flush=True)
            if "error" in r:
                rows.append([f"L{n_layer} d{d}", system, "-", "error", "-", "-"])
                continue
            base = base or (r if system == "plain torch.compile" else None)
            ratio = f"{r['first_step_s'] / base['first_step_s']:.2f}" if base else "-"
            rows.append([f"L{n_layer} d{d}", system, "-" if r["budget"] is None else f"{r['budget'] / 2**20:.2f} MiB",
                         f"{r['first_step_s']:.1f}", ratio, f"{r['second_step_s']:.3f}"])
    headers = ["model", "system", "budget", "first step s (cold)", "/ torch.compile", "second step s"]
    caption = ("time to first step, each in a fresh process with an empty Inductor cache: model construction "
               f"+ compile + the first training step; backend {args.backend}, float32, one thread")
    from tabulate import tabulate
    print(caption)
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if args.markdown:
        print("\n" + caption + "\n")
        print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    write_json(args.out, dict(settings=s, backend=args.backend, rows=raw))
    return 1 if any("error" in r for r in raw) else 0


if __name__ == "__main__":
    sys.exit(main())
