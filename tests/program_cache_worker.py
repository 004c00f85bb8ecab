"""One process of tests/test_program_store.py: the tiny GPT in compiled mode with Inductor under a
budget that evicts, its Inductor cache the folder the test names (``TORCHINDUCTOR_CACHE_DIR``).

    python program_cache_worker.py OUT [--save PATH] [--load PATH]

Trains steps 0-3 (``--load``: loads the checkpoint, then steps 2-3; ``--save``: saves it after step
1) and writes to OUT (``torch.save``): the losses, the state, each step's compiled share and
measuring flag, how many programs were compiled and how many loaded from Inductor's cache, and the
layout chosen (its chunk size and what was weighed) and whether it was taken from the layout store."""

from __future__ import annotations

import argparse
import logging

import torch

import pscompile
from conftest import make_batches, make_model


class _Programs(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or "compiled as one program" in record.getMessage():
            self.messages.append(f"{record.levelname}: {record.getMessage()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--save")
    ap.add_argument("--load")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    seen = _Programs()
    logging.getLogger("pscompile").addHandler(seen)
    logging.getLogger("pscompile").setLevel(logging.INFO)
    batches = make_batches("gpt", 4)
    cfg = pscompile.Config(mode="compiled", device="cpu", dtype=torch.float32)
    budget = int(1.15 * pscompile.min_device_memory(make_model("gpt", dropout=0.1), batches[0], cfg))
    engine = pscompile.compile(make_model("gpt", dropout=0.1), batches[0], optimizer=pscompile.AdamW(lr=1e-3),
                               config=pscompile.Config(mode="compiled", device="cpu", dtype=torch.float32,
                                                       device_memory=budget))
    steps = range(4)
    if args.load:
        pscompile.load(engine, args.load)
        steps = range(2, 4)
    losses, shares, peaks = [], [], []
    for i in steps:
        losses.append(engine.step(batches[i]))
        shares.append(engine.stats.compiled_share)
        peaks.append(engine.stats.peak_device_bytes)
        if args.save and i == 1:
            pscompile.save(engine, args.save)
    torch.save({"losses": losses, "shares": shares, "peaks": peaks, "budget": budget, "messages": seen.messages,
                "state": engine.state_dict(), "choice_hits": engine.choices_kept.hits,
                "layout": (engine.layout.chunk_size, [tuple(vars(r).values()) for r in engine.layout_choices])},
               args.out)
    engine.close()


if __name__ == "__main__":
    main()
