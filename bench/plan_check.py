"""The planner checked against this machine (docs/planner.md): ``pscompile.plan`` with the machine
calibrated (``planner.calibrated``: matmul rate, copy rate, per-op cost, the emulated link's rate),
then ``pscompile.compile`` and real steps at the same budget and link, for small GPTs.

Per case: planned against measured bytes moved and peak device bytes of the first step (equal:
tests/test_planner.py), and estimated against measured step times, of the first step and the
median of the steps after the second (the steady state). Compiled mode, eager backend, float32,
one thread. The target: estimates within 25% of the measurements.

    python bench/plan_check.py [--quick] [--steps N] [--out bench/results/plan_check.json]
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config, median_after, train
from harness.specs import gpt, gpt_config, token_batches
from pscompile.memory.rates import calibrated_link
from pscompile.planner import calibrated, plan
from pscompile.units import format_bytes

# (n_layer, d_model, vocab, batch, seq)
CASES = [(2, 256, 512, 8, 128), (4, 384, 512, 8, 128)]
QUICK = [(2, 128, 256, 4, 64)]
LINK = "v100"          # Config.link_bandwidth: as slow, relative to this CPU, as a V100's PCIe
SLACK = (1.0, 1.25)    # budgets: the least, and 25% above it


def run_case(case: tuple, slack: float, steps: int, link: float) -> dict:
    n_layer, d, vocab, batch, seq = case
    data = token_batches(vocab, batch, seq, 2)
    base = cpu_config(activations="recompute", host_memory=4 << 30)
    budget = int(pscompile.min_device_memory(gpt(n_layer, d, vocab, seq), data[0], base) * slack)
    hw = calibrated(gpu_memory=budget, cpu_memory=4 << 30, link_bandwidth=link)
    report = plan(gpt_config(n_layer, d, vocab, seq), (batch, seq), hardware=hw, config=base)
    engine = pscompile.compile(gpt(n_layer, d, vocab, seq), data[0],
                               config=dataclasses.replace(base, device_memory=budget, link_bandwidth=link))
    _, stats = train(engine, [data[i % 2] for i in range(steps)])
    first, measured = stats[0], median_after(stats, "time_s", skip=2)
    return dict(case=f"d{d} L{n_layer}", slack=slack, budget=budget, params=report.params, fits=report.fits,
                planned_h2d=report.h2d_bytes, measured_h2d=first.chunk_h2d_bytes,
                planned_d2h=report.d2h_bytes, measured_d2h=first.chunk_d2h_bytes,
                planned_peak=report.peak_device_bytes, measured_peak=first.peak_device_bytes,
                estimated_s=report.iteration_s, estimated_compute_s=report.compute_s,
                estimated_optimizer_s=report.optimizer_s, estimated_first_s=report.first_iteration_s,
                measured_first_s=first.time_s, measured_s=measured,
                ratio=report.iteration_s / measured, hardware=hw.note)


def main(argv=None) -> int:
    ap = parser(__doc__, "plan_check", quick="one tiny case (smoke test)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    link = calibrated_link(LINK)
    rows = []
    for case in (QUICK if args.quick else CASES):
        for slack in SLACK:
            r = run_case(case, slack, args.steps, link)
            rows.append(r)
            print(f"{r['case']} budget {format_bytes(r['budget'])}: estimated {r['estimated_s']:.3f} s, "
                  f"measured {r['measured_s']:.3f} s ({r['ratio']:.2f}x)", flush=True)
    fb = format_bytes
    print(table([[r["case"], f"{r['slack']:.2f}x least", fb(r["budget"]),
                  f"{fb(r['planned_h2d'] + r['planned_d2h'])} / {fb(r['measured_h2d'] + r['measured_d2h'])}",
                  f"{fb(r['planned_peak'])} / {fb(r['measured_peak'])}",
                  f"{r['estimated_first_s'] * 1e3:.0f} / {r['measured_first_s'] * 1e3:.0f} ms "
                  f"({r['estimated_first_s'] / r['measured_first_s']:.2f})",
                  f"{r['estimated_s'] * 1e3:.0f} / {r['measured_s'] * 1e3:.0f} ms ({r['ratio']:.2f})"] for r in rows],
                ["model", "budget", "", "moved: planned / measured", "peak: planned / measured",
                 "first step: estimated / measured", "later steps: estimated / measured"]))
    write_json(args.out, {"link_bytes_per_s": link, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
