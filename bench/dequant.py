"""NF4 dequantization against a plain copy of the same output bytes (issue 72, part 5).

A frozen 4-bit chunk is dequantized to the compute dtype on the device just before use. This
measures how fast that runs on this machine, as GB/s of output written, against the physical
bound a copy sets: ``out.copy_(src)`` of a tensor of the output's size and dtype, the cheapest
way to write those bytes. Three ways to dequantize:

- ``eager``: ``pscompile.memory.nf4.dequantize`` op by op;
- ``inductor``: the same function through ``torch.compile`` (one fused kernel);
- ``bitsandbytes``: ``bitsandbytes.functional.dequantize_4bit``, where it is installed.

Each figure is the best of ``--repeats`` timed calls after a warm-up, one torch thread.

    python bench/dequant.py [--quick] [--markdown] [--elements 16777216] [--out bench/results/dequant.json]
"""

from __future__ import annotations

import time

import torch

from harness.output import parser, table, write_json


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = parser(__doc__, "dequant", markdown=True)
    ap.add_argument("--elements", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args) -> int:
    from pscompile.memory.nf4 import dequantize, quantize
    n = 1 << 16 if args.quick else args.elements
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    q = quantize(x)
    rows, raw = [], []
    for dtype in (torch.float32, torch.bfloat16):
        out_bytes = n * torch.tensor([], dtype=dtype).element_size()
        src, dst = torch.randn(n).to(dtype), torch.empty(n, dtype=dtype)
        ways = {"copy (the bound)": lambda: dst.copy_(src),
                "eager": lambda: dequantize(q, dtype)}
        compiled = torch.compile(dequantize, dynamic=False)
        ways["inductor"] = lambda: compiled(q, dtype)
        try:
            import bitsandbytes.functional as bnb
            codes, state = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
            if dtype != torch.float32:
                codes, state = bnb.quantize_4bit(x.to(dtype), blocksize=64, quant_type="nf4",
                                                 compress_statistics=False)
            ways["bitsandbytes"] = lambda: bnb.dequantize_4bit(codes, state)
        except ImportError:
            pass
        copy_s = None
        for name, fn in ways.items():
            s = _best(fn, args.repeats)
            copy_s = copy_s or s
            gbs = out_bytes / s / 1e9
            rows.append([str(dtype).removeprefix("torch."), name, f"{s * 1e3:.2f}", f"{gbs:.2f}", f"{copy_s / s:.2f}"])
            raw.append(dict(dtype=str(dtype), way=name, seconds=s, out_gb_per_s=gbs, of_copy=copy_s / s))
    headers = ["dtype", "way", "ms", "GB/s of output", "of a copy's rate"]
    print(f"NF4 dequantization of {n:,} elements (block 64), one thread; best of {args.repeats}")
    print(table(rows, headers, markdown=args.markdown))
    write_json(args.out, dict(elements=n, rows=raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
