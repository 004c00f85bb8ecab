"""The papers' capacity results, replayed by the planner (docs/paper-scale.md shows the tables).

Sections (``--sections``; default all, ``--quick``: table3):

- ``table3``: PatrickStar's Table 3, chunk size and utilisation of its 10B-68B GPTs: the paper's
  search (tensors whole, 128M to 512M elements in steps of 32M) and the layouts compiled mode
  weighs with ``chunk_size="auto"`` on the paper's machine (shapes only: no model is built);
- ``fig10``: Figure 10's largest models on YARD and SuperPod, 1 and 8 GPUs: ``pscompile.plan`` at
  the paper's largest PatrickStar and DeepSpeed sizes and the next size up of each;
- ``pc700``: the first version's $700 PC (RTX 2060 8 GB, 16 GB CPU): the 0.7B GPT, and 1B;
- ``angel``: ANGEL-PTM's Table 5 on one 8x A100 40 GB server: hidden 8192, 128 heads, 26, 68 and
  80 layers, batch 1.

    python bench/paper_scale.py [--quick] [--sections table3,fig10,pc700,angel] [--out PATH]

Each plan of a 10B+ model takes one to three minutes here (capture and planning on fake tensors).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch
from tabulate import tabulate

from harness.output import parser, write_json
from pscompile.config import Config
from pscompile.memory.layout import build_layout, search_chunk_size
from pscompile.models.gpt import GPTConfig, gpt_config
from pscompile.planner import hardware_preset, plan

M = 1 << 20
TABLE3 = {"10b": (288, 94.47), "15b": (480, 92.62), "18b": (312, 91.5), "20b": (288, 90.5), "40b": (288, 90.6),
          "60b": (416, 92.2), "68b": (416, 97.4)}
# (machine, GPUs, PatrickStar's largest, the next size; DeepSpeed-DP's largest, the next size): Figure 10's text
FIG10 = [("yard", 1, "12b", "15b", "4b", "6b"), ("yard", 8, "18b", "20b", "4b", "6b"),
         ("superpod", 1, "50b", "60b", "15b", "18b"), ("superpod", 8, "68b", None, "30b", "40b")]
BATCH, SEQ = 8, 1024


def paper_search(numels: list[int]) -> tuple[int, float]:
    """PatrickStar's offline search: sizes 128M..512M elements in steps of 32M, tensors kept whole
    (a new chunk when one does not fit), the size of the highest utilisation."""
    best = None
    total = sum(numels)
    for size in range(128 * M, 512 * M + 1, 32 * M):
        if size < max(numels):
            continue
        n, off = 1, 0
        for x in numels:
            if off + x > size:
                n, off = n + 1, 0
            off += x
        u = total / (n * size)
        if best is None or u > best[1]:
            best = (size, u)
    return best


def table3() -> list[dict]:
    rows = []
    for key, (size_m, util) in TABLE3.items():
        cfg = gpt_config(f"ps-{key}")
        shapes = cfg.param_shapes()
        numels = [int(torch.Size(sh).numel()) for _, sh in shapes]
        psize, putil = paper_search(numels)
        machine = "yard" if key in ("10b", "15b", "18b") else "superpod"
        budget = hardware_preset(machine).device_budget
        sizes = [search_chunk_size(numels, max_chunk_size=budget // (2 * f)).chunk_size for f in (8, 16, 32)]
        sizes.append(search_chunk_size(numels, keep_tensors_whole=True).chunk_size)
        auto = [build_layout(shapes, cs).utilisation for cs in sizes]
        rows.append(dict(model=key.upper(), params=sum(numels), layers=cfg.n_layer, hidden=cfg.d_model,
                         paper_size_m=size_m, paper_util=util, search_size_m=psize / M, search_util=100 * putil,
                         auto_min_util=100 * min(auto), auto_utils=[100 * u for u in auto], machine=machine))
        print(f"table3 {key}: paper {size_m}M {util}%, search {psize / M:.0f}M {100 * putil:.2f}%, "
              f"auto {100 * min(auto):.2f}%+", flush=True)
    return rows


def _plan(name: str, machine: str, gpus: int, batch: int = BATCH, seq: int = SEQ, cfg: GPTConfig | None = None):
    cfg = cfg or gpt_config(f"ps-{name}")
    hw = hardware_preset(machine).with_(gpus=gpus)
    r = plan(cfg, (batch, seq), hardware=hw, config=Config(device="cpu", dtype=torch.float16))
    row = dict(model=name.upper(), machine=machine, gpus=gpus, batch=batch, params=r.params, fits=r.fits,
               overflow=r.overflow, tflops=r.tflops_per_gpu, iteration_s=r.iteration_s,
               baseline_fits=r.baseline_fits, baseline_detail=r.baseline_detail, plan_s=r.plan_s,
               activations=r.activations, peak=r.peak_device_bytes)
    print(f"{machine} x{gpus} {name}: {'fits' if r.fits else 'no'} {r.tflops_per_gpu:.1f} TFLOP/s; "
          f"static {'fits' if r.baseline_fits else 'no'} ({r.plan_s:.0f} s)", flush=True)
    return row


def fig10() -> list[dict]:
    return [_plan(name, machine, gpus) for machine, gpus, *names in FIG10 for name in names if name is not None]


def pc700() -> list[dict]:
    small = GPTConfig(n_layer=24, n_head=16, d_model=1536, vocab_size=50257, seq_len=128)   # 0.7B
    return [_plan("0.7b", "pc700", 1, batch=8, seq=128, cfg=small),
            _plan("1b", "pc700", 1, batch=8, seq=128, cfg=replace(small, n_layer=36))]


def angel() -> list[dict]:
    cfg = GPTConfig(n_layer=26, n_head=128, d_model=8192, vocab_size=50257, seq_len=1024)
    return [_plan(f"angel-L{n}", "angel", 8, batch=1, cfg=replace(cfg, n_layer=n)) for n in (26, 68, 80)]


def main(argv=None) -> int:
    ap = parser(__doc__, "paper_scale", quick="the table3 section only (no model is planned)")
    ap.add_argument("--sections", default=None, help="default table3,fig10,pc700,angel")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = json.loads(args.out.read_text()) if args.out.exists() else {}
    t0 = time.perf_counter()
    for section in (args.sections or ("table3" if args.quick else "table3,fig10,pc700,angel")).split(","):
        res[section] = {"table3": table3, "fig10": fig10, "pc700": pc700, "angel": angel}[section]()
        write_json(args.out, res)
        print(tabulate([{k: v for k, v in r.items() if not isinstance(v, list)} for r in res[section]],
                       headers="keys", tablefmt="github", floatfmt=".2f"))
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
