"""Capacity: the largest GPT each system trains on given memory, on this machine's CPU.

Two sections, printed as tables and written with every raw number to JSON:

1. **Tiers** -- a device budget *and* a host budget (``host_memory``): the largest GPT of a
   fixed-width family (d=256, growing depth) that compiles and trains two steps within both, per
   system: plain PyTorch (everything on the device), hooks mode, compiled mode keeping every
   activation (``activations="keep"``), offloading them all (``"offload"``) and choosing per
   segment what to recompute or offload (``"auto"``). Its
   parameters are set against the physical limit ``(device + host - peak non-model) / 16 bytes``
   (fp32 master, two Adam states and the fp32 compute copy), with the run's own measured peak of
   non-model bytes. Depth is found by bisection; every probe runs in its own process.
2. **Scale** -- a device budget only (256 MiB, vocab 8192, seq 128, batch 1: the setting of
   ``bench/foundation.py`` section 2): GPT rungs trained in compiled mode with ``"keep"``,
   ``"offload"`` and ``"auto"``, and in hooks mode, two steps each (the first measures, the second runs the re-planned
   schedule); the largest that trains per system. A rung is skipped for a system once a smaller
   one (no deeper, no wider) failed for it.

Compiled mode runs the eager backend here: this benchmark is about memory, and Inductor's compile
time on 30-layer graphs would dominate. float32 throughout.

    python bench/capacity.py [--quick] [--sections 1,2] [--markdown] [--out bench/results/capacity.json]
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import pscompile
from pscompile.units import parse_size

from harness.systems import log, plain_tracked_step
from harness.host import vm_hwm_bytes
from harness.output import parser, table, write_json
from harness.runner import ChildFailed, child, run_fresh
from harness.specs import adamw, gpt, gpt_config, token_batches

MiB = 2**20
SYSTEMS = ("plain", "hooks", "compiled-keep", "compiled-offload", "compiled-auto")
SCALE_SYSTEMS = ("hooks", "compiled-keep", "compiled-offload", "compiled-auto")

FULL = {
    "s1": dict(d=256, vocab=1024, seq=128, batch=1, pairs=(("32MiB", "96MiB"), ("64MiB", "192MiB")), max_layers=64),
    "s2": dict(vocab=8192, seq=128, batch=1, budget="256MiB",
               rungs=((16, 1024), (8, 1536), (24, 1024), (32, 1024), (16, 1536), (40, 1024), (48, 1024)),
               max_host_gb=18.0, rung_time_limit_s=900.0),
}
QUICK = {
    # 640 KiB: compiled-keep trains 1 layer and is refused at 2 (its minimum ~0.73 MiB), compiled-auto
    # trains 2 (~0.44 MiB), so each search takes two probes
    "s1": dict(d=64, vocab=256, seq=64, batch=1, pairs=(("640KiB", "4MiB"),), max_layers=2),
    "s2": dict(vocab=256, seq=32, batch=1, budget="3MiB", rungs=((2, 128),),
               max_host_gb=18.0, rung_time_limit_s=120.0),
}


def _hp() -> pscompile.AdamW:
    return adamw(1e-4, betas=(0.9, 0.95), weight_decay=0.1)


# ---------------------------------------------------------------------------------- one probe (child process)
def probe(spec: dict) -> dict:
    """Train ``spec``'s GPT two steps under ``spec``'s system and budgets; what happened."""
    torch.set_num_threads(1)
    model = gpt(spec["n_layer"], spec["d"], spec["vocab"], spec["seq"])
    batch = token_batches(spec["vocab"], spec["batch"], spec["seq"], 1, seed=1)[0]
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"params": params, "ok": False}
    device, host, system = spec["device"], spec.get("host"), spec["system"]
    t0 = time.perf_counter()
    try:
        if system == "plain":
            from pscompile.testing import ReferenceTrainer
            trainer = ReferenceTrainer(model, optimizer=_hp(), dtype=torch.float32, copy_model=False)
            trainer.step(batch)
            _, tracker, seconds = plain_tracked_step(trainer, batch)   # every tensor it holds, counted
            out.update(peak_device_bytes=tracker.peak_total, peak_nonmodel_bytes=None, step_s=[seconds])
            out["ok"] = tracker.peak_total <= device
            if not out["ok"]:
                out["error"] = f"peak {tracker.peak_total / MiB:.1f} MiB > device {device / MiB:.1f} MiB"
        else:
            mode, activations = ("hooks", "auto") if system == "hooks" else ("compiled", system.split("-")[1])
            config = pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32,
                                      device_memory=device, host_memory=host, activations=activations)
            engine = pscompile.compile(model, batch, optimizer=_hp(), config=config)
            out["compile_s"] = time.perf_counter() - t0
            peaks, nonmodel, steps = [], [], []
            for _ in range(2):
                t1 = time.perf_counter()
                loss = engine.step(batch)
                steps.append(time.perf_counter() - t1)
                peaks.append(engine.stats.peak_device_bytes)
                nonmodel.append(engine.stats.peak_nonmodel_bytes)
            data = engine.model_data()
            out.update(loss=loss, peak_device_bytes=max(peaks), peak_nonmodel_bytes=max(nonmodel), step_s=steps,
                       model_data_device=data["device"], model_data_host=data["host"],
                       chunk_size=engine.layout.chunk_size, num_chunks=engine.layout.num_chunks,
                       moved_bytes=engine.stats.bytes_moved)
            if mode == "compiled":
                plan = engine.schedule.scheduled.activations
                out["activations"] = plan.describe() if plan is not None else None
                out["recomputed_segments"] = len(plan.recomputed) if plan is not None else 0
                out["offloaded_segments"] = len(plan.offloaded) if plan is not None else 0
                out["offload_bytes"] = engine.stats.offload_bytes
            out["ok"] = max(peaks) <= device and loss == loss
            engine.close()
    except (ValueError, RuntimeError, MemoryError) as e:       # BudgetError is a ValueError
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["host_peak_rss_bytes"] = vm_hwm_bytes()
    out["wall_s"] = time.perf_counter() - t0
    return out


def _run_probe(spec: dict, timeout: float) -> dict:
    try:
        return run_fresh(__file__, spec, timeout=timeout)
    except ChildFailed as e:
        what = str(e).splitlines()[0].rsplit(": ", 1)[-1]        # "exit N" or "timed out after T s"
        return {"ok": False, "error": f"probe process failed ({what}): {e.tail[-300:]}"}


# ---------------------------------------------------------------------------------- section 1
def section_tiers(s: dict, systems: tuple[str, ...] = SYSTEMS) -> dict:
    rows = []
    for device_arg, host_arg in s["pairs"]:
        device, host = parse_size(device_arg, "device"), parse_size(host_arg, "host")
        for system in systems:
            probes: dict[int, dict] = {}

            def ok(n: int) -> bool:
                if n not in probes:
                    spec = dict(system=system, n_layer=n, d=s["d"], vocab=s["vocab"], seq=s["seq"], batch=s["batch"],
                                device=device, host=None if system == "plain" else host)
                    probes[n] = _run_probe(spec, 600)
                    log(f"[1] {device_arg}+{host_arg} {system} L{n}: "
                         + ("ok" if probes[n]["ok"] else probes[n].get("error", "?")[:120]))
                return probes[n]["ok"]

            lo, hi = 0, s["max_layers"] + 1          # ok(lo) (0: nothing), not ok(hi)
            step = 1
            while lo + step < hi and ok(lo + step):  # gallop up, then bisect
                lo += step
                step *= 2
            hi = min(hi, lo + step)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if ok(mid):
                    lo = mid
                else:
                    hi = mid
            best = probes.get(lo)
            row: dict[str, Any] = {"device_bytes": device, "host_bytes": host, "system": system, "n_layer": lo,
                                   "probes": {str(k): v for k, v in sorted(probes.items())},
                                   "first_failure": probes.get(hi, {}).get("error") if hi in probes else None}
            if best is not None:
                nonmodel = best.get("peak_nonmodel_bytes")
                if nonmodel is None:                 # plain PyTorch: its peak over its 16 B/param model data
                    nonmodel = best["peak_device_bytes"] - 16 * best["params"]
                limit = (device + host - nonmodel) / 16
                row.update(params=best["params"], peak_nonmodel_bytes=nonmodel, limit_params=limit,
                           fraction=best["params"] / limit, result=best)
            rows.append(row)
    return {"d_model": s["d"], "vocab": s["vocab"], "seq": s["seq"], "batch": s["batch"], "rows": rows}


# ---------------------------------------------------------------------------------- section 2
def section_scale(s: dict, systems: tuple[str, ...] = SCALE_SYSTEMS) -> dict:
    budget = parse_size(s["budget"], "budget")
    rows = []
    for n_layer, d in s["rungs"]:
        params = gpt_config(n_layer, d, s["vocab"], s["seq"]).num_params()
        for system in systems:
            row: dict[str, Any] = {"n_layer": n_layer, "d_model": d, "params": params, "system": system}
            rows.append(row)
            if 28 * params > s["max_host_gb"] * 1e9:
                row["skipped"] = f"estimated host RAM {28 * params / 1e9:.1f} GB > {s['max_host_gb']} GB"
                continue
            earlier = [r for r in rows[:-1] if r["system"] == system and not r.get("result", {}).get("ok")
                       and r["params"] <= params and r["d_model"] <= d and r["n_layer"] <= n_layer]
            if earlier:
                row["skipped"] = f"a smaller rung (L{earlier[0]['n_layer']} d{earlier[0]['d_model']}) did not train"
                continue
            log(f"[2] {system} L{n_layer} d{d}: {params:,} params")
            spec = dict(system=system, n_layer=n_layer, d=d, vocab=s["vocab"], seq=s["seq"], batch=s["batch"],
                        device=budget, host=None)
            row["result"] = _run_probe(spec, s["rung_time_limit_s"])
            log(f"    -> {'ok' if row['result']['ok'] else row['result'].get('error', '?')[:160]}")
    return {"budget_bytes": budget, "vocab": s["vocab"], "seq": s["seq"], "batch": s["batch"], "rows": rows}


# ---------------------------------------------------------------------------------- tables
def _m(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}M"


def tables(res: dict) -> list[tuple[str, list[str], list[list[Any]]]]:
    out = []
    if "s1" in res:
        s1 = res["s1"]
        rows = []
        for r in s1["rows"]:
            best = r.get("result", {})
            rows.append([f"{r['device_bytes'] / MiB:.0f} + {r['host_bytes'] / MiB:.0f}", r["system"], r["n_layer"],
                         _m(r.get("params")), _m(r.get("limit_params")),
                         "-" if r.get("fraction") is None else f"{r['fraction']:.1%}",
                         "-" if r.get("peak_nonmodel_bytes") is None else f"{r['peak_nonmodel_bytes'] / MiB:.1f}",
                         "-" if best.get("model_data_device") is None else f"{best['model_data_device'] / MiB:.1f}",
                         "-" if best.get("model_data_host") is None else f"{best['model_data_host'] / MiB:.1f}",
                         "-" if "recomputed_segments" not in best else
                         f"{best['recomputed_segments']} / {best.get('offloaded_segments', 0)}",
                         (r.get("first_failure") or "-")[:70]])
        out.append((f"1. largest GPT (d={s1['d_model']}, growing depth, vocab {s1['vocab']}, seq {s1['seq']}, batch "
                    f"{s1['batch']}, float32) that trains two steps within a device and a host budget; limit = "
                    "(device + host - peak non-model) / 16 B",
                    ["device + host MiB", "system", "layers", "params", "limit", "of limit", "non-model MiB",
                     "model data on device MiB", "on host MiB", "segments recomputed / offloaded",
                     "next depth fails with"],
                    rows))
    if "s2" in res:
        s2 = res["s2"]
        rows = []
        for r in s2["rows"]:
            x = r.get("result", {})
            steps = x.get("step_s") or []
            rows.append([r["n_layer"], r["d_model"], _m(r["params"]), r["system"],
                         "skipped" if "skipped" in r else ("yes" if x.get("ok") else "NO"),
                         "-" if x.get("peak_device_bytes") is None else f"{x['peak_device_bytes'] / MiB:.1f}",
                         "-" if not steps else f"{steps[-1]:.1f}",
                         "-" if x.get("host_peak_rss_bytes") is None else f"{x['host_peak_rss_bytes'] / 1e9:.1f}",
                         (r.get("skipped") or x.get("activations") or x.get("error") or "")[:90]])
        out.append((f"2. GPT rungs under device_memory={s2['budget_bytes'] / MiB:.0f} MiB (vocab {s2['vocab']}, seq "
                    f"{s2['seq']}, batch {s2['batch']}, float32), two steps each "
                    "(compiled mode with the eager backend)",
                    ["layers", "d_model", "params", "system", "trains", "peak MiB", "step s", "host RSS GB",
                     "activations / note"], rows))
        summary = []
        for system in SCALE_SYSTEMS:
            ok = [r for r in s2["rows"] if r["system"] == system and r.get("result", {}).get("ok")]
            if ok:
                b = max(ok, key=lambda r: r["params"])
                summary.append([system, _m(b["params"]), b["n_layer"], b["d_model"], b["params"]])
        base = next((row[4] for row in summary if row[0] == "hooks"), None)
        for row in summary:
            row[4] = "-" if not base else f"{row[4] / base:.2f}"
        out.append(("2b. largest GPT trained under the budget, per system",
                    ["system", "params", "layers", "d_model", "params / hooks mode's"], summary))
    return out


def render(res: dict, markdown: bool) -> str:
    return "\n\n".join(f"{title}\n{table(rows, headers, markdown=markdown)}"
                       for title, headers, rows in tables(res))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "capacity", markdown=True, child=True)
    ap.add_argument("--sections", default="1,2", help="comma-separated subset of 1,2")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"a subset of {','.join(SYSTEMS)} (section 2 runs those of them it has)")
    ap.add_argument("--from-json", type=Path, default=None, help="only render tables from a results file")
    args = ap.parse_args(argv)
    if child(args.child, probe):
        return 0
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
    else:
        settings = QUICK if args.quick else FULL
        sections = {s.strip() for s in args.sections.split(",")}
        t0 = time.perf_counter()
        res: dict[str, Any] = {"settings": {k: settings[k] for k in ("s1", "s2")}, "quick": args.quick,
                               "torch": torch.__version__, "machine": platform.machine()}
        systems = tuple(x.strip() for x in args.systems.split(","))
        unknown = set(systems) - set(SYSTEMS)
        if unknown:
            ap.error(f"--systems: unknown {sorted(unknown)}; use a subset of {','.join(SYSTEMS)}")
        if "1" in sections:
            res["s1"] = section_tiers(settings["s1"], systems)
        if "2" in sections:
            res["s2"] = section_scale(settings["s2"], tuple(x for x in SCALE_SYSTEMS if x in systems))
        res["total_s"] = time.perf_counter() - t0
        write_json(args.out, res)
    print(render(res, False))
    if args.markdown:
        print()
        print(render(res, True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
