"""Lock-free updating against the synchronous step: the loss it reaches and the time a step takes.

1. **Loss.** The default training run (``python -m pscompile train``: the byte-level GPT on the
   built-in corpus, under its 44 MiB device budget) with the synchronous step and with
   ``--lock-free`` at staleness 1 and 2, same seed and batches: the mean loss of the last 10
   steps and the validation loss after the last step; and plain PyTorch training the same model
   on the same batches with each update delayed one step (the algorithm, without pscompile).
2. **Step time.** GPTs whose optimizer step is a large part of a step (many parameters, few
   tokens per step: a wide embedding, one sequence) and the default run's model for contrast, in
   both modes, under a budget that keeps the optimizer states on the host: the median step time
   synchronous and lock-free (interleaved in one process, two rounds each), their ratio, and the
   share of the synchronous step the optimizer takes. Run nothing else meanwhile: the two threads
   share the machine's memory bandwidth, and so would anything else.

    python bench/lock_free.py [--quick] [--only loss|time] [--markdown] [--out bench/results/lock_free.json]

Float32, one torch thread per engine (the update thread gets the second core) unless --threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import pscompile
from pscompile.cli.data import Corpus
from pscompile.cli.train import TrainSettings, build_model, no_decay, run_train
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "lock_free.json"
# (name, n_layer, d_model, vocab, seq, batch)
SHAPES_FULL = [("L2 d512 v16384, 1 x 32 tokens", 2, 512, 16384, 32, 1),
               ("L4 d512 v256, 2 x 32 tokens", 4, 512, 256, 32, 2),
               ("L2 d128 v256, 16 x 128 tokens (the default run)", 2, 128, 256, 128, 16)]
SHAPES_QUICK = [("L2 d128 v2048, 1 x 16 tokens", 2, 128, 2048, 16, 1)]


def loss_runs(steps: int) -> list[dict]:
    """The default training run, synchronous and lock-free, and plain PyTorch applying each
    step's AdamW to the gradients of the step before (the same algorithm without pscompile)."""
    base = TrainSettings(steps=steps, progress=False, log_every=0)
    out = []
    for lock_free, staleness in ((False, 1), (True, 1), (True, 2)):
        r = run_train(dataclasses.replace(base, lock_free=lock_free, staleness=staleness))
        out.append(dict(run="pscompile", lock_free=lock_free, staleness=staleness if lock_free else 0, steps=steps,
                        loss_first=r["loss_first"], loss_last10=r["loss_last10_mean"],
                        val_loss=r["val_losses"][-1]["loss"] if r["val_losses"] else None,
                        mean_step_s=r["mean_step_s"], within_budget=r["within_budget"]))
    # the CLI's batches and optimizer, in plain PyTorch (float32: no master copy)
    corpus, gen = Corpus.from_stdlib(), torch.Generator().manual_seed(base.seed)
    ref = ReferenceTrainer(build_model(base), dtype=torch.float32, staleness=1, optimizer=pscompile.AdamW(
        lr=base.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
        param_groups=[{"params": no_decay, "weight_decay": 0.0}]))
    t0 = time.perf_counter()
    losses = [ref.step(corpus.batch("train", base.batch_size, base.seq_len, gen)) for _ in range(steps)]
    out.append(dict(run="plain PyTorch", lock_free=True, staleness=1, steps=steps, loss_first=losses[0],
                    loss_last10=statistics.fmean(losses[-10:]), val_loss=None,
                    mean_step_s=(time.perf_counter() - t0) / steps, within_budget=True))
    return out


def _model(shape) -> GPT:
    _, n_layer, d, vocab, seq, _ = shape
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, d // 64), d_model=d, vocab_size=vocab, seq_len=seq))


def _batches(shape, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, _, _, vocab, seq, batch = shape
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        idx = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((idx, torch.roll(idx, -1, dims=1)))
    return out


def _time_steps(shape, mode: str, budget: int, lock_free: bool, steps: int) -> dict:
    batches = _batches(shape, steps)
    engine = pscompile.compile(_model(shape), batches[0], config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget, lock_free=lock_free))
    stats = []
    try:
        for b in batches:
            engine.step(b)
            stats.append(engine.stats)
    finally:
        engine.close()
    steady = stats[2:]
    return dict(step_s=[s.time_s for s in steady], optimizer_s=[s.optimizer_s for s in steady],
                within_budget=all(s.peak_device_bytes <= budget for s in stats))


def time_runs(shapes, modes, steps: int, rounds: int) -> list[dict]:
    out = []
    for shape in shapes:
        params = sum(p.numel() for p in _model(shape).parameters())
        for mode in modes:
            cfg = pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32)
            least = pscompile.min_device_memory(_model(shape), _batches(shape, 1)[0], cfg)
            # the compute-dtype chunks fit twice over; the optimizer states (12 B/param) do not
            budget = max(int(least * 1.5), min(params * 8, least * 4))
            runs = {False: [], True: []}
            for _ in range(rounds):                   # interleaved: drift hits both alike
                for lf in (False, True):
                    runs[lf].append(_time_steps(shape, mode, budget, lf, steps))
            med = {lf: statistics.median(x for r in rs for x in r["step_s"]) for lf, rs in runs.items()}
            opt = statistics.median(x for r in runs[False] for x in r["optimizer_s"])
            out.append(dict(shape=shape[0], params=params, tokens=shape[4] * shape[5], mode=mode, budget=budget,
                            sync_step_s=med[False], lock_free_step_s=med[True], speedup=med[False] / med[True],
                            sync_optimizer_share=opt / med[False],
                            within_budget=all(r["within_budget"] for rs in runs.values() for r in rs)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny settings (a smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--only", choices=("loss", "time"), help="run one part only")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per setting (default 3; quick 1)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    fmt = "github" if args.markdown else "simple"

    losses = loss_runs(6 if args.quick else 450) if args.only != "time" else []
    print(tabulate([[r["run"], "synchronous" if not r["lock_free"] else
                     f"lock-free, staleness {r['staleness']}" if r["run"] == "pscompile" else
                     f"each update {r['staleness']} step late",
                     r["steps"],
                     f"{r['loss_first']:.3f}", f"{r['loss_last10']:.3f}",
                     "-" if r["val_loss"] is None else f"{r['val_loss']:.3f}", f"{r['mean_step_s'] * 1000:.0f}"]
                    for r in losses],
                   headers=["run", "optimizer step", "steps", "first loss", "mean of last 10", "validation loss",
                            "ms/step"], tablefmt=fmt))
    print()
    rounds = args.rounds or (1 if args.quick else 3)
    timing = time_runs(SHAPES_QUICK if args.quick else SHAPES_FULL, ["compiled", "hooks"],
                       steps=5 if args.quick else 12, rounds=rounds) if args.only != "loss" else []
    print(tabulate([[r["shape"], f"{r['params'] / 1e6:.1f}M", r["mode"], f"{r['budget'] / 2**20:.1f} MiB",
                     f"{r['sync_optimizer_share']:.0%}", f"{r['sync_step_s'] * 1000:.0f}",
                     f"{r['lock_free_step_s'] * 1000:.0f}", f"{r['speedup']:.2f}x"] for r in timing],
                   headers=["model", "params", "mode", "budget", "optimizer share (sync)", "sync ms/step",
                            "lock-free ms/step", "speed-up"], tablefmt=fmt))
    ok = all(r["within_budget"] for r in losses + timing)
    print(f"every step within its budget: {ok}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(threads=args.threads, quick=args.quick, rounds=rounds, losses=losses, timing=timing),
                                   indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
