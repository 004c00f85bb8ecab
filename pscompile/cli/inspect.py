"""``python -m pscompile inspect``: compile a GPT preset in compiled mode (eager backend) on one
random batch under the same kind of budget as ``train``, print the schedule's provenance header and
its first memory nodes, and save the listing, the per-node table and the memory timeline
(``pscompile.compiled.schedule``). It names the model as ``train`` does (``--model``, ``--n-layer``,
``--d-model``, ``--n-head``, ``--vocab-size``): the project's GPT only."""

from __future__ import annotations

import argparse

import torch

from pscompile.api import compile as ps_compile
from pscompile.cli.flags import check_output
from pscompile.cli.train import DTYPES, TrainSettings, add_memory_arguments, add_model_arguments, build_model
from pscompile.config import Config

_INSPECT_ROWS = 24          # memory-node rows printed (the saved table has them all)


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    add_model_arguments(p, d)
    p.add_argument("--batch-size", metavar="N", type=int, default=d.batch_size,
                   help=f"sequences per batch (default {d.batch_size})")
    p.add_argument("--seq-len", metavar="N", type=int, default=d.seq_len,
                   help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--device", metavar="DEV", default=d.device, help=f"compute device (default {d.device})")
    add_memory_arguments(p, d)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype, help=f"compute dtype (default {d.dtype})")
    p.add_argument("--seed", metavar="N", type=int, default=d.seed, help=f"seed for init and batch (default {d.seed})")
    p.add_argument("--measure", action="store_true",
                   help="run one training step first, so the schedule uses the measured non-model memory")
    p.add_argument("--out", metavar="DIR", default="pscompile-schedule",
                   help="folder for schedule.txt, schedule_table.txt, timeline.json, timeline.png "
                        "(default ./pscompile-schedule)")


def inspect_settings(args: argparse.Namespace) -> TrainSettings:
    """The flags as ``train``'s settings (validated there), compiled mode."""
    return TrainSettings(model=args.model, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                         vocab_size=args.vocab_size, batch_size=args.batch_size, seq_len=args.seq_len,
                         device=args.device, device_memory=args.device_memory, chunk_size=args.chunk_size,
                         activations=args.activations, dtype=args.dtype, mode="compiled", seed=args.seed,
                         progress=False)


def inspect_command(args: argparse.Namespace) -> int:
    """Compile a GPT preset in compiled mode (eager backend) on one random batch, print the
    schedule's header and its first memory nodes, and save the whole schedule into ``--out``."""
    check_output(args.out, "--out", folder=True)
    s = inspect_settings(args)
    model = build_model(s)
    gen = torch.Generator().manual_seed(s.seed)
    shape = (s.batch_size, s.seq_len)
    batch = (torch.randint(0, s.vocab_size, shape, generator=gen),
             torch.randint(0, s.vocab_size, shape, generator=gen))
    engine = ps_compile(model, batch, config=Config(
        mode="compiled", backend="eager", device=s.device, device_memory=s.device_memory,
        dtype=DTYPES[s.dtype], chunk_size=s.chunk_size, activations=s.activations))
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
