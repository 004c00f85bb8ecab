"""A model larger than this machine: a GPT whose model data (16 bytes per parameter in fp32: the
parameters, the fp32 master and Adam's two moments) exceeds the machine's physical RAM trains for
a few steps with ``host_memory`` well under RAM, its parameters, gradients and optimizer states on
the disk tier (``Config(disk_dir=...)``), in compiled mode.

The model is built on the meta device and materialized one module at a time as the chunks fill
(the host never holds it whole). The script states the folder's free space up front; ``compile``
sizes the disk tier's file from the chunk layout and checks it against that free space before it
makes the file (a clear error naming both, nothing left behind, when it does not fit), and the
script states the size before training starts.
It reports per step: seconds, loss, disk GB read and written, peak device and host bytes of model
data; and the process's peak RSS (``getrusage``), beside the machine's RAM.

    python bench/beyond_ram.py [--quick] [--params 2.6e9] [--host-memory 4GiB] [--device-memory 3GiB]
                               [--dir FOLDER] [--steps 3] [--markdown] [--out bench/results/beyond_ram.json]

``--quick`` (what CI runs) is the same script on a tiny GPT whose model data exceeds device plus
host budgets of a few MiB. Float32, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.units import format_bytes, parse_size

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "beyond_ram.json"


def gpt_for(params: float, *, seq: int, vocab: int) -> GPTConfig:
    """A GPT of about ``params`` parameters: width 2560 (128-wide heads), as many layers as it takes."""
    d = 2560 if params > 5e8 else 128
    per_layer = 12 * d * d + 13 * d
    n_layer = max(1, round((params - vocab * d - seq * d) / per_layer))
    return GPTConfig(n_layer=n_layer, n_head=max(1, d // 128), d_model=d, vocab_size=vocab, seq_len=seq)


def machine_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # (Linux: KiB)


def batches(cfg: GPTConfig, n: int, batch: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def run(args) -> dict:
    cfg = gpt_for(args.params, seq=args.seq, vocab=args.vocab)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    data = batches(cfg, args.steps, args.batch)
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                              device_memory=args.device_memory, host_memory=args.host_memory,
                              chunk_size=args.chunk_size, disk_dir=args.dir)
    ram = machine_ram()
    print(f"GPT d{cfg.d_model} L{cfg.n_layer}: {n / 1e9:.2f}B parameters, model data {format_bytes(n * 16)} "
          f"({n * 16 / ram:.2f}x this machine's {format_bytes(ram)} of RAM); device_memory "
          f"{format_bytes(args.device_memory)}, host_memory {format_bytes(args.host_memory)}", flush=True)
    free = shutil.disk_usage(args.dir).free
    print(f"disk tier folder: {args.dir}, {format_bytes(free)} free (compile checks its file against it first)",
          flush=True)
    t0 = time.perf_counter()
    try:
        engine = pscompile.compile(model, data[0], optimizer=pscompile.AdamW(lr=1e-4), config=config)
    except ValueError as e:                 # (no room for the file: nothing was made)
        raise SystemExit(f"error: {e}") from None
    setup_s = time.perf_counter() - t0
    store = engine.store
    file = store.disk.queue.file if store.disk is not None else None
    need = file.slot_bytes * file.num_slots if file is not None else 0
    print(f"disk tier: needs {format_bytes(need)} of the {format_bytes(free)} free", flush=True)
    print(f"compiled and filled the chunks in {setup_s:.1f} s: {engine.layout.num_chunks} chunks of "
          f"{engine.layout.chunk_size / 1e6:.1f}M elements, {len(engine.param_disk_chunks)} with their parameters on "
          f"disk, {format_bytes(store.disk_model_bytes())} on disk, peak RSS so far {format_bytes(peak_rss())}",
          flush=True)
    rows = []
    try:
        for i, b in enumerate(data):
            loss = engine.step(b)
            s = engine.stats
            rows.append(dict(step=i, loss=loss, step_s=s.time_s, forward_backward_s=s.forward_s + s.backward_s,
                             optimizer_s=s.optimizer_s, disk_read_gb=s.disk_read_bytes / 1e9,
                             disk_write_gb=s.disk_write_bytes / 1e9, peak_device_bytes=s.peak_device_bytes,
                             peak_host_bytes=s.peak_host_bytes, rss_bytes=peak_rss()))
            print(f"step {i}: loss {loss:.4f}, {s.time_s:.1f} s, disk {s.disk_read_bytes / 1e9:.1f} GB read "
                  f"{s.disk_write_bytes / 1e9:.1f} GB written, peak host {format_bytes(s.peak_host_bytes)}, "
                  f"peak RSS {format_bytes(peak_rss())}", flush=True)
    finally:
        engine.close()
    return dict(params=n, config=dict(n_layer=cfg.n_layer, d_model=cfg.d_model, vocab=cfg.vocab_size,
                                      seq=cfg.seq_len, batch=args.batch),
                model_data_bytes=n * 16, machine_ram_bytes=ram, device_memory=args.device_memory,
                host_memory=args.host_memory, chunk_size=engine.layout.chunk_size,
                num_chunks=engine.layout.num_chunks, param_disk_chunks=len(engine.param_disk_chunks),
                disk_model_bytes=store.disk_model_bytes(), disk_needed_bytes=need, disk_free_bytes=free, setup_s=setup_s, steps=rows,
                peak_rss_bytes=peak_rss(), left_in_folder=sorted(os.listdir(args.dir)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny GPT and budgets of a few MiB (CI)")
    p.add_argument("--params", type=float, default=2.6e9, help="parameters (default 2.6e9: 41.6 GB of model data)")
    p.add_argument("--device-memory", type=lambda v: parse_size(v, "--device-memory"), default=None, help="default 3GiB (--quick: 2MiB)")
    p.add_argument("--host-memory", type=lambda v: parse_size(v, "--host-memory"), default=None, help="default 4GiB (--quick: 3MiB)")
    p.add_argument("--chunk-size", type=int, default=None, help="elements (default 64M; --quick 8192)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=None, help="folder for the disk tier (default: a temporary one)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.params, args.vocab, args.seq = 1.2e6, 256, 16
    args.device_memory = args.device_memory or (2 << 20 if args.quick else 3 << 30)
    args.host_memory = args.host_memory or (3 << 20 if args.quick else 4 << 30)
    args.chunk_size = args.chunk_size or (8192 if args.quick else 1 << 26)
    torch.set_num_threads(1 if args.quick else torch.get_num_threads())
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        args.dir = folder
        res = run(args)
    rows = [(r["step"], f"{r['loss']:.4f}", f"{r['step_s']:.1f}", f"{r['forward_backward_s']:.1f}",
             f"{r['optimizer_s']:.1f}", f"{r['disk_read_gb']:.1f}", f"{r['disk_write_gb']:.1f}",
             format_bytes(r["peak_device_bytes"]), format_bytes(r["peak_host_bytes"])) for r in res["steps"]]
    print(tabulate(rows, headers=["step", "loss", "s", "forward+backward s", "optimizer s", "disk read GB",
                                  "disk written GB", "peak device", "peak host"],
                   tablefmt="github" if args.markdown else "simple"))
    print(f"{res['params'] / 1e9:.2f}B parameters, model data {format_bytes(res['model_data_bytes'])} = "
          f"{res['model_data_bytes'] / res['machine_ram_bytes']:.2f}x RAM; peak RSS {format_bytes(res['peak_rss_bytes'])}"
          f"; files left in the folder: {len(res['left_in_folder'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
