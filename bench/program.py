"""One compiled program per schedule: time to a steady step, and the steady step, against plain PyTorch.

The setup of issue 62: a GPT of the project's own model code (width 128, vocabulary 2048, batch
2 x 64, float32, one torch thread) at 2, 4, 8 and 16 layers; the budget is 1.15x the named minimum
(``min_device_memory`` of an eager probe, in a process of its own).

- **cold** (a fresh process and an empty Inductor cache per row): the seconds from
  ``pscompile.compile`` to the end of the first steady step of compiled mode with Inductor (a step
  is steady when it and every later one take at most 1.5x the median of the last four; 12 steps),
  against plain ``torch.compile``'s first step (model built, compiled, one step with fused AdamW);
- **steady** (one process per depth, every system warmed, then their steps interleaved, round by
  round): the median step of pscompile's Inductor program at the budget, over compiled eager's at
  the same budget, over plain PyTorch's eager step with fused AdamW and no budget, and pscompile's
  program with no budget over plain ``torch.compile``'s. The spread is the smallest and largest
  ratio of a round. Every pscompile row says how many of its steps ran compiled code.

    python bench/program.py [--quick] [--layers 2 4 8 16] [--out bench/results/program.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "program.json"
SHAPE = dict(d=128, vocab=2048, seq=64, batch=2)
QUICK = dict(d=64, vocab=256, seq=32, batch=2)
STEPS, ROUNDS = 12, 15


def _setup(n_layer: int, s: dict):
    import torch
    from pscompile.models.gpt import GPT, GPTConfig
    torch.set_num_threads(1)

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, s["d"] // 64), d_model=s["d"], vocab_size=s["vocab"],
                             seq_len=s["seq"]))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)) for _ in range(4)]
    return model, data


def _engine(model, batch, backend: str, budget):
    import torch
    import pscompile
    return pscompile.compile(model(), batch, optimizer=pscompile.AdamW(lr=1e-3), config=pscompile.Config(
        mode="compiled", backend=backend, device="cpu", dtype=torch.float32, device_memory=budget))


def _plain(model, compiled: bool):
    import torch
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    f = torch.compile(m) if compiled else m

    def step(b) -> float:
        loss = f(*b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step


def _steady_at(times: list[float]) -> int:
    """Index of the first step from which every step takes at most 1.5x the last four's median."""
    ref = 1.5 * statistics.median(times[-4:])
    k = len(times) - 1
    while k > 0 and times[k - 1] <= ref:
        k -= 1
    return k


def _child(kind: str, n_layer: int, s: dict, budget) -> dict:
    model, data = _setup(n_layer, s)
    if kind == "probe":
        e = _engine(model, data[0], "eager", None)
        e.step(data[0])
        m = e.min_device_memory
        e.close()
        return dict(minimum=m, budget=int(1.15 * m))
    if kind == "torch.compile":
        t0 = time.perf_counter()
        step = _plain(model, True)
        step(data[0])
        return dict(first_step_s=time.perf_counter() - t0)
    if kind == "cold":
        t0 = time.perf_counter()
        e = _engine(model, data[0], "inductor", budget)
        times, ends, compiled = [], [], []
        for i in range(STEPS):
            t = time.perf_counter()
            e.step(data[i % len(data)])
            times.append(time.perf_counter() - t)
            ends.append(time.perf_counter() - t0)
            compiled.append(e.stats.compiled_share)
        peak = max(e.stats.peak_device_bytes, 0)
        e.close()
        k = _steady_at(times)
        return dict(steady_step=k, to_steady_s=ends[k], step_s=times, compiled_share=compiled, peak=peak)
    return _steady(model, data, budget)


def _steady(model, data, budget) -> dict:
    """Every system warmed, then ROUNDS rounds of one step each, interleaved."""
    systems = {
        "inductor@budget": _engine(model, data[0], "inductor", budget),
        "eager@budget": _engine(model, data[0], "eager", budget),
        "inductor@none": _engine(model, data[0], "inductor", None),
    }
    steps = {name: e.step for name, e in systems.items()}
    steps["plain"] = _plain(model, False)
    steps["torch.compile"] = _plain(model, True)
    for _ in range(6):                       # warm: measuring step, compiles, warm variants
        for i, f in enumerate(steps.values()):
            f(data[i % len(data)])
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(ROUNDS):
        for name, f in steps.items():
            t = time.perf_counter()
            f(data[r % len(data)])
            times[name].append(time.perf_counter() - t)
    share = {k: e.stats.compiled_share for k, e in systems.items()}
    peaks = {k: e.stats.peak_device_bytes for k, e in systems.items()}
    for e in systems.values():
        e.close()
    return dict(times=times, compiled_share=share, peaks=peaks)


def _run(kind: str, n_layer: int, s: dict, budget, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="pscompile-cold-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        spec = json.dumps(dict(kind=kind, n_layer=n_layer, s=s, budget=budget))
        p = subprocess.run([sys.executable, __file__, "--_child", spec], env=env, capture_output=True, text=True,
                           timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{kind} L{n_layer} failed:\n{(p.stderr or p.stdout)[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _ratio(times: dict, a: str, b: str) -> tuple[float, float, float]:
    per = [x / y for x, y in zip(times[a], times[b])]
    return statistics.median(times[a]) / statistics.median(times[b]), min(per), max(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers of a d=64 GPT (the smoke test)")
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        spec = json.loads(args._child)
        print(json.dumps(_child(spec["kind"], spec["n_layer"], spec["s"], spec["budget"])))
        return 0
    from tabulate import tabulate
    s = QUICK if args.quick else SHAPE
    layers = args.layers or ([2] if args.quick else [2, 4, 8, 16])
    rows, raw = [], []
    for n in layers:
        probe = _run("probe", n, s, None, args.timeout)
        cold = _run("cold", n, s, probe["budget"], args.timeout)
        tc = _run("torch.compile", n, s, None, args.timeout)
        st = _run("steady", n, s, probe["budget"], args.timeout)
        t = st["times"]
        ce, pe, nb = _ratio(t, "inductor@budget", "eager@budget"), _ratio(t, "inductor@budget", "plain"), \
            _ratio(t, "inductor@none", "torch.compile")
        rows.append([n, f"{cold['to_steady_s']:.1f} (step {cold['steady_step'] + 1})", f"{tc['first_step_s']:.1f}",
                     f"{cold['to_steady_s'] / tc['first_step_s']:.2f}",
                     *(f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in (ce, pe, nb)),
                     f"{st['compiled_share']['inductor@budget']:.2f}",
                     f"{statistics.median(t['plain']) * 1e3:.1f}"])
        raw.append(dict(layers=n, probe=probe, cold=cold, torch_compile=tc, steady=st))
        print(f"L{n}: {rows[-1]}", flush=True)
    headers = ["layers", "pscompile: s to a steady step", "torch.compile first step s", "ratio",
               "steady / compiled eager (same budget)", "steady / plain PyTorch (no budget)",
               "no budget: / torch.compile", "compiled share", "plain step ms"]
    table = tabulate(rows, headers, tablefmt="github")
    print(f"GPT d={s['d']}, vocabulary {s['vocab']}, batch {s['batch']} x {s['seq']}, float32, one thread; budget "
          f"1.15x the minimum; steady ratios: medians of {ROUNDS} interleaved rounds (smallest-largest round)")
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(shape=s, rows=raw, table=table), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
