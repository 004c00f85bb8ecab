"""One row of a GPU run: its settings, the systems, a timed training run and its peaks, the
deadline, and the run's failures."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import pscompile
from harness.specs import adamw, gpt, gpt_config, token_batches
from pscompile.testing import ReferenceTrainer

MiB = 2**20
GPU = dict(parity=(2, 256), speed=(24, 2048), vocab=8192, seq=512, batch=4, steps=4, warmup=1, chunk=None)
DRY = dict(parity=(2, 64), speed=(2, 64), vocab=256, seq=32, batch=2, steps=2, warmup=1, chunk=4096,
           device_bytes=64 * MiB)
SYSTEMS = {"hooks": dict(mode="hooks"), "compiled eager": dict(mode="compiled", backend="eager"),
           "compiled inductor": dict(mode="compiled", backend="inductor")}

# a pscompile row's step: its key -> the StepStats field
STEP_FIELDS = dict(moved="bytes_moved", h2d="h2d_bytes", d2h="d2h_bytes", peak="peak_device_bytes",
                   allocator_peak="allocator_peak_bytes", forward_s="forward_s", backward_s="backward_s",
                   optimizer_s="optimizer_s", compute_ops="compute_ops", compiled_ops="compiled_ops",
                   compiled_share="compiled_share")


class Clock:
    """The run's deadline: rows started after it are skipped, not run."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


class Unavailable(Exception):
    """A system that cannot run on this machine (not installed, no CUDA build of its ops): its row
    is skipped with this reason, not failed."""


def model(size: tuple[int, int], s: dict):
    """The GPT of ``size`` (layers, width) at ``s``'s vocabulary and sequence length."""
    return gpt(size[0], size[1], s["vocab"], s["seq"])


def params_of(size: tuple[int, int], s: dict) -> int:
    """The GPT's parameters, from its config (building a 420M-parameter model to count them costs seconds)."""
    return gpt_config(size[0], size[1], s["vocab"], s["seq"]).num_params()


def batches(s: dict, n: int) -> list:
    return token_batches(s["vocab"], s["batch"], s["seq"], n, seed=1)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def link_rate(device: str) -> float:
    """Bytes/s of one pinned host->device copy of 256 MiB (CUDA), or of a host memcpy (dry run)."""
    n = (256 if device == "cuda" else 16) * MiB // 4
    src = torch.ones(n, pin_memory=device == "cuda")
    dst = torch.empty(n, device=device)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    sync(device)
    return 3 * n * 4 / (time.perf_counter() - t)


def config(device: str, dtype, budget, name: str, chunk, **extra) -> pscompile.Config:
    """The Config of system ``name``; ``extra``: more Config fields (``optimizer_threads="one less"``
    is this machine's threads less one)."""
    if extra.get("optimizer_threads") == "one less":
        extra["optimizer_threads"] = max(1, torch.get_num_threads() - 1)
    return pscompile.Config(device=device, dtype=dtype, device_memory=budget, chunk_size=chunk or "auto",
                            **SYSTEMS[name], **extra)


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def timed(step, data, device: str, record=lambda: {}) -> list[dict]:
    """Per batch of ``data``: ``step(batch)``'s loss and wall time (the device synchronized), and
    ``record()``; on CUDA the last step's ``allocator_peak`` is, unless ``record`` gave one, the
    allocator's peak since ``reset_peak``."""
    rows = []
    for b in data:
        sync(device)
        t0 = time.perf_counter()
        loss = step(b)
        sync(device)
        rows.append(dict(loss=loss, time_s=time.perf_counter() - t0, **record()))
    if device == "cuda" and rows:
        rows[-1].setdefault("allocator_peak", torch.cuda.max_memory_allocated())
    return rows


def run_pscompile(make, data, device: str, budget) -> dict:
    """Train on ``data``; per step the loss, time, bytes moved and both peaks (ours and the
    allocator's), and the compute operators and those that ran in compiled code."""
    t = time.perf_counter()
    engine = make()
    try:
        rows = timed(engine.step, data, device,
                     lambda: {k: getattr(engine.stats, f) for k, f in STEP_FIELDS.items()})
        over = [r for r in rows if budget is not None and max(r["peak"], r["allocator_peak"] or 0) > budget]
        return dict(first_s=time.perf_counter() - t - sum(r["time_s"] for r in rows[1:]), steps=rows,
                    within_budget=not over, min_device_memory=engine.min_device_memory)
    finally:
        engine.close()


def run_plain(size, data, s, device: str, dtype, compiled: bool) -> dict:
    reset_peak(device)
    trainer = ReferenceTrainer(model(size, s), optimizer=adamw(1e-3), dtype=dtype, device=device,
                               fused=device == "cuda")
    if compiled:
        trainer.model = torch.compile(trainer.model)
    return dict(steps=timed(trainer.step, data, device))


def step_time(row: dict, warmup: int) -> float:
    return statistics.median(r["time_s"] for r in row["steps"][1 + warmup:])


def guarded(clock: Clock, need_s: float, fn, **label) -> dict:
    """``fn()``'s row with ``label``; ``skipped`` past the deadline or ``Unavailable``, ``error`` if
    it raised."""
    if clock.left() < need_s:
        return dict(label, skipped=f"deadline: {clock.left():.0f} s left, the row needs ~{need_s:.0f} s")
    t = time.perf_counter()
    try:
        row = dict(label, **fn())
    except Unavailable as e:
        row = dict(label, skipped=str(e))
    except Exception as e:                    # noqa: BLE001 -- recorded in the row; the script exits 1
        row = dict(label, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    progress(row, time.perf_counter() - t)
    return row


def progress(row: dict, seconds: float) -> None:
    """One line per finished row on stderr, so a run cut off by an outer time limit still shows its
    results so far."""
    brief = {k: v for k, v in row.items() if k != "steps"}
    if "steps" in row:
        brief.update(losses=[round(float(r["loss"]), 4) for r in row["steps"]],
                     times_s=[round(r["time_s"], 4) for r in row["steps"]])
        last = row["steps"][-1]
        brief.update({f"last_{k}": round(last[k], 4) for k in ("forward_s", "backward_s", "optimizer_s") if k in last})
    print(f"[{seconds:6.1f} s] {json.dumps(brief, default=str)}", file=sys.stderr, flush=True)


def failures(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['section']} {r.get('system')}: {r['error']}")
        elif r.get("within_budget") is False:
            out.append(f"{r['section']} {r.get('system')}: a step's peak went over the budget {r.get('budget')}")
        elif r.get("tracks") is False:
            out.append(f"parity {r['system']} {r['dtype']}: loss {r['max_rel_loss']:.2e} from plain PyTorch")
        elif r.get("evicted") is False:
            out.append(f"parity {r['system']} {r['dtype']}: the budget {r['budget']} moved no bytes")
    return out
