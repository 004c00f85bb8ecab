"""The host AdamW update against the memory-bandwidth bound and against its peers, side by side.

One process per thread count (``OMP_NUM_THREADS`` and ``torch.set_num_threads`` both set, so
DeepSpeed's OpenMP runtime gets the same count as torch's); in it, for 16M and 64M parameters in
chunks of 4M elements, every candidate updates the same numbers and the bandwidth bound is
measured, all interleaved (each repeat in a rotated order), medians of ``--reps``:

- **bound**: the best of in-place ``x.mul_(1.0)`` (8 B per element), ``x.add_(y)`` (12 B) and
  ``x.addcmul_(y, z)`` (16 B) over the candidates' own fp32 chunks, in bytes/s, divided by the 28
  bytes an AdamW update must move per parameter: fp32, gradient read 4 + master, exp_avg and
  exp_avg_sq read and written 24; bf16, gradient read 2 + the same 24 + the param's cast written 2;
- **pscompile, native**: ``ChunkAdamW`` with ``optimizer_kernel="native"``, the C++ kernel
  (``optim/host_adamw.cpp``), as the engine calls it (the same buffers as the next row);
- **pscompile, inductor**: ``ChunkAdamW`` with ``optimizer_kernel="inductor"``, as the engine calls
  it: bf16, the param chunk holds the gradient (put there untimed, as the backward does) and gets
  the new master's cast, in one compiled pass per chunk (``optim/host_kernel.py``); fp32, the master
  is the param chunk and the gradient has its own buffer, which ``torch._fused_adamw_`` updates in
  one pass already, so both kernel choices pick it there;
- **pscompile, eager**: ``optimizer_kernel="eager"``: ``torch._fused_adamw_`` (bf16: upcast, step
  and cast back in 64Ki-element blocks, the path before this kernel);
- **torch AdamW(fused=True)** over the chunks as parameters; bf16: the recipe -- upcast the
  gradients into fp32 ``.grad`` buffers, ``step()``, cast the masters into bf16 params;
- **DeepSpeedCPUAdam** (ZeRO-Offload's kernel), when DeepSpeed is installed; the same recipe in bf16.

Every candidate updates the same buffers, reset to the same masters, zero states and gradients
before each timed step (not timed); the table's last column is its masters' largest difference from
torch's after one more step each (the same step count, the same numbers).

``--huge-pages`` allocates every buffer on transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE=1``):
with 4 KiB pages the 64M rows on one thread measured TLB-bound here, every method at 0.47-0.85 of a
bound that huge pages also raise.

    python bench/host_adamw.py [--quick] [--markdown] [--threads 1,2] [--sizes 16,64] [--reps 5]
                               [--huge-pages] [--out bench/results/host_adamw.json]
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from pscompile.config import AdamW
from pscompile.optim.adamw import ChunkAdamW
from pscompile.optim.host_kernel import HostKernels
from pscompile.optim.native_kernel import unavailable_reason

from harness.output import parser, table, write_json
from harness.runner import child, run_fresh
from harness.timing import time_reps

CHUNK = 1 << 22
BYTES_PER_PARAM = 28
HP = AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _deepspeed():
    """DeepSpeedCPUAdam, or the reason it is missing."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam, None
    except Exception as e:                      # noqa: BLE001 -- any import/build failure: skip the row
        return None, f"DeepSpeed not available here ({type(e).__name__}): pip install deepspeed to add its row"


class _Buffers:
    """The chunks every candidate updates -- the same memory for all, so none is measured on
    luckier pages (timings on this machine differed by up to 1.5x between two allocations of the
    same sizes): fp32 masters, Adam states, gradients (in the gradient dtype), the 16-bit param
    chunks and the fp32 ``.grad`` buffers of the recipes. ``reset`` restores the initial masters
    and zero states before every timed step (not timed)."""

    def __init__(self, numel: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        n = numel // CHUNK
        self.master0 = [torch.randn(CHUNK, generator=g) * 0.02 for _ in range(n)]
        self.grad = [(torch.randn(CHUNK, generator=g) * 1e-3).to(dtype) for _ in range(n)]
        self.master = [m.clone() for m in self.master0]
        self.ea = [torch.zeros(CHUNK) for _ in range(n)]
        self.eas = [torch.zeros(CHUNK) for _ in range(n)]
        self.param = [torch.empty(CHUNK, dtype=dtype) for _ in range(n)] if dtype != torch.float32 else None
        self.grad32 = [torch.empty(CHUNK) for _ in range(n)] if dtype != torch.float32 else self.grad
        self.dtype = dtype

    def reset(self) -> None:
        for m, m0, ea, eas in zip(self.master, self.master0, self.ea, self.eas):
            m.copy_(m0)
            ea.zero_()
            eas.zero_()
        for p, g in zip(self.param or [], self.grad):     # 16-bit: the backward's gradients are
            p.copy_(g)                                    # in the param chunks (where it writes them)


class _Ours:
    def __init__(self, b: _Buffers, kernels: HostKernels | None):
        self.adam, self.b = ChunkAdamW(HP, kernels=kernels), b

    def step(self) -> None:
        b = self.b
        self.adam.begin_step()
        for i, m in enumerate(b.master):
            if b.param is None:                        # fp32: the master is the param chunk
                self.adam.update_chunk(None, m, b.ea[i], b.eas[i], grad_factor=1.0, gradless=[], grad=b.grad[i])
            else:                                      # 16-bit: the gradient over the param chunk
                self.adam.update_chunk(b.param[i], m, b.ea[i], b.eas[i], grad_factor=1.0, gradless=[])


class _Recipe:
    """A torch.optim-style optimizer whose parameters are the master chunks (its states are the
    shared ones, put in its state dict first); 16-bit: upcast, step, cast back."""

    def __init__(self, b: _Buffers, make, step0):
        self.b = b
        self.params = [torch.nn.Parameter(m) for m in b.master]      # (the same storage)
        for p, g in zip(self.params, b.grad32):
            p.grad = g
        self.opt = make(self.params)
        for p, ea, eas in zip(self.params, b.ea, b.eas):
            self.opt.state[p] = {"step": step0(), "exp_avg": ea, "exp_avg_sq": eas}

    def step(self) -> None:
        b = self.b
        if b.param is not None:
            for g32, g in zip(b.grad32, b.grad):
                g32.copy_(g)
        self.opt.step()
        if b.param is not None:
            for o, m in zip(b.param, b.master):
                o.copy_(m)


def _bound_ops(b: _Buffers) -> dict:
    """In-place streaming ops over the candidates' own chunks (the same pages: see ``_Buffers``),
    each with the bytes it moves per element; ``reset`` undoes nothing they change (states stay
    zero, masters unchanged)."""
    def mul():
        for m in b.master:
            m.mul_(1.0)

    def add():
        for ea, eas in zip(b.ea, b.eas):
            ea.add_(eas)

    def addcmul():
        for m, ea, eas in zip(b.master, b.ea, b.eas):
            m.addcmul_(ea, eas)

    return {"mul_": (mul, 8), "add_": (add, 12), "addcmul_": (addcmul, 16)}


def worker(spec: dict) -> dict:
    """Every candidate and the bound at each size and dtype, in this process."""
    threads, sizes, reps = spec["threads"], spec["sizes"], spec["reps"]
    torch.set_num_threads(threads)
    ds, ds_note = _deepspeed()
    native_note = unavailable_reason()
    torch_kw = dict(lr=HP.lr, betas=HP.betas, eps=HP.eps, weight_decay=HP.weight_decay)
    rows = []
    for numel in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            b = _Buffers(numel, dtype)
            bound_ops = _bound_ops(b)
            cands = {**({"pscompile, native": _Ours(b, HostKernels("native", threads))} if native_note is None else {}),
                     "pscompile, inductor": _Ours(b, HostKernels("inductor", threads)),
                     "pscompile, eager": _Ours(b, None),
                     "torch AdamW(fused=True)": _Recipe(b, lambda ps: torch.optim.AdamW(ps, fused=True, **torch_kw),
                                                        lambda: torch.tensor(0.0))}
            if ds is not None:
                cands["DeepSpeedCPUAdam"] = _Recipe(b, lambda ps: ds(ps, adamw_mode=True, **torch_kw), lambda: 0)
            times: dict[str, list[float]] = {k: [] for k in [*cands, *bound_ops]}
            runs = [(k, b.reset, c.step) for k, c in cands.items()] + [(k, None, f) for k, (f, _) in bound_ops.items()]
            for k, c in cands.items():                    # warm-up: compiles, states; then as timed
                b.reset()
                c.step()
            for r in range(reps):                         # interleaved, each repeat in a rotated order
                for k, prepare, fn in runs[r % len(runs):] + runs[:r % len(runs)]:
                    if prepare is not None:
                        prepare()
                    times[k] += time_reps(fn, 1)
            results = {}                                  # one more step each from the same state:
            for k, c in cands.items():                    # the same step count, the same numbers
                b.reset()
                c.step()
                results[k] = [m.clone() for m in b.master]
            bw = max(numel * nb / statistics.median(times[k]) for k, (_, nb) in bound_ops.items())
            bound = bw / BYTES_PER_PARAM
            for k in cands:
                med = statistics.median(times[k])
                diff = max((x - y).abs().max().item() for x, y in zip(results[k], results["torch AdamW(fused=True)"]))
                rows.append(dict(threads=threads, numel=numel, dtype=str(dtype)[6:], method=k, median_s=med,
                                 times_s=times[k], mparams_per_s=numel / med / 1e6,
                                 fraction_of_bound=numel / med / bound, max_diff_vs_torch=diff,
                                 bound_gb_s=bw / 1e9, bound_mparams_per_s=bound / 1e6))
            del cands, b, results
    notes = [ds_note or "DeepSpeedCPUAdam measured"]
    if native_note is not None:
        notes.append(f"pscompile's C++ kernel not measured: {native_note}")
    return {"rows": rows, "notes": notes}


def _table(rows: list[dict], markdown: bool) -> str:
    one = {(r["numel"], r["dtype"], r["method"]): r for r in rows if r["threads"] == 1}
    out = []
    for r in rows:
        base = one.get((r["numel"], r["dtype"], r["method"]))
        out.append([r["method"], r["dtype"], f"{r['numel'] >> 20}M", r["threads"], f"{r['mparams_per_s']:.0f}",
                    f"{r['fraction_of_bound']:.2f}", f"{r['bound_mparams_per_s']:.0f}",
                    f"{r['median_s'] / base['median_s']:.2f}" if base else "-", f"{r['max_diff_vs_torch']:.1e}"])
    headers = ["method", "grads", "params", "threads", "Mparam/s", "of bound", "bound Mparam/s",
               "time vs 1 thread", "max |master - torch's|"]
    return table(out, headers, markdown=markdown)


def main(argv=None) -> int:
    ap = parser(__doc__, "host_adamw", quick="4M parameters (one chunk), 2 repeats, 1 and 2 threads",
                markdown=True, child=True)
    ap.add_argument("--threads", default=None, help="comma-separated (default: 1, 2 and this machine's cores)")
    ap.add_argument("--sizes", default=None, help="comma-separated millions of parameters (default 16,64)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--huge-pages", action="store_true",
                    help="allocate the buffers on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=1)")
    args = ap.parse_args(argv)
    if child(args.child, worker):
        return 0
    sizes = [int(x) << 20 for x in (args.sizes or ("4" if args.quick else "16,64")).split(",")]
    reps = args.reps or (2 if args.quick else 5)
    if args.threads is not None:
        threads = [int(t) for t in args.threads.split(",")]
    else:
        threads = [1, 2] if args.quick else sorted({1, 2, os.cpu_count() or 1})
    if any(s % CHUNK for s in sizes):
        ap.error(f"--sizes: multiples of {CHUNK >> 20} (millions of parameters, in chunks of {CHUNK >> 20}M)")
    rows, notes = [], set()
    for t in threads:
        res = run_fresh(__file__, dict(threads=t, sizes=sizes, reps=reps), threads=t,
                        env={"THP_MEM_ALLOC_ENABLE": "1"} if args.huge_pages else None)
        rows += res["rows"]
        notes.update(res["notes"])
    rows.sort(key=lambda r: (r["numel"], r["dtype"], r["method"], r["threads"]))
    print(_table(rows, args.markdown))
    for n in sorted(notes):
        print(f"\n{n}")
    write_json(args.out, {"rows": rows, "threads": threads, "chunk": CHUNK, "reps": reps,
                          "bytes_per_param": BYTES_PER_PARAM, "notes": sorted(notes), "huge_pages": args.huge_pages,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
