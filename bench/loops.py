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

import statistics
import sys
import time

import torch

import pscompile
from compare import probe, tight
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt_of, token_batches
from harness.timing import time_reps
from pscompile.testing import ReferenceTrainer
from pscompile.units import format_bytes

MiB = 2**20
FULL = dict(n_layer=4, d=256, vocab=4096, seq=128, micro=4, k=4, warmup=3, steps=4, evals=5)
QUICK = dict(n_layer=2, d=64, vocab=512, seq=64, micro=2, k=4, warmup=1, steps=2, evals=2)


def whole(group: list) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group])


def timed(fn, n: int, warmup: int) -> tuple[list, list[float]]:
    """``fn()``'s results and the seconds of the last ``n`` of ``warmup + n`` calls."""
    out = []
    return out, time_reps(lambda: out.append(fn()), n, warmup=warmup)


def run_system(name: str, cfg: pscompile.Config, s: dict, hp: pscompile.AdamW, example, groups: list, eval_batch,
               plain: dict, ref_losses: list[float], budget: int) -> dict:
    """Accumulation steps and evaluations of one pscompile system under ``budget``: its row, or
    ``{"system", "error"}`` when it raised (the script then exits 1)."""
    engine = None
    try:
        t0 = time.perf_counter()
        engine = pscompile.compile(gpt_of(s), example, optimizer=hp, config=cfg)
        stats, eval_peaks, rest = [], [], iter(groups)

        def step():
            loss = engine.step(next(rest))
            stats.append(engine.stats)
            return loss
        losses, times = timed(step, s["steps"], s["warmup"])

        def evaluate():
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
    ap = parser(__doc__, "loops", markdown=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inductor", action="store_true", help="also run compiled mode with backend='inductor'")
    ap.add_argument("--link", metavar="RATE", default=None,
                    help="emulate a device<->host link of this bandwidth for the pscompile runs, e.g. 100MB/s")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    k, n_steps = s["k"], s["warmup"] + s["steps"]
    micro = token_batches(s["vocab"], s["micro"], s["seq"], k * n_steps, seed=1)
    groups = [micro[i * k:(i + 1) * k] for i in range(n_steps)]
    eval_batch = token_batches(s["vocab"], s["micro"], s["seq"], 1, seed=7)[0]
    params = gpt_of(s).config.num_params()

    # -- memory: the whole batch in one step vs k micro-batches ---------------------------------
    min_micro, chunk, _ = probe(gpt_of(s), micro[0])
    min_whole, _, _ = probe(gpt_of(s), whole(groups[0]))
    budget = tight(min_micro, chunk)
    memory = dict(micro_batch=s["micro"], k=k, min_micro_bytes=min_micro, min_whole_bytes=min_whole,
                  budget=budget, whole_fits=min_whole <= budget)

    # -- plain PyTorch -------------------------------------------------------------------------
    hp = adamw(1e-3)
    ref = ReferenceTrainer(gpt_of(s), optimizer=hp, dtype=torch.float32)
    rest = iter(groups)
    ref_losses, ref_times = timed(lambda: ref.step(next(rest)), s["steps"], s["warmup"])

    def ref_eval():
        with torch.no_grad():
            return float(ref.model(*eval_batch))
    ref_eval_losses, ref_eval_times = timed(ref_eval, s["evals"], 1)
    plain = dict(step_s=statistics.median(ref_times), eval_s=statistics.median(ref_eval_times),
                 losses=ref_losses, eval_loss=ref_eval_losses[-1])

    systems = [("hooks", dict(mode="hooks")), ("compiled eager", dict(mode="compiled", backend="eager"))]
    if args.inductor:
        systems.append(("compiled inductor", dict(mode="compiled", backend="inductor")))
    results = [run_system(name, cpu_config(device_memory=budget, chunk_size=chunk, link_bandwidth=args.link, **kw), s,
                          hp, micro[0], groups, eval_batch, plain, ref_losses, budget) for name, kw in systems]
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
    for caption, headers, rows in (("memory", mem_headers, mem_rows),
                                   (f"gradient accumulation, step([b1..b{k}]) (median of {s['steps']} "
                                    "steps after warm-up)", acc_headers, acc_rows),
                                   (f"evaluate(batch of {b}) (median of {s['evals']})", eval_headers, eval_rows)):
        print(f"\n{caption}\n")
        print(table(rows, headers, markdown=args.markdown))
    failed = [(r["system"], p) for r in results for p in problems_of(r)]
    for name, p in failed:
        print(f"FAILED {name}: {p}")
    write_json(args.out, dict(settings=s, link=args.link, params=params, memory=memory, plain=plain,
                              systems=results, failed=len(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
