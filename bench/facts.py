"""Measured facts the README's defaults rest on, produced here rather than quoted.

1. **Gradient accumulation precision.** The sum of 8 micro-batches of bf16 gradients, accumulated
   in bf16 (what plain PyTorch does with bf16 parameters) and in fp32 (what pscompile does), against
   the exact sum in float64: relative error of each.
2. **bf16 vs fp32 matmul on this CPU.** A 1024x768 @ 768x256 matmul, median of repeats, one thread:
   on CPUs without AVX512-BF16 bf16 is many times slower, which is why demos, benches and most
   tests compute in float32.
3. **The cost of calling a memory op.** A compiled program calls one ``pscompile::`` op per memory
   node. The median of one call of ``pscompile::drop`` (defined with ``Library.define`` and one
   CompositeExplicitAutograd kernel) against the same op made with ``torch.library.custom_op``,
   whose autograd and ADInplaceOrView layers run in Python.

    python bench/facts.py [--quick] [--out bench/results/facts.json]
"""

from __future__ import annotations

import statistics

import torch

from harness.output import parser, table, write_json
from harness.timing import time_reps


def accumulation_error(micro: int = 8, numel: int = 1 << 20, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(numel, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(micro)]
    exact = torch.stack([x.double() for x in grads]).sum(0)
    acc16 = torch.zeros(numel, dtype=torch.bfloat16)
    acc32 = torch.zeros(numel, dtype=torch.float32)
    for x in grads:
        acc16 += x
        acc32 += x.float()
    rel = lambda acc: ((acc.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    return {"micro_batches": micro, "numel": numel, "bf16_rel_error": rel(acc16), "fp32_rel_error": rel(acc32)}


def matmul_times(reps: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 768, dtype=dtype), torch.randn(768, 256, dtype=dtype)
        out[str(dtype).replace("torch.", "")] = statistics.median(time_reps(lambda: a @ b, reps, warmup=1))
    out["bf16_over_fp32"] = out["bfloat16"] / out["float32"]
    return out


def op_call_times(calls: int) -> dict:
    import pscompile.graph.ops  # noqa: F401 - registers the pscompile:: ops
    try:
        custom = torch.ops.pscompile_facts.drop.default
    except AttributeError:
        @torch.library.custom_op("pscompile_facts::drop", mutates_args=())
        def _drop(slot: torch.Tensor) -> None:
            return None
        custom = torch.ops.pscompile_facts.drop.default
    x = torch.zeros(4)
    out = {}
    for name, op in (("library_us", torch.ops.pscompile.drop.default), ("custom_op_us", custom)):
        per = [t / calls for t in time_reps(lambda: [op(x) for _ in range(calls)], 7, warmup=1)]
        out[name] = statistics.median(per) * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, "facts").parse_args(argv)
    torch.set_num_threads(1)
    acc = accumulation_error(numel=1 << (16 if args.quick else 20))
    mm = matmul_times(reps=3 if args.quick else 10)
    calls = op_call_times(1000 if args.quick else 20000)
    print(table([["bf16 (plain PyTorch with bf16 params)", f"{acc['bf16_rel_error']:.1e}"],
                 ["fp32 (pscompile's accumulation chunks)", f"{acc['fp32_rel_error']:.1e}"]],
                [f"sum of {acc['micro_batches']} bf16 gradients, accumulated in", "relative error"], markdown=False))
    print()
    print(table([["float32", f"{mm['float32'] * 1e3:.1f} ms"], ["bfloat16", f"{mm['bfloat16'] * 1e3:.1f} ms"],
                 ["bf16 / fp32", f"{mm['bf16_over_fp32']:.1f}x"]],
                ["1024x768 @ 768x256, one thread", "median"], markdown=False))
    print()
    print(table([["Library.define (pscompile's memory ops)", f"{calls['library_us']:.1f} us"],
                 ["torch.library.custom_op", f"{calls['custom_op_us']:.1f} us"]],
                ["one call of a memory op (drop), made with", "median"], markdown=False))
    write_json(args.out, {"accumulation": acc, "matmul_s": mm, "op_call": calls})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
