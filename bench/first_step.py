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

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "first_step.json"
FULL = dict(sizes=[(2, 128), (4, 256)], vocab=4096, seq=128, batch=4)
QUICK = dict(sizes=[(2, 64)], vocab=512, seq=64, batch=2)
SYSTEMS = ("plain torch.compile", "pscompile compiled, no budget", "pscompile compiled, tight")


def _child(system: str, n_layer: int, d: int, s: dict, backend: str, budget: int | None) -> dict:
    """One measurement, in this (fresh) process; ``system="probe"``: the tight budget (untimed)."""
    import torch

    torch.set_num_threads(1)
    import pscompile
    from pscompile.models.gpt import GPT, GPTConfig

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, d // 64), d_model=d, vocab_size=s["vocab"],
                             seq_len=s["seq"]))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(2)]
    if system == "probe":
        probe = pscompile.compile(model(), data[0], config=pscompile.Config(
            mode="compiled", backend="eager", device="cpu", dtype=torch.float32))
        probe.step(data[0])
        return dict(budget=probe.min_device_memory + 2 * probe.layout.chunk_size * 4)
    t0 = time.perf_counter()
    if system == "plain torch.compile":
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        cm = torch.compile(m, backend=backend)

        def step(b) -> float:
            loss = cm(*b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
        first_loss = step(data[0])
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        step(data[1])
        second = time.perf_counter() - t1
    else:
        engine = pscompile.compile(model(), data[0], optimizer=pscompile.AdamW(lr=1e-3), config=pscompile.Config(
            mode="compiled", backend=backend, device="cpu", dtype=torch.float32, device_memory=budget))
        first_loss = engine.step(data[0])
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine.step(data[1])
        second = time.perf_counter() - t1
        engine.close()
    return dict(system=system, size=[n_layer, d], budget=budget, first_step_s=first, second_step_s=second,
                first_loss=first_loss)


def measure(system: str, n_layer: int, d: int, s: dict, timeout: float, backend: str = "inductor",
            budget: int | None = None) -> dict:
    """``_child`` in a new process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory(prefix="pscompile-cold-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        spec = json.dumps(dict(system=system, n_layer=n_layer, d=d, s=s, backend=backend, budget=budget))
        proc = subprocess.run([sys.executable, __file__, "--_child", spec], env=env, capture_output=True,
                              text=True, timeout=timeout)
    if proc.returncode != 0:
        return dict(system=system, size=[n_layer, d], error=(proc.stderr or proc.stdout)[-500:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    ap.add_argument("--backend", choices=("inductor", "eager"), default="inductor",
                    help="the compiler backend of every system (eager: the script's own smoke test, no Inductor)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        spec = json.loads(args._child)
        print(json.dumps(_child(spec["system"], spec["n_layer"], spec["d"], spec["s"], spec["backend"],
                                spec["budget"])))
        return 0
    from tabulate import tabulate

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
    print(caption)
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if args.markdown:
        print("\n" + caption + "\n")
        print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, backend=args.backend, rows=raw), indent=1))
    return 1 if any("error" in r for r in raw) else 0


if __name__ == "__main__":
    sys.exit(main())
