"""Training-loop features on GPT: gradient accumulation and evaluation, plain PyTorch vs pscompile.

In one run, with the same data and seed:

- **memory**: the device memory one step on the whole batch (B = k x b sequences) needs, against
  k micro-batches of b accumulated into one update (compiled mode's planned minimum for each);
- **accumulation**: ``step([b1..bk])`` under a budget near the micro-batch minimum (too small for
  the whole batch in one step) in hooks mode and compiled mode, against plain PyTorch's
  ``(loss / k).backward()`` k times with everything on the device: step time, ratio, measured peak,
  bytes moved per step, and the largest loss difference over the steps;
- **evaluation**: ``evaluate(batch)`` (forward only, its own schedule) against plain PyTorch's
  forward under ``torch.no_grad()``: time, ratio, peak, bytes moved, loss difference.

    python bench/loops.py [--quick] [--inductor] [--link 100MB/s] [--markdown] [--out bench/results/loops.json]

Float32, one torch thread (see bench/foundation.py for why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer
from pscompile.units import format_bytes

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "loops.json"

FULL = dict(n_layer=4, d=256, vocab=4096, seq=128, micro=4, k=4, warmup=3, steps=4, evals=5)
QUICK = dict(n_layer=2, d=64, vocab=512, seq=64, micro=2, k=4, warmup=1, steps=2, evals=2)


def make_model(s: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=s["n_layer"], n_head=max(1, s["d"] // 64), d_model=s["d"],
                         vocab_size=s["vocab"], seq_len=s["seq"]))


def micro_batches(s: dict, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, s["vocab"], (s["micro"], s["seq"]), generator=g),
             torch.randint(0, s["vocab"], (s["micro"], s["seq"]), generator=g)) for _ in range(n)]


def whole(group: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])


def compiled_minimum(s: dict, batch) -> int:
    """Compiled mode's minimum budget for one step on ``batch`` (after its measuring step)."""
    engine = pscompile.compile(make_model(s), batch, config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32))
    engine.step(batch)
    minimum, chunk = engine.min_device_memory, engine.layout.chunk_size
    engine.close()
    return minimum, chunk


def timed(fn, n: int, warmup: int) -> tuple[list, list[float]]:
    out, times = [], []
    for i in range(warmup + n):
        t = time.perf_counter()
        out.append(fn(i))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return out, times


def run_system(name: str, cfg_kw: dict, s: dict, hp: pscompile.AdamW, example, groups: list, eval_batch,
               plain: dict, ref_losses: list[float], budget: int) -> dict:
    """Accumulation steps and evaluations of one pscompile system under ``budget``: its row, or
    ``{"system", "error"}`` when it raised (the script then exits 1)."""
    engine = None
    try:
        t0 = time.perf_counter()
        engine = pscompile.compile(make_model(s), example, optimizer=hp, config=pscompile.Config(**cfg_kw))
        stats = []

        def step(i):
            loss = engine.step(groups[i])
            stats.append(engine.stats)
            return loss
        losses, times = timed(step, s["steps"], s["warmup"])
        eval_peaks = []

        def evaluate(_):
            loss = engine.evaluate(eval_batch)
            eval_peaks.append(engine.eval_peak_device_bytes)
            return loss
        evals, eval_times = timed(evaluate, s["evals"], 1)
        total_s = time.perf_counter() - t0
        last = stats[-1]
        return dict(
            system=name, step_s=statistics.median(times), step_ratio=statistics.median(times) / plain["step_s"],
            peak=max(st.peak_device_bytes for st in stats), within_budget=all(st.peak_device_bytes <= budget
                                                                                for st in stats),
            h2d=last.h2d_bytes, d2h=last.d2h_bytes, fetches=last.num_fetches,
            max_dloss=max(abs(a - b) for a, b in zip(losses, ref_losses)),
            eval_s=statistics.median(eval_times), eval_ratio=statistics.median(eval_times) / plain["eval_s"],
            eval_peak=max(eval_peaks), eval_within_budget=max(eval_peaks) <= budget,
            eval_moved=engine.eval_bytes_moved, eval_dloss=abs(evals[-1] - plain["eval_loss"]), total_s=total_s)
    except Exception as e:                    # noqa: BLE001 - recorded in the row; the script exits 1
        return dict(system=name, error=f"{type(e).__name__}: {e}")
    finally:
        if engine is not None:
            engine.close()


def problems_of(row: dict) -> list[str]:
    """Why a system's row failed: an exception, or a step or an evaluation over the budget."""
    if "error" in row:
        return [row["error"]]
    return ([] if row["within_budget"] else [f"a step's measured peak exceeded the budget (max {row['peak']})"]) + \
        ([] if row["eval_within_budget"] else [f"evaluate's measured peak {row['eval_peak']} exceeded the budget"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inductor", action="store_true", help="also run compiled mode with backend='inductor'")
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="emulate a device<->host link of this bandwidth for the pscompile runs, e.g. 100MB/s")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    k, n_steps = s["k"], s["warmup"] + s["steps"]
    micro = micro_batches(s, k * n_steps)
    groups = [micro[i * k:(i + 1) * k] for i in range(n_steps)]
    eval_batch = micro_batches(s, 1, seed=7)[0]
    params = make_model(s).config.num_params()

    # -- memory: the whole batch in one step vs k micro-batches ---------------------------------
    min_micro, chunk = compiled_minimum(s, micro[0])
    min_whole, _ = compiled_minimum(s, whole(groups[0]))
    budget = min_micro + 2 * chunk * 4
    memory = dict(micro_batch=s["micro"], k=k, min_micro_bytes=min_micro, min_whole_bytes=min_whole,
                  budget=budget, whole_fits=min_whole <= budget)

    # -- plain PyTorch -------------------------------------------------------------------------
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model(s), optimizer=hp, dtype=torch.float32)
    ref_losses, ref_times = timed(lambda i: ref.step(groups[i]), s["steps"], s["warmup"])

    def ref_eval(_):
        with torch.no_grad():
            return float(ref.model(*eval_batch))
    ref_eval_losses, ref_eval_times = timed(ref_eval, s["evals"], 1)
    plain = dict(step_s=statistics.median(ref_times), eval_s=statistics.median(ref_eval_times),
                 losses=ref_losses, eval_loss=ref_eval_losses[-1])

    systems = [("hooks", dict(mode="hooks")), ("compiled eager", dict(mode="compiled", backend="eager"))]
    if args.inductor:
        systems.append(("compiled inductor", dict(mode="compiled", backend="inductor")))
    results = [run_system(name, dict(device="cpu", dtype=torch.float32, device_memory=budget, chunk_size=chunk,
                                     link_bandwidth=args.link, **kw), s, hp, micro[0], groups, eval_batch,
                          plain, ref_losses, budget) for name, kw in systems]
    ok = [r for r in results if "error" not in r]

    b = s["micro"]
    print(f"GPT L{s['n_layer']} d{s['d']} ({params / 1e6:.1f}M params), seq {s['seq']}, float32, one thread; "
          f"k={k} micro-batches of {b} = batch {k * b}"
          + (f"; emulated link {args.link} for pscompile" if args.link else ""))
    mem_rows = [[f"one step on batch {k * b}", format_bytes(min_whole)],
                [f"{k} accumulated micro-batches of {b}", format_bytes(min_micro)],
                ["budget used below", f"{format_bytes(budget)} (fits batch {k * b} in one step: "
                                      f"{'yes' if memory['whole_fits'] else 'no'})"]]
    mem_headers = ["compiled mode's minimum device memory for", "bytes"]
    acc_headers = ["system", "step s", "step / plain", "peak MiB", "within budget", "h2d MiB", "d2h MiB",
                   "max |dloss|"]
    acc_rows = [["plain PyTorch (no budget)", f"{plain['step_s']:.3f}", "1.00", "-", "-", "-", "-", "-"]]
    acc_rows += [[r["system"], f"{r['step_s']:.3f}", f"{r['step_ratio']:.2f}", f"{r['peak'] / MiB:.2f}",
                  "yes" if r["within_budget"] else "NO", f"{r['h2d'] / MiB:.2f}", f"{r['d2h'] / MiB:.2f}",
                  f"{r['max_dloss']:.1e}"] for r in ok]
    acc_rows += [[r["system"], f"error: {r['error'][:60]}"] + ["-"] * 6 for r in results if "error" in r]
    eval_headers = ["system", "evaluate s", "eval / plain no_grad", "peak MiB", "MiB moved", "|dloss|"]
    eval_rows = [["plain PyTorch no_grad", f"{plain['eval_s']:.4f}", "1.00", "-", "-", "-"]]
    eval_rows += [[r["system"], f"{r['eval_s']:.4f}", f"{r['eval_ratio']:.2f}", f"{r['eval_peak'] / MiB:.2f}",
                   f"{r['eval_moved'] / MiB:.2f}", f"{r['eval_dloss']:.1e}"] for r in ok]
    fmt = "github" if args.markdown else "simple"
    for caption, headers, rows in (("memory", mem_headers, mem_rows),
                                   (f"gradient accumulation, step([b1..b{k}]) (median of {s['steps']} "
                                    "steps after warm-up)", acc_headers, acc_rows),
                                   (f"evaluate(batch of {b}) (median of {s['evals']})", eval_headers, eval_rows)):
        print(f"\n{caption}\n")
        print(tabulate(rows, headers=headers, tablefmt=fmt))
    failed = [(r["system"], p) for r in results for p in problems_of(r)]
    for name, p in failed:
        print(f"FAILED {name}: {p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(settings=s, link=args.link, params=params, memory=memory, plain=plain,
                                        systems=results, failed=len(failed)), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
