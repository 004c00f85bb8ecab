"""Section 2 of bench/foundation.py: the largest GPT of a ladder that trains under a device budget.

Every rung runs in a fresh process (``rung_worker``, through bench/foundation.py's child flag): its
host memory is returned when it ends, its peak host RSS is measured (VmHWM), and a rung that runs
too long is killed by a timeout instead of stalling the benchmark."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

import pscompile
from pscompile.units import format_bytes, parse_size

from harness.systems import hooks_engine, log, mib, persistent_bytes, plain_trainer, plain_tracked_step, short
from harness.host import vm_hwm_bytes
from harness.runner import ChildFailed, run_fresh
from harness.specs import gpt, gpt_config, token_batches

SCRIPT = Path(__file__).with_name("foundation.py")


def _plain_peak(n_layer: int, spec: dict) -> dict:
    """Plain PyTorch's peak in its second step (the Adam state exists), its params and persistent bytes."""
    shape = (n_layer, spec["d_model"], spec["vocab"], spec["seq"])
    batch = token_batches(spec["vocab"], spec["batch"], spec["seq"], 1)[0]
    trainer = plain_trainer(gpt(*shape), torch.float32)
    trainer.step(batch)
    _, tr, _ = plain_tracked_step(trainer, batch)
    out = {"peak": tr.peak_total, "params": gpt_config(*shape).num_params(),
           "persistent_bytes": persistent_bytes(trainer)}
    del trainer
    gc.collect()
    return out


def rung_worker(spec: dict) -> dict:
    """One ladder rung (run in a child process): plain PyTorch's peak, then hooks mode under the budget."""
    torch.set_num_threads(spec["threads"])
    n_layer, d, vocab, seq, budget = (spec[k] for k in ("n_layer", "d_model", "vocab", "seq", "budget"))
    P = gpt_config(n_layer, d, vocab, seq).num_params()
    batch = token_batches(vocab, spec["batch"], seq, 1)[0]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if spec["plain_measured"]:
        m = _plain_peak(n_layer, spec)
        out["plain"] = {"peak_bytes": m["peak"], "source": "measured", "model_data_bytes": 16 * P,
                        "persistent_bytes": m["persistent_bytes"]}
    else:
        a = spec.get("one_layer")
        if a is None:
            m1 = _plain_peak(1, spec)
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
        model = gpt(n_layer, d, vocab, seq)
        t0 = time.perf_counter()
        eng = hooks_engine(model, batch, budget, torch.float32)
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
    out["host_peak_rss_bytes"] = vm_hwm_bytes()
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
        P = gpt_config(n_layer, d, vocab, seq).num_params()
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
        log(f"[2] rung L{n_layer} d{d}: {P:,} params")
        spec = {"n_layer": n_layer, "d_model": d, "vocab": vocab, "seq": seq, "batch": bsz, "budget": budget,
                "threads": torch.get_num_threads(), "plain_measured": P <= s["plain_measure_max_params"],
                "one_layer": one_layer.get(d)}
        t0 = time.perf_counter()
        try:
            result = run_fresh(SCRIPT, spec, timeout=s["rung_time_limit_s"])
        except ChildFailed as e:
            rung["rung_s"] = time.perf_counter() - t0
            what = str(e).splitlines()[0].rsplit(": ", 1)[-1]        # "exit N" or "timed out after T s"
            if what.startswith("timed out"):
                rung["skipped"] = f"timed out after {s['rung_time_limit_s']:.0f} s (later rungs not run)"
                stop_reason = f"a smaller rung timed out (> {s['rung_time_limit_s']:.0f} s)"
            else:
                rung["skipped"] = f"rung process failed ({what}): {short(e.tail[-500:], 300)}"
                failed.append((n_layer, d))
            continue
        rung["rung_s"] = time.perf_counter() - t0
        rung.update(result)
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
            **{k: None if r is None else {x: r[x] for x in ("n_layer", "d_model", "params")}
               for k, r in (("plain", lp), ("hooks", lh))},
            "ratio_hooks_over_plain": (lh["params"] / lp["params"]) if (lp and lh) else None,
        },
    }


def ladder_tables(s2: dict) -> list[tuple[str, list[str], list[list]]]:
    """Section 2's tables: (caption, headers, rows) of the rungs, and of the largest per system."""
    out = []
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
            rows.append(base + ["-", "-", "-", "skipped", "-", "-", "-", "-", short(r["skipped"], 60)])
            continue
        p, h = r["plain"], r["hooks"]
        rss = r.get("host_peak_rss_bytes")
        rss = "-" if rss is None else f"{rss / 1e9:.1f}"
        if "peak_device_bytes" in h:
            hooks_cols = ["yes" if h["ok"] else "NO", mib(h["peak_device_bytes"]), f"{h['step_s']:.2f}",
                          mib(h["bytes_moved"]), rss, short(h.get("error", ""), 60)]
        else:
            hooks_cols = ["NO", "-", "-", "-", rss, short(h.get("error", ""), 60)]
        rows.append(base + [mib(p["peak_bytes"]), p["source"], "yes" if p["fits"] else "no"] + hooks_cols)
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
    return out
