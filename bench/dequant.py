"""NF4 dequantization against a plain copy of the same output bytes (issue 72, part 5).

A frozen 4-bit chunk is dequantized to the compute dtype on the device just before use. This
measures how fast that runs on this machine, as GB/s of output written, against the physical
bound a copy sets: ``out.copy_(src)`` of a tensor of the output's size and dtype, the cheapest
way to write those bytes. Three ways to dequantize:

- ``eager``: ``pscompile.memory.nf4.dequantize`` op by op;
- ``inductor``: the same function through ``torch.compile`` (one fused kernel);
- ``bitsandbytes``: ``bitsandbytes.functional.dequantize_4bit``, where it is installed.

Each figure is the best of ``--repeats`` timed calls after a warm-up, one torch thread.

``--steps N``: the engine's step with the base in NF4 against the same step with it in the compute
dtype, through the eager backend and through Inductor's program. The model is pscompile's GPT
(4 layers, d=256, vocabulary 4096, batch 4 x 128) with ``peft``'s LoRA (r=8) on every projection, in
float32. Each run is compiled mode at 1.15x its own minimum, so every step evicts. The four engines
step in turn, ``N`` rounds after 3 warm-up rounds, and each figure is the median. A row also says
whether every op ran compiled (``compiled_share``), and gives the bytes each step moved to the
device. With ``--quick`` the model is a 2-layer, d=64 one and Inductor is left out.

    python bench/dequant.py [--quick] [--markdown] [--elements 16777216] [--steps 0] [--out bench/results/dequant.json]
"""

from __future__ import annotations

import statistics
import time

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt, token_batches
from harness.timing import interleave


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
    ap.add_argument("--steps", type=int, default=0, help="also time engine steps, NF4 base against compute dtype")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = _measure(args)
    finally:
        torch.set_num_threads(threads)
    if args.steps:
        result["steps"] = _steps(args)
    write_json(args.out, result)
    return 0


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
    return dict(elements=n, rows=raw)


def _lora_gpt(quick: bool):
    from peft import LoraConfig, get_peft_model
    model = gpt(2, 64, 256, 64) if quick else gpt(4, 256, 4096, 128)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], lora_dropout=0.0))


def _steps(args) -> list[dict]:
    """Steady engine steps: {compute, nf4} base x {eager, inductor} backend (eager only with --quick)."""
    vocab, seq = (256, 64) if args.quick else (4096, 128)
    data = [tuple(t) for t in token_batches(vocab, 4, seq, args.steps + 3)]
    hp = adamw(1e-3, weight_decay=0.0)
    engines = {}
    for backend in ("eager",) if args.quick else ("eager", "inductor"):
        for fmt in ("compute", "nf4"):
            cfg = dict(backend=backend, frozen_format=fmt, chunk_size="auto")
            least = pscompile.min_device_memory(_lora_gpt(args.quick), data[0], cpu_config(**cfg), optimizer=hp)
            engines[(fmt, backend)] = pscompile.compile(_lora_gpt(args.quick), data[0], optimizer=hp,
                                                        config=cpu_config(**cfg, device_memory=int(1.15 * least)))
    stats: dict = {k: [] for k in engines}

    def stepper(key):
        def step(i):
            engines[key].step(data[i])
            stats[key].append(engines[key].stats)
        return step
    times = interleave({k: stepper(k) for k in engines}, args.steps, warmup=3)
    base = statistics.median(times[("compute", "eager")])
    rows, raw = [], []
    for (fmt, backend), t in times.items():
        warm = stats[(fmt, backend)][3:]
        ms, share = 1e3 * statistics.median(t), min(s.compiled_share for s in warm)
        h2d = statistics.median(s.h2d_bytes for s in warm) / 1e6
        within = all(s.peak_device_bytes <= engines[(fmt, backend)].budget for s in warm)
        rows.append([fmt, backend, f"{ms:.1f}", f"{ms / 1e3 / base:.2f}", f"{h2d:.2f}", f"{share:.2f}", within])
        raw.append(dict(format=fmt, backend=backend, step_ms=ms, vs_compute_eager=ms / 1e3 / base, h2d_mb=h2d,
                        compiled_share=share, within_budget=within))
        engines[(fmt, backend)].close()
    print(f"engine steps, LoRA GPT, compiled mode at 1.15x each run's minimum; median of {args.steps}")
    print(table(rows, ["frozen base", "backend", "step ms", "vs compute, eager", "MB to device / step",
                       "compiled share", "within budget"], markdown=args.markdown))
    return raw


if __name__ == "__main__":
    raise SystemExit(main())
