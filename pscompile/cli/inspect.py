"""``python -m pscompile inspect``: compile a GPT preset in compiled mode (eager backend) on one
random batch under the same kind of budget as ``train``, print the schedule's provenance header and
its first memory nodes, and save the listing, the per-node table and the memory timeline
(``pscompile.compiled.schedule``)."""

from __future__ import annotations

import argparse

import torch

from pscompile.api import compile as ps_compile
from pscompile.cli.data import Corpus
from pscompile.cli.flags import check_output
from pscompile.cli.train import DTYPES, TrainSettings, parse_chunk_size, size_or_none, build_model
from pscompile.config import Config

_INSPECT_ROWS = 24          # memory-node rows printed (the saved table has them all)


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    p.add_argument("--model", metavar="NAME", default=d.model,
                   help=f"GPT preset name, e.g. gpt-tiny, gpt-small-test, gpt-mini, gpt2 (default {d.model})")
    p.add_argument("--batch-size", metavar="N", type=int, default=d.batch_size,
                   help=f"sequences per batch (default {d.batch_size})")
    p.add_argument("--seq-len", metavar="N", type=int, default=d.seq_len,
                   help=f"bytes per sequence (default {d.seq_len})")
    p.add_argument("--device", metavar="DEV", default=d.device, help=f"compute device (default {d.device})")
    p.add_argument("--device-memory", metavar="SIZE", type=size_or_none, default=d.device_memory,
                   help=f"budget for everything on the device, e.g. 64MiB, or 'none' (default {d.device_memory}, "
                        "as for train)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype, help=f"compute dtype (default {d.dtype})")
    p.add_argument("--chunk-size", metavar="N|auto", type=parse_chunk_size, default=d.chunk_size,
                   help="elements per chunk, or 'auto' (default auto)")
    p.add_argument("--seed", metavar="N", type=int, default=d.seed, help=f"seed for init and batch (default {d.seed})")
    p.add_argument("--measure", action="store_true",
                   help="run one training step first, so the schedule uses the measured non-model memory")
    p.add_argument("--out", metavar="DIR", default="pscompile-schedule",
                   help="folder for schedule.txt, schedule_table.txt, timeline.json, timeline.png "
                        "(default ./pscompile-schedule)")


def inspect_command(args: argparse.Namespace) -> int:
    check_output(args.out, "--out", folder=True)
    """Compile a GPT preset in compiled mode (eager backend) on one random batch, print the
    schedule's header and its first memory nodes, and save the whole schedule into ``--out``."""

    s = TrainSettings(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=args.device,
                      device_memory=args.device_memory, chunk_size=args.chunk_size, dtype=args.dtype,
                      mode="compiled", seed=args.seed, progress=False)
    model = build_model(s)
    gen = torch.Generator().manual_seed(s.seed)
    shape = (s.batch_size, s.seq_len)
    batch = (torch.randint(0, Corpus.vocab_size, shape, generator=gen),
             torch.randint(0, Corpus.vocab_size, shape, generator=gen))
    engine = ps_compile(model, batch, config=Config(
        mode="compiled", backend="eager", device=s.device, device_memory=s.device_memory,
        dtype=DTYPES[s.dtype], chunk_size=s.chunk_size))
    try:
        if args.measure:
            engine.step(batch)
        schedule = engine.schedule
        print(schedule.header())
        memory = schedule.memory_rows()
        print(f"\nmemory nodes ({min(len(memory), _INSPECT_ROWS)} of {len(memory)} shown; all in schedule_table.txt):")
        print(schedule.table(memory_only=True, limit=_INSPECT_ROWS))
        written = schedule.save(args.out)
    finally:
        engine.close()
    print("\nwritten:")
    for path in written:
        print(f"  {path}")
    return 0
