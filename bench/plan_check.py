"""The planner checked against this machine: ``pscompile.plan`` with the machine calibrated
(``planner.calibrated``: measured matmul rate, copy rate, per-op cost; the emulated link's rate),
then ``pscompile.compile`` and real steps at the same budget and link, for small GPTs.

For each case the table shows the planned and measured bytes moved and peak device bytes of the
first step (the plan ``compile`` starts with; tests/test_planner.py asserts they are equal), and
the estimated and measured step times: of the first step (the schedule the bytes are of; it also
measures the non-model memory), and the median of the steps after the second (the steady state:
each starts with the chunks the last one fetched for it after their update, re-planned with the
measured memory). Compiled mode, eager backend, float32, one thread. The target: estimates within
25% of the measurements.

    python bench/plan_check.py [--quick] [--steps N] [--out bench/results/plan_check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.planner import calibrated, plan
from pscompile.units import format_bytes

# (name, GPTConfig, batch, seq)
CASES = [
    ("d256 L2", GPTConfig(n_layer=2, n_head=4, d_model=256, vocab_size=512, seq_len=128), 8, 128),
    ("d384 L4", GPTConfig(n_layer=4, n_head=6, d_model=384, vocab_size=512, seq_len=128), 8, 128),
]
QUICK = [("d128 L2", GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=256, seq_len=64), 4, 64)]
LINK = "v100"          # Config.link_bandwidth: as slow, relative to this CPU, as a V100's PCIe
SLACK = (1.0, 1.25)    # budgets: the least, and 25% above it


def run_case(name: str, cfg: GPTConfig, batch: int, seq: int, slack: float, steps: int, link: float) -> dict:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)) for _ in range(2)]
    base = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                            activations="recompute", host_memory=4 << 30)
    torch.manual_seed(0)
    least = pscompile.min_device_memory(GPT(cfg), data[0], base)
    budget = int(least * slack)
    hw = calibrated(gpu_memory=budget, cpu_memory=4 << 30, link_bandwidth=link)
    report = plan(cfg, (batch, seq), hardware=hw, config=base)
    torch.manual_seed(0)
    engine = pscompile.compile(GPT(cfg), data[0], config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32, activations="recompute",
        host_memory=4 << 30, device_memory=budget, link_bandwidth=link))
    times, first = [], None
    for i in range(steps):
        engine.step(data[i % 2])
        s = engine.stats
        if i == 0:
            first = s
        if i >= 2:
            times.append(s.time_s)
    engine.close()
    measured = statistics.median(times)
    return dict(case=name, slack=slack, budget=budget, params=report.params, fits=report.fits,
                planned_h2d=report.h2d_bytes, measured_h2d=first.chunk_h2d_bytes,
                planned_d2h=report.d2h_bytes, measured_d2h=first.chunk_d2h_bytes,
                planned_peak=report.peak_device_bytes, measured_peak=first.peak_device_bytes,
                estimated_s=report.iteration_s, estimated_compute_s=report.compute_s,
                estimated_optimizer_s=report.optimizer_s, estimated_first_s=report.first_iteration_s,
                measured_first_s=first.time_s, measured_s=measured,
                ratio=report.iteration_s / measured, hardware=hw.note)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one tiny case (smoke test)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/plan_check.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from pscompile.memory.rates import calibrated_link
    link = calibrated_link(LINK)
    rows = []
    for name, cfg, batch, seq in (QUICK if args.quick else CASES):
        for slack in SLACK:
            r = run_case(name, cfg, batch, seq, slack, args.steps, link)
            rows.append(r)
            print(f"{name} budget {format_bytes(r['budget'])}: estimated {r['estimated_s']:.3f} s, "
                  f"measured {r['measured_s']:.3f} s ({r['ratio']:.2f}x)", flush=True)
    table = [[r["case"], f"{r['slack']:.2f}x least", format_bytes(r["budget"]),
              f"{format_bytes(r['planned_h2d'] + r['planned_d2h'])} / {format_bytes(r['measured_h2d'] + r['measured_d2h'])}",
              f"{format_bytes(r['planned_peak'])} / {format_bytes(r['measured_peak'])}",
              f"{r['estimated_first_s'] * 1e3:.0f} / {r['measured_first_s'] * 1e3:.0f} ms "
              f"({r['estimated_first_s'] / r['measured_first_s']:.2f})",
              f"{r['estimated_s'] * 1e3:.0f} / {r['measured_s'] * 1e3:.0f} ms ({r['ratio']:.2f})"]
             for r in rows]
    print(tabulate(table, headers=["model", "budget", "", "moved: planned / measured", "peak: planned / measured",
                                   "first step: estimated / measured", "later steps: estimated / measured"],
                   tablefmt="github"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"link_bytes_per_s": link, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
