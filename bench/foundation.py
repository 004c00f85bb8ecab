"""Foundation benchmark: pscompile hooks mode against plain PyTorch, on this machine's CPU.

Three sections, each printed as a table (tabulate) and written, with every raw number, to JSON:

1. hooks mode vs plain PyTorch: GPT at three widths; plain PyTorch (``ReferenceTrainer``), hooks mode
   with no device budget, and hooks mode under a tight budget (about half of plain PyTorch's
   measured peak). Same model seed, same batches, steps interleaved round-robin in one run.
2. the largest GPT that trains under a fixed device budget (default 256 MiB): a ladder of GPT sizes.
3. host AdamW throughput: ``ChunkAdamW.update_chunk`` over 16M-element chunks against the machine's
   copy bandwidth and against ``torch.optim.AdamW``.

Usage::

    python bench/foundation.py                 # full run (a few minutes), JSON to bench/results/
    python bench/foundation.py --quick         # tiny sizes (smoke test, well under a minute)
    python bench/foundation.py --markdown      # also print GitHub-flavoured tables at the end
    python bench/foundation.py --from-json bench/results/foundation.json --markdown   # re-render

The compute device is the CPU; pscompile enforces ``device_memory`` by its own accounting (see
docs/design.md), so "device bytes" are pscompile's measured device-tier bytes, and for plain PyTorch the
bytes of every tensor it holds (parameters, gradients, Adam states, activations, temporaries) as
counted by ``NonModelTracker``. The default dtype is float32: on this CPU (AVX2, no AVX512-BF16)
bfloat16 matmuls are 10-100x slower than float32, which would make every timing meaningless.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import torch
from tabulate import tabulate

import pscompile
from pscompile.errors import BudgetError
from pscompile.optim.adamw import ChunkAdamW
from pscompile.units import format_bytes

from foundation_ladder import ladder_tables, rung_worker, section_largest
from harness.systems import hooks_engine, log, mib, persistent_bytes, plain_trainer, plain_tracked_step, short
from harness.host import loadavg, max_rss_bytes, meta
from harness.output import parser, write_json
from harness.runner import child
from harness.specs import adamw, gpt, gpt_config, token_batches
from harness.timing import time_reps

MiB = 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---------------------------------------------------------------------------------- settings

FULL = {
    "s1": dict(widths=(256, 512, 768), n_layer=4, vocab=8192, seq=128, batch=4, warmup=2, steps=5,
               tight_fractions=(0.5, 0.6, 0.7, 0.8, 0.9)),
    # (n_layer, d_model) rungs, sorted by parameter count (vocab 8192, seq 128)
    "s2": dict(rungs=((2, 256), (4, 384), (6, 384), (4, 512), (8, 512), (8, 768), (8, 1024),
                      (16, 1024), (8, 1536), (24, 1024), (7, 2048), (30, 1024)),
               vocab=8192, seq=128, batch=1, budget="256MiB", max_params=400_000_000,
               plain_measure_max_params=70_000_000, max_host_gb=18.0, rung_time_limit_s=240.0),
    "s3": dict(chunk_numel=16 * 2**20, num_chunks=4, torch_tensors=12, reps=5,
               copy_numel=64 * 2**20),
}
QUICK = {
    "s1": dict(widths=(32, 64), n_layer=2, vocab=256, seq=32, batch=2, warmup=2, steps=2,
               tight_fractions=(0.5, 0.7, 0.9)),
    "s2": dict(rungs=((1, 32), (2, 128)),        # plain measured and fitting; computed, only hooks fits
               vocab=256, seq=32, batch=1, budget="3MiB", max_params=2_000_000,
               plain_measure_max_params=200_000, max_host_gb=18.0, rung_time_limit_s=30.0),
    "s3": dict(chunk_numel=2**20, num_chunks=2, torch_tensors=12, reps=2, copy_numel=4 * 2**20),
}



# ---------------------------------------------------------------------------------- section 1

def _hooks_summary(engine, times: list[float], stats: list, losses: list[float], plain_losses: list[float],
                   budget: int | None, compile_s: float, extra: dict) -> dict:
    peaks = [s.peak_device_bytes for s in stats]
    moved = [s.bytes_moved for s in stats]
    last = stats[-1]
    return {
        "budget_bytes": budget, "compile_s": compile_s, "chunk_size": engine.layout.chunk_size,
        "num_chunks": engine.layout.num_chunks, "layout_utilisation": engine.layout.utilisation,
        "os_chunks_on_device": sum(1 for t in engine.store.os_tier if t is pscompile.Tier.DEVICE),
        "step_times_s": times, "median_step_s": median(times), "peak_device_bytes": max(peaks),
        "peak_device_model_bytes": max(s.peak_device_model_bytes for s in stats),
        "peak_nonmodel_bytes": max(s.peak_nonmodel_bytes for s in stats),
        "within_budget": None if budget is None else max(peaks) <= budget,
        "bytes_moved_per_step": moved[-1], "bytes_moved_min_max": [min(moved), max(moved)],
        "h2d_bytes_per_step": last.h2d_bytes, "d2h_bytes_per_step": last.d2h_bytes,
        "num_fetches_per_step": last.num_fetches, "num_evictions_per_step": last.num_evictions,
        "min_evictions_per_step": min(s.num_evictions for s in stats),
        "phase_s_last_step": {k: getattr(last, k) for k in ("forward_s", "backward_s", "optimizer_s", "transfer_s")},
        "losses": losses, "max_abs_loss_diff_vs_plain": max(abs(a - b) for a, b in zip(losses, plain_losses)),
        **extra,
    }


def section_hooks_vsplain_trainer(s: dict, dtype: torch.dtype) -> dict:
    warmup, steps = s["warmup"], s["steps"]
    assert warmup >= 2, "plain PyTorch's peak is measured in the second warm-up step (Adam state exists)"
    total = warmup + steps
    results = []
    for d in s["widths"]:
        cfg = gpt_config(s["n_layer"], d, s["vocab"], s["seq"])
        fresh = partial(gpt, s["n_layer"], d, s["vocab"], s["seq"])
        batches = token_batches(s["vocab"], s["batch"], s["seq"], total)
        log(f"[1] d_model={d}: {cfg.num_params():,} params")
        # -- plain PyTorch: step 0 creates the Adam state; step 1 runs under the tracker (peak)
        plain = plain_trainer(fresh(), dtype)
        plain_losses = [plain.step(batches[0])]
        loss, tr, tracked_s = plain_tracked_step(plain, batches[1])
        plain_losses.append(loss)
        for i in range(2, warmup):
            plain_losses.append(plain.step(batches[i]))
        plain_peak = tr.peak_total
        # -- hooks, unlimited budget
        systems: dict[str, dict] = {}
        t0 = time.perf_counter()
        eng = hooks_engine(fresh(), batches[0], None, dtype)
        systems["hooks_unlimited"] = {"engine": eng, "budget": None, "compile_s": time.perf_counter() - t0,
                                      "extra": {}}
        # -- hooks, tight budget: the smallest tried fraction of plain's peak that compiles
        tried = []
        for frac in s["tight_fractions"]:
            budget = int(plain_peak * frac)
            t0 = time.perf_counter()
            try:
                eng = hooks_engine(fresh(), batches[0], budget, dtype)
            except BudgetError as e:
                tried.append({"fraction": frac, "budget_bytes": budget, "error": str(e)})
                log(f"    tight budget {frac:.0%} of plain peak ({format_bytes(budget)}) refused: {short(e, 140)}")
                continue
            systems["hooks_tight"] = {"engine": eng, "budget": budget, "compile_s": time.perf_counter() - t0,
                                      "extra": {"budget_fraction_of_plain_peak": frac, "refused_budgets": tried}}
            break
        gc.collect()
        # -- warm-up for hooks engines, then interleaved timed steps
        run: dict[str, dict] = {}
        for name, sysd in systems.items():
            run[name] = {"losses": [sysd["engine"].step(b) for b in batches[:warmup]], "times": [], "stats": []}
        plain_times = []
        for i in range(warmup, total):
            t0 = time.perf_counter()
            plain_losses.append(plain.step(batches[i]))
            plain_times.append(time.perf_counter() - t0)
            for name, r in run.items():
                eng = systems[name]["engine"]
                t0 = time.perf_counter()
                r["losses"].append(eng.step(batches[i]))
                r["times"].append(time.perf_counter() - t0)
                r["stats"].append(eng.stats)
        row = {
            "d_model": d, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "params": cfg.num_params(),
            "plain": {
                "step_times_s": plain_times, "median_step_s": median(plain_times),
                "peak_device_bytes": plain_peak, "peak_source": "measured (NonModelTracker, all tensors)",
                "persistent_bytes": persistent_bytes(plain),
                "tracked_step_s": tracked_s, "losses": plain_losses,
            },
        }
        for name in ("hooks_unlimited", "hooks_tight"):
            if name not in systems:
                row[name] = {"error": "no tried budget compiled", "refused_budgets": tried}
                continue
            sysd, r = systems[name], run[name]
            row[name] = _hooks_summary(sysd["engine"], r["times"], r["stats"], r["losses"], plain_losses,
                                       sysd["budget"], sysd["compile_s"], sysd["extra"])
            row[name]["time_ratio_vs_plain"] = row[name]["median_step_s"] / row["plain"]["median_step_s"]
            row[name]["peak_ratio_vs_plain"] = row[name]["peak_device_bytes"] / plain_peak
        results.append(row)
        for sysd in systems.values():     # (close() frees an engine: its parameters' grad hooks keep it alive)
            sysd["engine"].close()
        del systems, run, plain, eng
        gc.collect()
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "n_layer": s["n_layer"], "vocab_size": s["vocab"], "seq_len": s["seq"], "batch": s["batch"],
        "warmup_steps": warmup, "timed_steps": steps,
        "method": ("same model seed and batches for every system; plain step 0 creates Adam state, plain "
                   "step 1 runs under NonModelTracker (peak); hooks engines warm up on the same batches; "
                   "then the timed steps run round-robin (plain, hooks unlimited, hooks tight) so load "
                   "changes hit all systems alike"),
        "sizes": results,
    }


# ---------------------------------------------------------------------------------- section 3

def _chunk_times(hp, grad_dtype: torch.dtype, shared: bool, s: dict, g) -> tuple[list[float], list[float] | None]:
    """Seconds of ``ChunkAdamW.update_chunk`` over ``s``'s chunks and, with ``shared`` (the param chunk
    is the master, the gradient a buffer of its own), of the fused kernel alone on the same chunks."""
    cn, reps = s["chunk_numel"], s["reps"]
    opt = ChunkAdamW(hp)
    chunks = [((torch.randn(cn, generator=g) * 1e-3).to(grad_dtype), torch.randn(cn, generator=g) * 0.02,
               torch.zeros(cn), torch.zeros(cn)) for _ in range(s["num_chunks"])]
    opt.begin_step()
    step_t = torch.tensor(1.0)
    kw = dict(lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps,
              amsgrad=False, maximize=False)

    def run_chunks():
        for p, m, ea, eas in chunks:
            if shared:                          # p: the gradient's own buffer; m: params and master
                opt.update_chunk(None, m, ea, eas, grad_factor=1.0, gradless=[], grad=p)
            else:
                opt.update_chunk(p, m, ea, eas, grad_factor=1.0, gradless=[])

    def run_kernel():
        for p, m, ea, eas in chunks:
            torch._fused_adamw_([m], [p], [ea], [eas], [], [step_t], **kw)

    return time_reps(run_chunks, reps, warmup=1), time_reps(run_kernel, reps, warmup=1) if shared else None


def section_adamw(s: dict, dtype: torch.dtype) -> dict:
    reps = s["reps"]

    def bandwidth() -> tuple[list[float], list[float]]:
        """A large fp32 copy (bytes read + written) and an in-place scale (x.mul_(1.0): read + write of
        the same memory). A copy's destination is also read into the cache on write-allocate CPUs, which
        its nominal 8 B/element does not count, so the copy can look slower than the optimizers."""
        src = torch.rand(s["copy_numel"])
        dst = torch.empty_like(src)
        return time_reps(lambda: dst.copy_(src), reps, warmup=1), time_reps(lambda: src.mul_(1.0), reps, warmup=1)

    copy_times, inplace_times = bandwidth()      # measured before and after the optimizers (load drifts)
    cn, nc = s["chunk_numel"], s["num_chunks"]
    numel = cn * nc
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    hp = adamw(1e-4)

    def add_row(method, grad_dtype, tensors, times, nominal_bpp):
        rows.append({"method": method, "grad_dtype": str(grad_dtype).replace("torch.", ""), "tensors": tensors,
                     "numel": numel, "times_s": times, "median_s": median(times),
                     "nominal_bytes_per_param": nominal_bpp})

    # -- ChunkAdamW as the engine calls it. fp32 compute: the param chunk is the master and the
    #    gradient has a buffer of its own (grad r 4, master r+w 8, exp_avg r+w 8, exp_avg_sq r+w 8 =
    #    28 B, what torch.optim.AdamW touches). 16-bit compute: the param chunk holds the gradient and
    #    gets the new master's cast (2 + 2 + 24 = 28 B). The fp32 layout with a master of its own and
    #    a cast back (32 B, what the engine did before) is kept as a row to compare with.
    for gd in [dtype] + [d for d in (torch.float32, torch.bfloat16) if d != dtype]:
        variants = [("pscompile ChunkAdamW.update_chunk, param chunk = master", True)] if gd == torch.float32 else []
        variants.append(("pscompile ChunkAdamW.update_chunk, master + cast back" if gd == torch.float32
                         else "pscompile ChunkAdamW.update_chunk", False))
        for label, shared in variants:
            chunk_times, kernel_times = _chunk_times(hp, gd, shared, s, g)
            add_row(label, gd, nc, chunk_times, 32 if gd == torch.float32 and not shared else 28)
            if shared:
                add_row("  of which torch._fused_adamw_ alone", gd, nc, kernel_times, 28)
            gc.collect()
    # -- torch.optim.AdamW on the same numel split into 12 fp32 tensors (the params are their own master)
    k = s["torch_tensors"]
    sizes = [numel // k + (1 if i < numel % k else 0) for i in range(k)]
    for label, kw in (("torch.optim.AdamW(foreach=True)", dict(foreach=True)),
                      ("torch.optim.AdamW(foreach=False) per-tensor loop", dict(foreach=False, fused=False)),
                      ("torch.optim.AdamW(fused=True)", dict(fused=True))):
        params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
        for p in params:
            p.grad = torch.randn(p.numel(), generator=g) * 1e-3
        try:
            opt = torch.optim.AdamW(params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, **kw)
            opt.step()                             # creates the state (not timed)
            times = time_reps(opt.step, reps, warmup=1)
        except (RuntimeError, ValueError) as e:
            rows.append({"method": label, "error": str(e)})
            continue
        add_row(label, torch.float32, k, times, 28)   # grad r, param r+w, exp_avg r+w, exp_avg_sq r+w
        del params, opt
        gc.collect()
    c2, i2 = bandwidth()
    copy_times += c2
    inplace_times += i2
    copy_bw = 2 * s["copy_numel"] * 4 / median(copy_times)
    inplace_bw = 2 * s["copy_numel"] * 4 / median(inplace_times)
    base = next(r for r in rows if r["method"].startswith("pscompile") and "error" not in r)
    fused = next((r for r in rows if r["method"] == "torch.optim.AdamW(fused=True)" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["params_per_s"] = numel / r["median_s"]
        r["bytes_per_s"] = numel * r["nominal_bytes_per_param"] / r["median_s"]
        r["fraction_of_copy_bandwidth"] = r["bytes_per_s"] / copy_bw
        r["fraction_of_inplace_bandwidth"] = r["bytes_per_s"] / inplace_bw
        r["time_ratio_vs_chunkadamw"] = r["median_s"] / base["median_s"]
    for r in rows:                  # the measure: GB/s of the bytes each touches, over fused torch's
        if "error" not in r and fused is not None:
            r["bytes_per_s_vs_fused_torch"] = r["bytes_per_s"] / fused["bytes_per_s"]
    return {
        "copy_bandwidth": {"numel": s["copy_numel"], "bytes_per_copy": 2 * s["copy_numel"] * 4,
                           "times_s": copy_times, "bytes_per_s": copy_bw},
        "inplace_bandwidth": {"numel": s["copy_numel"], "op": "x.mul_(1.0)", "bytes_per_op": 2 * s["copy_numel"] * 4,
                              "times_s": inplace_times, "bytes_per_s": inplace_bw},
        "chunk_numel": cn, "num_chunks": nc, "reps": reps, "threads": torch.get_num_threads(),
        "baseline": f"{base['method']} ({base['grad_dtype']} grads)",
        "rows": rows,
    }



# ---------------------------------------------------------------------------------- rendering

def _tables(res: dict) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(caption, headers, rows) for every section present in ``res``."""
    out = []
    s1 = res.get("hooks_vs_plain")
    if s1:
        cap = (f"1. hooks mode vs plain PyTorch, GPT {s1['n_layer']} layers, vocab {s1['vocab_size']}, seq "
               f"{s1['seq_len']}, batch {s1['batch']}, {s1['dtype']}: median wall time of "
               f"{s1['timed_steps']} interleaved steps after {s1['warmup_steps']} warm-up steps; peak = "
               "measured device bytes of everything (plain: all its tensors via NonModelTracker); moved = "
               "h2d+d2h per step; |dloss| = max abs loss difference vs plain over all "
               f"{s1['timed_steps'] + s1['warmup_steps']} steps")
        hdr = ["d_model", "params", "system", "budget MiB", "step s", "time / plain", "peak MiB",
               "peak / plain", "MiB moved/step", "fetch/evict", "max |dloss|"]
        rows = []
        for r in s1["sizes"]:
            p = r["plain"]
            rows.append([r["d_model"], f"{r['params'] / 1e6:.1f}M", "plain PyTorch", "-",
                         f"{p['median_step_s']:.3f}", "1.00", mib(p["peak_device_bytes"]), "1.00", "0", "-", "-"])
            for name, label in (("hooks_unlimited", "hooks, no budget"), ("hooks_tight", "hooks, tight")):
                h = r.get(name)
                if h is None or "error" in h:
                    rows.append([r["d_model"], "", label, "-", "failed", "", "", "", "", "",
                                 short(h.get("error", "") if h else "", 40)])
                    continue
                budget = mib(h["budget_bytes"]) if h["budget_bytes"] else "none"
                if h.get("budget_fraction_of_plain_peak"):
                    budget += f" ({h['budget_fraction_of_plain_peak']:.0%})"
                peak = mib(h["peak_device_bytes"])
                if h["within_budget"] is False:
                    peak += " OVER"
                rows.append([r["d_model"], "", label, budget, f"{h['median_step_s']:.3f}",
                             f"{h['time_ratio_vs_plain']:.2f}", peak, f"{h['peak_ratio_vs_plain']:.2f}",
                             mib(h["bytes_moved_per_step"]),
                             f"{h['num_fetches_per_step']}/{h['num_evictions_per_step']}",
                             f"{h['max_abs_loss_diff_vs_plain']:.1e}"])
        out.append((cap, hdr, rows))
    if res.get("largest_under_budget"):
        out += ladder_tables(res["largest_under_budget"])
    if res.get("adamw_throughput"):
        out.append(adamw_table(res["adamw_throughput"]))
    return out


def adamw_table(s3: dict) -> tuple[str, list[str], list[list]]:
    """Section 3's (caption, headers, rows)."""
    bw = s3["copy_bandwidth"]["bytes_per_s"]
    ibw = s3.get("inplace_bandwidth", {}).get("bytes_per_s")
    cap = (f"3. host AdamW throughput over {s3['num_chunks']} x {s3['chunk_numel'] / 2**20:.0f}M fp32 elements, "
           f"{s3['threads']} thread(s), median of {s3['reps']}: GB/s from nominal bytes per parameter "
           "(ChunkAdamW 28, or 32 with a separate fp32 master cast back; torch.optim fp32 28), as a "
           f"fraction of a large tensor copy ({bw / 1e9:.2f} GB/s read+write), of an in-place x.mul_(1.0) "
           f"({(ibw or 0) / 1e9:.2f} GB/s) and of torch.optim.AdamW(fused=True)'s GB/s; time ratio vs "
           f"{s3['baseline']}")
    hdr = ["method", "grad dtype", "tensors", "median s", "Mparams/s", "B/param", "GB/s",
           "of copy BW", "of in-place BW", "of fused torch", "time / ChunkAdamW"]
    rows = [["reference: tensor copy dst.copy_(src)", "float32", 1,
             f"{median(s3['copy_bandwidth']['times_s']):.4f}", "-", "8", f"{bw / 1e9:.2f}", "1.00",
             f"{bw / ibw:.2f}" if ibw else "-", "-", "-"]]
    if ibw:
        rows.append(["reference: in-place x.mul_(1.0)", "float32", 1,
                     f"{median(s3['inplace_bandwidth']['times_s']):.4f}", "-", "8", f"{ibw / 1e9:.2f}",
                     f"{ibw / bw:.2f}", "1.00", "-", "-"])
    for r in s3["rows"]:
        if "error" in r:
            rows.append([r["method"], "-", "-", "failed", "", "", "", "", "", short(r["error"], 40)])
            continue
        rows.append([r["method"], r["grad_dtype"], r["tensors"], f"{r['median_s']:.4f}",
                     f"{r['params_per_s'] / 1e6:.0f}", r["nominal_bytes_per_param"],
                     f"{r['bytes_per_s'] / 1e9:.2f}", f"{r['fraction_of_copy_bandwidth']:.2f}",
                     f"{r['fraction_of_inplace_bandwidth']:.2f}" if "fraction_of_inplace_bandwidth" in r else "-",
                     f"{r['bytes_per_s_vs_fused_torch']:.2f}" if "bytes_per_s_vs_fused_torch" in r else "-",
                     f"{r['time_ratio_vs_chunkadamw']:.2f}"])
    return cap, hdr, rows


def render(res: dict, fmt: str = "simple") -> str:
    """All sections of ``res`` as text tables (``fmt='github'`` gives Markdown)."""
    parts = [(f"**{cap}**\n\n" if fmt == "github" else cap + "\n")
             + tabulate(rows, hdr, tablefmt=fmt, disable_numparse=True) for cap, hdr, rows in _tables(res)]
    m = res.get("meta", {})
    if m:
        foot = (f"torch {m.get('torch')}, {m.get('threads')} threads, {m.get('cpu', '?')}; load average "
                f"at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')} (other processes "
                f"share this machine: timings are noisy); total {m.get('elapsed_s', 0):.0f} s")
        parts.append(("_" + foot + "_") if fmt == "github" else foot)
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "foundation", markdown=True, child=True)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                    help="compute dtype for sections 1 and 3 (default float32; bf16 matmul is very slow on "
                         "AVX2-only CPUs). Section 2 always uses float32")
    ap.add_argument("--budget", default=None, help="device budget for section 2 (default 256MiB; quick: 3MiB)")
    ap.add_argument("--max-params", type=int, default=None, help="largest rung in section 2 (default 400M)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps in section 1")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps in section 1 (>= 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: this 2-core machine is shared, and with 2 OpenMP "
                         "threads every parallel region waits for a descheduled thread, measured 3-40x slower "
                         "under load)")
    ap.add_argument("--sections", default="1,2,3", help="comma-separated subset of 1,2,3")
    ap.add_argument("--from-json", type=Path, default=None, help="only render tables from a results file")
    args = ap.parse_args(argv)
    if child(args.child, rung_worker):            # one section-2 rung, in its own process
        return 0
    if args.from_json:
        print(render(json.loads(args.from_json.read_text()), "github" if args.markdown else "simple"))
        return 0

    torch.set_num_threads(args.threads)
    settings = {k: dict(v) for k, v in (QUICK if args.quick else FULL).items()}
    if args.steps:
        settings["s1"]["steps"] = args.steps
    if args.warmup:
        settings["s1"]["warmup"] = max(2, args.warmup)
    dtype = _DTYPES[args.dtype]
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    t_start = time.perf_counter()
    res: dict[str, Any] = {"meta": meta(
        quick=args.quick, dtype=args.dtype, argv=sys.argv[1:] if argv is None else argv,
        dtype_note=("float32 by default: bfloat16 matmul (esp. backward layouts) is 10-100x slower than "
                    "float32 on this CPU (AVX2 without AVX512-BF16)"))}
    print(f"pscompile foundation benchmark: compute dtype {args.dtype} (sections 1, 3; section 2 float32). "
          f"{res['meta']['dtype_note']}. {torch.get_num_threads()} torch thread(s) of {res['meta']['cpu_count']} "
          f"CPUs; load average {res['meta']['loadavg_start']}.", flush=True)

    def save():
        res["meta"].update(loadavg_end=loadavg(), elapsed_s=time.perf_counter() - t_start,
                           max_rss_bytes=max_rss_bytes())
        write_json(args.out, res)

    for key, num, fn in (("hooks_vs_plain", "1", lambda: section_hooks_vsplain_trainer(settings["s1"], dtype)),
                         ("largest_under_budget", "2",
                          lambda: section_largest(settings["s2"], args.budget, args.max_params)),
                         ("adamw_throughput", "3", lambda: section_adamw(settings["s3"], dtype))):
        if num not in sections:
            continue
        t0 = time.perf_counter()
        res[key] = fn()
        res[key]["section_s"] = time.perf_counter() - t0
        res[key]["loadavg_after"] = loadavg()
        save()
        print()
        print(render({key: res[key]}, "simple"), flush=True)
        print(f"(section {num}: {res[key]['section_s']:.0f} s)", flush=True)
    save()
    print(f"\ntotal {res['meta']['elapsed_s']:.0f} s; results written to {args.out}")
    if args.markdown:
        print("\n---- Markdown ----\n")
        print(render(res, "github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
