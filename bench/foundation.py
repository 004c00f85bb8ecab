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

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tabulate import tabulate

import pscompile
from pscompile.errors import BudgetError
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.optim.adamw import ChunkAdamW
from pscompile.testing import ReferenceTrainer
from pscompile.memory.tracker import NonModelTracker
from pscompile.units import format_bytes, parse_size

MiB = 2**20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "foundation.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU = torch.device("cpu")

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


# ---------------------------------------------------------------------------------- helpers

def _gpt_config(n_layer: int, d_model: int, vocab: int, seq: int) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=max(1, d_model // 64), d_model=d_model, vocab_size=vocab,
                     seq_len=seq)


def _fresh_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def _batches(cfg: GPTConfig, batch: int, n: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(cfg.vocab_size, (batch, cfg.seq_len), generator=g),
             torch.randint(cfg.vocab_size, (batch, cfg.seq_len), generator=g)) for _ in range(n)]


def _hp() -> pscompile.AdamW:
    return pscompile.AdamW(lr=1e-4)


def _compile_hooks(model: GPT, batch, budget: int | None, dtype: torch.dtype):
    cfg = pscompile.Config(mode="hooks", device="cpu", device_memory=budget, dtype=dtype)
    return pscompile.compile(model, batch, optimizer=_hp(), config=cfg)


def _plain_tracked_step(trainer: ReferenceTrainer, batch) -> tuple[float, NonModelTracker, float]:
    """One plain PyTorch step under a tracker that counts every tensor it holds.

    The persistent tensors (parameters, master copies, Adam states, buffers) and the batch were
    made before the tracker enters, so they are added explicitly; gradients, activations and
    temporaries are created inside and counted as they appear. Returns (loss, tracker, seconds).
    """
    tr = NonModelTracker(_CPU, is_model_storage=lambda ptr: False, model_bytes=lambda: 0)
    persistent = list(trainer.params) + [m for m in trainer.master if m is not None]
    for st in trainer.opt.state.values():
        persistent += [v for v in st.values() if isinstance(v, torch.Tensor)]
    persistent += list(trainer.model.buffers())
    for t in persistent:
        tr.add_tensor(t)
    for t in batch:
        tr.add_tensor(t)
    tr.reset_peaks()
    t0 = time.perf_counter()
    with tr:
        loss = trainer.step(batch)
    return loss, tr, time.perf_counter() - t0


def _persistent_bytes(trainer: ReferenceTrainer) -> int:
    seen, total = set(), 0
    ts = list(trainer.params) + list(trainer.master)
    for st in trainer.opt.state.values():
        ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in ts:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _short(msg: str, n: int = 90) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= n else msg[: n - 3] + "..."


# ---------------------------------------------------------------------------------- section 1

def _close(engine) -> None:
    """Free an engine. Measured on torch 2.13: after ``del engine; gc.collect()`` a compiled engine,
    its chunks and its model stay alive (the referrers are the bound ``_grad_hook`` methods registered
    as post-accumulate-grad hooks on the parameters, apparently held where the garbage collector
    cannot see them); ``close()`` removes the hooks and the memory is freed."""
    engine.close()


def _hooks_summary(engine, times: list[float], stats: list, losses: list[float], plain_losses: list[float],
                   budget: int | None, compile_s: float, extra: dict | None = None) -> dict:
    peaks = [s.peak_device_bytes for s in stats]
    moved = [s.bytes_moved for s in stats]
    out = {
        "budget_bytes": budget,
        "compile_s": compile_s,
        "chunk_size": engine.layout.chunk_size,
        "num_chunks": engine.layout.num_chunks,
        "layout_utilisation": engine.layout.utilisation,
        "os_chunks_on_device": sum(1 for t in engine.store.os_tier if t is pscompile.Tier.DEVICE),
        "step_times_s": times,
        "median_step_s": _median(times),
        "peak_device_bytes": max(peaks),
        "peak_device_model_bytes": max(s.peak_device_model_bytes for s in stats),
        "peak_nonmodel_bytes": max(s.peak_nonmodel_bytes for s in stats),
        "within_budget": None if budget is None else max(peaks) <= budget,
        "bytes_moved_per_step": moved[-1],
        "bytes_moved_min_max": [min(moved), max(moved)],
        "h2d_bytes_per_step": stats[-1].h2d_bytes,
        "d2h_bytes_per_step": stats[-1].d2h_bytes,
        "num_fetches_per_step": stats[-1].num_fetches,
        "num_evictions_per_step": stats[-1].num_evictions,
        "min_evictions_per_step": min(s.num_evictions for s in stats),
        "phase_s_last_step": {k: getattr(stats[-1], k) for k in ("forward_s", "backward_s", "optimizer_s",
                                                                 "transfer_s")},
        "losses": losses,
        "max_abs_loss_diff_vs_plain": max(abs(a - b) for a, b in zip(losses, plain_losses)),
    }
    out.update(extra or {})
    return out


def section_hooks_vs_plain(s: dict, dtype: torch.dtype) -> dict:
    warmup, steps = s["warmup"], s["steps"]
    assert warmup >= 2, "plain PyTorch's peak is measured in the second warm-up step (Adam state exists)"
    total = warmup + steps
    results = []
    for d in s["widths"]:
        cfg = _gpt_config(s["n_layer"], d, s["vocab"], s["seq"])
        batches = _batches(cfg, s["batch"], total)
        _log(f"[1] d_model={d}: {cfg.num_params():,} params")
        # -- plain PyTorch: step 0 creates the Adam state; step 1 runs under the tracker (peak)
        plain = ReferenceTrainer(_fresh_gpt(cfg), optimizer=_hp(), dtype=dtype, device="cpu", copy_model=False)
        plain_losses = [plain.step(batches[0])]
        loss, tr, tracked_s = _plain_tracked_step(plain, batches[1])
        plain_losses.append(loss)
        for i in range(2, warmup):
            plain_losses.append(plain.step(batches[i]))
        plain_peak = tr.peak_total
        # -- hooks, unlimited budget
        systems: dict[str, dict] = {}
        t0 = time.perf_counter()
        eng = _compile_hooks(_fresh_gpt(cfg), batches[0], None, dtype)
        systems["hooks_unlimited"] = {"engine": eng, "budget": None, "compile_s": time.perf_counter() - t0,
                                      "extra": {}}
        # -- hooks, tight budget: the smallest tried fraction of plain's peak that compiles
        tried = []
        for frac in s["tight_fractions"]:
            budget = int(plain_peak * frac)
            t0 = time.perf_counter()
            try:
                eng = _compile_hooks(_fresh_gpt(cfg), batches[0], budget, dtype)
            except BudgetError as e:
                tried.append({"fraction": frac, "budget_bytes": budget, "error": str(e)})
                _log(f"    tight budget {frac:.0%} of plain peak ({format_bytes(budget)}) refused: {_short(e, 140)}")
                continue
            systems["hooks_tight"] = {"engine": eng, "budget": budget, "compile_s": time.perf_counter() - t0,
                                      "extra": {"budget_fraction_of_plain_peak": frac, "refused_budgets": tried}}
            break
        else:
            systems["hooks_tight"] = None
        gc.collect()
        # -- warm-up for hooks engines, then interleaved timed steps
        run: dict[str, dict] = {}
        for name, sysd in systems.items():
            if sysd is None:
                continue
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
                "step_times_s": plain_times, "median_step_s": _median(plain_times),
                "peak_device_bytes": plain_peak, "peak_source": "measured (NonModelTracker, all tensors)",
                "persistent_bytes": _persistent_bytes(plain),
                "tracked_step_s": tracked_s, "losses": plain_losses,
            },
        }
        for name, sysd in systems.items():
            if sysd is None:
                row[name] = {"error": "no tried budget compiled", "refused_budgets": tried}
                continue
            r = run[name]
            row[name] = _hooks_summary(sysd["engine"], r["times"], r["stats"], r["losses"], plain_losses,
                                       sysd["budget"], sysd["compile_s"], sysd["extra"])
            row[name]["time_ratio_vs_plain"] = row[name]["median_step_s"] / row["plain"]["median_step_s"]
            row[name]["peak_ratio_vs_plain"] = row[name]["peak_device_bytes"] / plain_peak
        results.append(row)
        for sysd in systems.values():
            if sysd is not None:
                _close(sysd["engine"])
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


# ---------------------------------------------------------------------------------- section 2
#
# Every rung runs in a fresh Python process (``--_rung``): its host memory is returned when it ends
# (a HooksEngine that is not close()d stays alive, see _close), its peak host RSS is measured
# (VmHWM), and a rung that runs too long is killed by a timeout instead of stalling the benchmark.

def _measure_plain_peak(cfg: GPTConfig, batch) -> dict:
    trainer = ReferenceTrainer(_fresh_gpt(cfg), optimizer=_hp(), dtype=torch.float32, device="cpu",
                               copy_model=False)
    trainer.step(batch)
    _, tr, _ = _plain_tracked_step(trainer, batch)
    out = {"peak": tr.peak_total, "params": cfg.num_params(), "persistent_bytes": _persistent_bytes(trainer)}
    del trainer
    gc.collect()
    return out


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rung_worker(spec: dict) -> dict:
    """One ladder rung (run in a child process): plain PyTorch's peak, then hooks mode under the budget."""
    torch.set_num_threads(spec["threads"])
    n_layer, d, vocab, seq, bsz, budget = (spec[k] for k in ("n_layer", "d_model", "vocab", "seq", "batch", "budget"))
    cfg = _gpt_config(n_layer, d, vocab, seq)
    P = cfg.num_params()
    batch = _batches(cfg, bsz, 1)[0]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if spec["plain_measured"]:
        m = _measure_plain_peak(cfg, batch)
        out["plain"] = {"peak_bytes": m["peak"], "source": "measured", "model_data_bytes": 16 * P,
                        "persistent_bytes": m["persistent_bytes"]}
    else:
        a = spec.get("one_layer")
        if a is None:
            c1 = _gpt_config(1, d, vocab, seq)
            m1 = _measure_plain_peak(c1, _batches(c1, bsz, 1)[0])
            a = {"params": m1["params"], "peak": m1["peak"], "excess": m1["peak"] - 16 * m1["params"]}
        out["one_layer"] = a
        out["plain"] = {"peak_bytes": 16 * P + a["excess"], "source": "computed", "model_data_bytes": 16 * P,
                        "excess_bytes_1_layer": a["excess"],
                        "note": ("16 B/param x params + (measured peak - 16 B/param x params) of a 1-layer GPT of "
                                 "the same width; activations of the other layers are not added (lower bound)")}
    out["plain"]["fits"] = out["plain"]["peak_bytes"] <= budget
    out["plain"]["s"] = time.perf_counter() - t0
    h: dict[str, Any] = {"ok": False}
    out["hooks"] = h
    try:
        model = _fresh_gpt(cfg)
        t0 = time.perf_counter()
        eng = _compile_hooks(model, batch, budget, torch.float32)
        h["compile_s"] = time.perf_counter() - t0
        h.update(chunk_size=eng.layout.chunk_size, num_chunks=eng.layout.num_chunks,
                 os_chunks_on_device=sum(1 for t in eng.store.os_tier if t is pscompile.Tier.DEVICE))
        t0 = time.perf_counter()
        h["loss"] = eng.step(batch)
        h["step_s"] = time.perf_counter() - t0
        st = eng.stats
        h.update(peak_device_bytes=st.peak_device_bytes, peak_device_model_bytes=st.peak_device_model_bytes,
                 peak_nonmodel_bytes=st.peak_nonmodel_bytes, bytes_moved=st.bytes_moved,
                 num_fetches=st.num_fetches, num_evictions=st.num_evictions,
                 phase_s={k: getattr(st, k) for k in ("forward_s", "backward_s", "optimizer_s", "transfer_s")})
        h["ok"] = st.peak_device_bytes <= budget
        if not h["ok"]:
            h["error"] = f"measured peak {format_bytes(st.peak_device_bytes)} > budget {format_bytes(budget)}"
    except (ValueError, RuntimeError, MemoryError) as e:      # BudgetError is a ValueError
        h["error"] = f"{type(e).__name__}: {e}"
    out["host_peak_rss_bytes"] = _vm_hwm_bytes()
    return out


def section_largest(s: dict, budget_arg: str | None, max_params: int | None) -> dict:
    budget = parse_size(budget_arg or s["budget"], "--budget")
    max_params = max_params or s["max_params"]
    vocab, seq, bsz = s["vocab"], s["seq"], s["batch"]
    rungs_out = []
    failed: list[tuple[int, int]] = []       # (n_layer, d_model) of hooks failures
    stop_reason = None
    one_layer: dict[int, dict] = {}          # d_model -> measured 1-layer plain run (for computed rungs)
    for n_layer, d in s["rungs"]:
        cfg = _gpt_config(n_layer, d, vocab, seq)
        P = cfg.num_params()
        rung: dict[str, Any] = {"n_layer": n_layer, "d_model": d, "params": P}
        rungs_out.append(rung)
        if P > max_params:
            rung["skipped"] = f"params {P:,} > --max-params {max_params:,}"
            continue
        host_est = 28 * P    # measured ~22-26 B/param peak RSS in a child (model 4 + chunks 16 + transients)
        if host_est > s["max_host_gb"] * 1e9:
            rung["skipped"] = f"estimated host RAM {host_est / 1e9:.1f} GB > {s['max_host_gb']} GB"
            continue
        if stop_reason:
            rung["skipped"] = stop_reason
            continue
        dominated = [f for f in failed if n_layer >= f[0] and d >= f[1]]
        if dominated:
            rung["skipped"] = (f"hooks: deeper and wider than failed rung L{dominated[0][0]} d{dominated[0][1]}; "
                               "plain: not run")
            continue
        _log(f"[2] rung L{n_layer} d{d}: {P:,} params")
        spec = {"n_layer": n_layer, "d_model": d, "vocab": vocab, "seq": seq, "batch": bsz, "budget": budget,
                "threads": torch.get_num_threads(), "plain_measured": P <= s["plain_measure_max_params"],
                "one_layer": one_layer.get(d)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_rung", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=s["rung_time_limit_s"])
        except subprocess.TimeoutExpired:
            rung["rung_s"] = time.perf_counter() - t0
            rung["skipped"] = f"timed out after {s['rung_time_limit_s']:.0f} s (later rungs not run)"
            stop_reason = f"a smaller rung timed out (> {s['rung_time_limit_s']:.0f} s)"
            continue
        rung["rung_s"] = time.perf_counter() - t0
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            rung["skipped"] = f"rung process failed (exit {proc.returncode}): {_short(proc.stderr[-500:], 300)}"
            failed.append((n_layer, d))
            continue
        rung.update(json.loads(lines[-1]))
        if "one_layer" in rung:
            one_layer[d] = rung["one_layer"]
        if not rung["hooks"]["ok"]:
            failed.append((n_layer, d))

    def largest(key: str) -> dict | None:
        ok = [r for r in rungs_out if r.get(key, {}).get("fits" if key == "plain" else "ok")]
        return max(ok, key=lambda r: r["params"]) if ok else None

    lp, lh = largest("plain"), largest("hooks")
    return {
        "budget_bytes": budget, "dtype": "float32", "vocab_size": vocab, "seq_len": seq, "batch": bsz,
        "max_params": max_params, "plain_measure_max_params": s["plain_measure_max_params"],
        "rules": ("each rung runs in its own process (timeout "
                  f"{s['rung_time_limit_s']:.0f} s; later rungs stop after a timeout); rungs deeper and wider "
                  "than a failed hooks rung are skipped; host RAM kept under "
                  f"{s['max_host_gb']} GB by estimate (28 B/param)"),
        "rungs": rungs_out,
        "largest": {
            "plain": None if lp is None else {"n_layer": lp["n_layer"], "d_model": lp["d_model"], "params": lp["params"]},
            "hooks": None if lh is None else {"n_layer": lh["n_layer"], "d_model": lh["d_model"], "params": lh["params"]},
            "ratio_hooks_over_plain": (lh["params"] / lp["params"]) if (lp and lh) else None,
        },
    }


# ---------------------------------------------------------------------------------- section 3

def _time_reps(fn: Callable[[], None], reps: int) -> list[float]:
    fn()                                          # warm-up (page faults, kernel selection)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def section_adamw(s: dict, dtype: torch.dtype) -> dict:
    reps = s["reps"]

    def bandwidth() -> tuple[list[float], list[float]]:
        """A large fp32 copy (bytes read + written) and an in-place scale (x.mul_(1.0): read + write of
        the same memory). A copy's destination is also read into the cache on write-allocate CPUs, which
        its nominal 8 B/element does not count, so the copy can look slower than the optimizers."""
        src = torch.rand(s["copy_numel"])
        dst = torch.empty_like(src)
        copy_t = _time_reps(lambda: dst.copy_(src), reps)
        inplace_t = _time_reps(lambda: src.mul_(1.0), reps)
        return copy_t, inplace_t

    copy_times, inplace_times = bandwidth()      # measured before and after the optimizers (load drifts)
    cn, nc = s["chunk_numel"], s["num_chunks"]
    numel = cn * nc
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    hp = _hp()

    def add_row(method, grad_dtype, tensors, times, nominal_bpp):
        rows.append({"method": method, "grad_dtype": str(grad_dtype).replace("torch.", ""), "tensors": tensors,
                     "numel": numel, "times_s": times, "median_s": _median(times),
                     "nominal_bytes_per_param": nominal_bpp})

    # -- ChunkAdamW as the engine calls it. fp32 compute: the param chunk is the master and the
    #    gradient has a buffer of its own (grad r 4, master r+w 8, exp_avg r+w 8, exp_avg_sq r+w 8 =
    #    28 B, what torch.optim.AdamW touches). 16-bit compute: the param chunk holds the gradient and
    #    gets the new master's cast (2 + 2 + 24 = 28 B). The fp32 layout with a master of its own and
    #    a cast back (32 B, what the engine did before) is kept as a row to compare with.
    step_t = torch.tensor(1.0)
    kw = dict(lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps,
              amsgrad=False, maximize=False)
    grad_dtypes = [dtype] + [d for d in (torch.float32, torch.bfloat16) if d != dtype]
    for gd in grad_dtypes:
        variants = [("pscompile ChunkAdamW.update_chunk, param chunk = master", True)] if gd == torch.float32 else []
        variants.append(("pscompile ChunkAdamW.update_chunk, master + cast back" if gd == torch.float32
                         else "pscompile ChunkAdamW.update_chunk", False))
        for label, shared in variants:
            opt = ChunkAdamW(hp)
            chunks = [((torch.randn(cn, generator=g) * 1e-3).to(gd), torch.randn(cn, generator=g) * 0.02,
                       torch.zeros(cn), torch.zeros(cn)) for _ in range(nc)]
            opt.begin_step()

            def run_chunks():
                for p, m, ea, eas in chunks:
                    if shared:                          # p: the gradient's own buffer; m: params and master
                        opt.update_chunk(None, m, ea, eas, grad_factor=1.0, frozen=[], grad=p)
                    else:
                        opt.update_chunk(p, m, ea, eas, grad_factor=1.0, frozen=[])

            add_row(label, gd, nc, _time_reps(run_chunks, reps), 32 if gd == torch.float32 and not shared else 28)
            if shared:
                def run_kernel():                       # the fused kernel alone on the same chunks
                    for p, m, ea, eas in chunks:
                        torch._fused_adamw_([m], [p], [ea], [eas], [], [step_t], **kw)

                add_row("  of which torch._fused_adamw_ alone", gd, nc, _time_reps(run_kernel, reps), 28)
            del chunks, opt
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
            times = _time_reps(opt.step, reps)
        except (RuntimeError, ValueError) as e:
            rows.append({"method": label, "error": str(e)})
            continue
        add_row(label, torch.float32, k, times, 28)   # grad r, param r+w, exp_avg r+w, exp_avg_sq r+w
        del params, opt
        gc.collect()
    c2, i2 = bandwidth()
    copy_times += c2
    inplace_times += i2
    copy_bw = 2 * s["copy_numel"] * 4 / _median(copy_times)
    inplace_bw = 2 * s["copy_numel"] * 4 / _median(inplace_times)
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
                         f"{p['median_step_s']:.3f}", "1.00", _mib(p["peak_device_bytes"]), "1.00", "0", "-", "-"])
            for name, label in (("hooks_unlimited", "hooks, no budget"), ("hooks_tight", "hooks, tight")):
                h = r.get(name)
                if h is None or "error" in h:
                    rows.append([r["d_model"], "", label, "-", "failed", "", "", "", "", "",
                                 _short(h.get("error", "") if h else "", 40)])
                    continue
                budget = _mib(h["budget_bytes"]) if h["budget_bytes"] else "none"
                if h.get("budget_fraction_of_plain_peak"):
                    budget += f" ({h['budget_fraction_of_plain_peak']:.0%})"
                peak = _mib(h["peak_device_bytes"])
                if h["within_budget"] is False:
                    peak += " OVER"
                rows.append([r["d_model"], "", label, budget, f"{h['median_step_s']:.3f}",
                             f"{h['time_ratio_vs_plain']:.2f}", peak, f"{h['peak_ratio_vs_plain']:.2f}",
                             _mib(h["bytes_moved_per_step"]),
                             f"{h['num_fetches_per_step']}/{h['num_evictions_per_step']}",
                             f"{h['max_abs_loss_diff_vs_plain']:.1e}"])
        out.append((cap, hdr, rows))
    s2 = res.get("largest_under_budget")
    if s2:
        cap = (f"2. largest GPT trainable under a device budget of {format_bytes(s2['budget_bytes'])} "
               f"({s2['dtype']}, vocab {s2['vocab_size']}, seq {s2['seq_len']}, batch {s2['batch']}): plain peak "
               "is measured (one real step, all tensors) or computed (16 B/param + measured 1-layer "
               "excess, a lower bound); hooks = compile under the budget + one step, peak measured")
        hdr = ["layers", "d_model", "params", "plain peak MiB", "plain source", "plain fits",
               "hooks", "hooks peak MiB", "hooks step s", "MiB moved", "host RSS GB", "note"]
        rows = []
        for r in s2["rungs"]:
            base = [r["n_layer"], r["d_model"], f"{r['params'] / 1e6:.1f}M"]
            if "skipped" in r:
                rows.append(base + ["-", "-", "-", "skipped", "-", "-", "-", "-", _short(r["skipped"], 60)])
                continue
            p, h = r["plain"], r["hooks"]
            rss = r.get("host_peak_rss_bytes")
            rss = "-" if rss is None else f"{rss / 1e9:.1f}"
            if "peak_device_bytes" in h:
                hooks_cols = ["yes" if h["ok"] else "NO", _mib(h["peak_device_bytes"]), f"{h['step_s']:.2f}",
                              _mib(h["bytes_moved"]), rss, _short(h.get("error", ""), 60)]
            else:
                hooks_cols = ["NO", "-", "-", "-", rss, _short(h.get("error", ""), 60)]
            rows.append(base + [_mib(p["peak_bytes"]), p["source"], "yes" if p["fits"] else "no"] + hooks_cols)
        out.append((cap, hdr, rows))
        lg = s2["largest"]
        ratio = lg["ratio_hooks_over_plain"]
        cap = (f"2b. largest GPT of the ladder that trains under {format_bytes(s2['budget_bytes'])}, per system "
               "(plain: peak <= budget; hooks: compile succeeds and one step's measured peak <= budget)")
        hdr = ["system", "largest params", "layers", "d_model", "params / plain's"]
        rows = []
        for key, label in (("plain", "plain PyTorch"), ("hooks", "pscompile hooks")):
            x = lg[key]
            if x is None:
                rows.append([label, "none", "-", "-", "-"])
            else:
                rows.append([label, f"{x['params'] / 1e6:.1f}M", x["n_layer"], x["d_model"],
                             "1.0" if key == "plain" else (f"{ratio:.1f}" if ratio else "n/a")])
        out.append((cap, hdr, rows))
    s3 = res.get("adamw_throughput")
    if s3:
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
                 f"{_median(s3['copy_bandwidth']['times_s']):.4f}", "-", "8", f"{bw / 1e9:.2f}", "1.00",
                 f"{bw / ibw:.2f}" if ibw else "-", "-", "-"]]
        if ibw:
            rows.append(["reference: in-place x.mul_(1.0)", "float32", 1,
                         f"{_median(s3['inplace_bandwidth']['times_s']):.4f}", "-", "8", f"{ibw / 1e9:.2f}",
                         f"{ibw / bw:.2f}", "1.00", "-", "-"])
        for r in s3["rows"]:
            if "error" in r:
                rows.append([r["method"], "-", "-", "failed", "", "", "", "", "", _short(r["error"], 40)])
                continue
            rows.append([r["method"], r["grad_dtype"], r["tensors"], f"{r['median_s']:.4f}",
                         f"{r['params_per_s'] / 1e6:.0f}", r["nominal_bytes_per_param"],
                         f"{r['bytes_per_s'] / 1e9:.2f}", f"{r['fraction_of_copy_bandwidth']:.2f}",
                         f"{r['fraction_of_inplace_bandwidth']:.2f}" if "fraction_of_inplace_bandwidth" in r else "-",
                         f"{r['bytes_per_s_vs_fused_torch']:.2f}" if "bytes_per_s_vs_fused_torch" in r else "-",
                         f"{r['time_ratio_vs_chunkadamw']:.2f}"])
        out.append((cap, hdr, rows))
    return out


def render(res: dict, fmt: str = "simple") -> str:
    """All sections of ``res`` as text tables (``fmt='github'`` gives Markdown)."""
    parts = []
    for cap, hdr, rows in _tables(res):
        if fmt == "github":
            parts.append(f"**{cap}**\n\n" + tabulate(rows, hdr, tablefmt="github", disable_numparse=True))
        else:
            parts.append(cap + "\n" + tabulate(rows, hdr, tablefmt=fmt, disable_numparse=True))
    meta = res.get("meta", {})
    if meta:
        foot = (f"torch {meta.get('torch')}, {meta.get('threads')} threads, {meta.get('cpu', '?')}; load average "
                f"at start {meta.get('loadavg_start')}, at end {meta.get('loadavg_end')} (other processes "
                f"share this machine: timings are noisy); total {meta.get('elapsed_s', 0):.0f} s")
        parts.append(("_" + foot + "_") if fmt == "github" else foot)
    return "\n\n".join(parts)


def render_markdown(res: dict) -> str:
    return render(res, "github")


# ---------------------------------------------------------------------------------- main

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results path (default {DEFAULT_OUT})")
    ap.add_argument("--markdown", action="store_true", help="print GitHub-flavoured Markdown tables at the end")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                    help="compute dtype for sections 1 and 3 (default float32; bf16 matmul is very slow on "
                         "AVX2-only CPUs). Section 2 always uses float32")
    ap.add_argument("--budget", default=None, help="device budget for section 2 (default 256MiB; quick: 2MiB)")
    ap.add_argument("--max-params", type=int, default=None, help="largest rung in section 2 (default 400M)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps in section 1")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps in section 1 (>= 2)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: this 2-core machine is shared, and with 2 OpenMP "
                         "threads every parallel region waits for a descheduled thread, measured 3-40x slower "
                         "under load)")
    ap.add_argument("--sections", default="1,2,3", help="comma-separated subset of 1,2,3")
    ap.add_argument("--_rung", default=None, help=argparse.SUPPRESS)     # internal: one section-2 rung
    ap.add_argument("--from-json", type=Path, default=None, help="only render tables from a results file")
    args = ap.parse_args(argv)

    if args._rung:
        print(json.dumps(_rung_worker(json.loads(args._rung))))
        return 0
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        print(render(res, "github" if args.markdown else "simple"))
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
    res: dict[str, Any] = {"meta": {
        "torch": torch.__version__, "pscompile": pscompile.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "quick": args.quick, "dtype": args.dtype,
        "argv": sys.argv[1:] if argv is None else argv, "loadavg_start": _loadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dtype_note": ("float32 by default: bfloat16 matmul (esp. backward layouts) is 10-100x slower than "
                       "float32 on this CPU (AVX2 without AVX512-BF16)"),
    }}
    print(f"pscompile foundation benchmark: compute dtype {args.dtype} (sections 1, 3; section 2 float32). "
          f"{res['meta']['dtype_note']}. {torch.get_num_threads()} torch thread(s) of {os.cpu_count()} CPUs; "
          f"load average {res['meta']['loadavg_start']}.", flush=True)

    def save():
        res["meta"]["loadavg_end"] = _loadavg()
        res["meta"]["elapsed_s"] = time.perf_counter() - t_start
        res["meta"]["max_rss_bytes"] = _max_rss_bytes()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))

    for key, num, fn in (("hooks_vs_plain", "1", lambda: section_hooks_vs_plain(settings["s1"], dtype)),
                         ("largest_under_budget", "2",
                          lambda: section_largest(settings["s2"], args.budget, args.max_params)),
                         ("adamw_throughput", "3", lambda: section_adamw(settings["s3"], dtype))):
        if num not in sections:
            continue
        t0 = time.perf_counter()
        res[key] = fn()
        res[key]["section_s"] = time.perf_counter() - t0
        res[key]["loadavg_after"] = _loadavg()
        save()
        print()
        print(render({key: res[key]}, "simple"), flush=True)
        print(f"(section {num}: {res[key]['section_s']:.0f} s)", flush=True)
    save()
    print(f"\ntotal {res['meta']['elapsed_s']:.0f} s; results written to {args.out}")
    if args.markdown:
        print("\n---- Markdown ----\n")
        print(render_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
