"""A model larger than this machine (docs/disk-tier.md): a GPT whose model data (16 bytes per
parameter) exceeds the machine's RAM trains a few steps in compiled mode with ``host_memory`` well
under RAM, its parameters, gradients and optimizer states on the disk tier (``disk_dir``).

The model is built on the meta device and materialized one module at a time as the chunks fill.
The script states the folder's free space, then the disk tier's size, which ``compile`` checks
against it before it makes the file (an error naming both, nothing left behind). Per step:
seconds, loss, disk GB read and written, peak device and host bytes; and the peak RSS, beside RAM.

    python bench/beyond_ram.py [--quick] [--params 2.6e9] [--host-memory 4GiB] [--device-memory 3GiB]
                               [--dir FOLDER] [--steps 3] [--markdown] [--out bench/results/beyond_ram.json]

``--quick`` (CI): a tiny GPT whose model data exceeds budgets of a few MiB. Float32, one thread.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch

import pscompile
from harness.host import max_rss_bytes
from harness.output import parser, table, write_json
from harness.runs import cpu_config
from harness.specs import adamw, gpt, token_batches
from pscompile.units import format_bytes, parse_size


def gpt_for(params: float, *, seq: int, vocab: int):
    """A GPT of about ``params`` parameters on the meta device: width 2560, as many layers as it takes."""
    d = 2560 if params > 5e8 else 128
    n_layer = max(1, round((params - vocab * d - seq * d) / (12 * d * d + 13 * d)))
    with torch.device("meta"):
        return gpt(n_layer, d, vocab, seq)


def run(args) -> dict:
    model = gpt_for(args.params, seq=args.seq, vocab=args.vocab)
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    data = token_batches(args.vocab, args.batch, args.seq, args.steps)
    config = cpu_config(device_memory=args.device_memory, host_memory=args.host_memory, chunk_size=args.chunk_size,
                        disk_dir=args.dir)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"GPT d{cfg.d_model} L{cfg.n_layer}: {n / 1e9:.2f}B parameters, model data {format_bytes(n * 16)} "
          f"({n * 16 / ram:.2f}x this machine's {format_bytes(ram)} of RAM); device_memory "
          f"{format_bytes(args.device_memory)}, host_memory {format_bytes(args.host_memory)}", flush=True)
    free = shutil.disk_usage(args.dir).free
    print(f"disk tier folder: {args.dir}, {format_bytes(free)} free (compile checks its file against it first)",
          flush=True)
    t0 = time.perf_counter()
    try:
        engine = pscompile.compile(model, data[0], optimizer=adamw(1e-4), config=config)
    except ValueError as e:                 # (no room for the file: nothing was made)
        raise SystemExit(f"error: {e}") from None
    setup_s = time.perf_counter() - t0
    store = engine.store
    file = store.disk.queue.file if store.disk is not None else None
    need = file.slot_bytes * file.num_slots if file is not None else 0
    print(f"disk tier: needs {format_bytes(need)} of the {format_bytes(free)} free", flush=True)
    print(f"compiled and filled the chunks in {setup_s:.1f} s: {engine.layout.num_chunks} chunks of "
          f"{engine.layout.chunk_size / 1e6:.1f}M elements, {len(engine.param_disk_chunks)} with their parameters on "
          f"disk, {format_bytes(store.disk_model_bytes())} on disk, peak RSS so far {format_bytes(max_rss_bytes())}",
          flush=True)
    rows = []
    try:
        for i, b in enumerate(data):
            loss = engine.step(b)
            s = engine.stats
            rows.append(dict(step=i, loss=loss, step_s=s.time_s, forward_backward_s=s.forward_s + s.backward_s,
                             optimizer_s=s.optimizer_s, disk_read_gb=s.disk_read_bytes / 1e9,
                             disk_write_gb=s.disk_write_bytes / 1e9, peak_device_bytes=s.peak_device_bytes,
                             peak_host_bytes=s.peak_host_bytes, rss_bytes=max_rss_bytes()))
            print(f"step {i}: loss {loss:.4f}, {s.time_s:.1f} s, disk {s.disk_read_bytes / 1e9:.1f} GB read "
                  f"{s.disk_write_bytes / 1e9:.1f} GB written, peak host {format_bytes(s.peak_host_bytes)}, "
                  f"peak RSS {format_bytes(max_rss_bytes())}", flush=True)
    finally:
        engine.close()
    return dict(params=n, config=dict(n_layer=cfg.n_layer, d_model=cfg.d_model, vocab=cfg.vocab_size,
                                      seq=cfg.seq_len, batch=args.batch),
                model_data_bytes=n * 16, machine_ram_bytes=ram, device_memory=args.device_memory,
                host_memory=args.host_memory, chunk_size=engine.layout.chunk_size,
                num_chunks=engine.layout.num_chunks, param_disk_chunks=len(engine.param_disk_chunks),
                disk_model_bytes=store.disk_model_bytes(), disk_needed_bytes=need, disk_free_bytes=free,
                setup_s=setup_s, steps=rows, peak_rss_bytes=max_rss_bytes(),
                left_in_folder=sorted(os.listdir(args.dir)))


def main(argv=None) -> int:
    p = parser(__doc__, "beyond_ram", quick="a tiny GPT and budgets of a few MiB (CI)", markdown=True)
    p.add_argument("--params", type=float, default=2.6e9, help="parameters (default 2.6e9: 41.6 GB of model data)")
    for flag, default in (("--device-memory", "3GiB (--quick: 2MiB)"), ("--host-memory", "4GiB (--quick: 3MiB)")):
        p.add_argument(flag, type=lambda v, flag=flag: parse_size(v, flag), default=None, help=f"default {default}")
    p.add_argument("--chunk-size", type=int, default=None, help="elements (default 64M; --quick 8192)")
    for flag, default in (("--seq", 64), ("--batch", 1), ("--vocab", 50304), ("--steps", 3)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--dir", default=None, help="folder for the disk tier (default: a temporary one)")
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
    print(table([(r["step"], f"{r['loss']:.4f}", f"{r['step_s']:.1f}", f"{r['forward_backward_s']:.1f}",
                  f"{r['optimizer_s']:.1f}", f"{r['disk_read_gb']:.1f}", f"{r['disk_write_gb']:.1f}",
                  format_bytes(r["peak_device_bytes"]), format_bytes(r["peak_host_bytes"])) for r in res["steps"]],
                ["step", "loss", "s", "forward+backward s", "optimizer s", "disk read GB", "disk written GB",
                 "peak device", "peak host"], markdown=args.markdown))
    print(f"{res['params'] / 1e9:.2f}B parameters, model data {format_bytes(res['model_data_bytes'])} = "
          f"{res['model_data_bytes'] / res['machine_ram_bytes']:.2f}x RAM; "
          f"peak RSS {format_bytes(res['peak_rss_bytes'])}; files left in the folder: {len(res['left_in_folder'])}")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
