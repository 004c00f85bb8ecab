"""Lock-free updating against the synchronous step: the loss it reaches and the time a step takes
(docs/lock-free.md).

1. **Loss.** The default training run (``python -m pscompile train``) synchronous and with
   ``--lock-free`` at staleness 1 and 2, same seed and batches: the mean loss of the last 10 steps
   and the validation loss; and plain PyTorch on the same batches with each update one step late.
2. **Step time.** GPTs whose optimizer step is a large part of a step (a wide embedding, few
   tokens) and the default run's model, in both modes, under a budget that keeps the optimizer
   states on the host: the median step synchronous and lock-free (interleaved, ``--rounds`` rounds
   each), their ratio, and the optimizer's share of the synchronous step. Run nothing else
   meanwhile: the two threads share the machine's memory bandwidth.

    python bench/lock_free.py [--quick] [--only loss|time] [--markdown] [--out bench/results/lock_free.json]

Float32, one torch thread per engine (the update thread gets the second core) unless --threads.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

import pscompile
from harness.output import parser, table, write_json
from harness.runs import cpu_config, train
from harness.specs import gpt, token_batches
from pscompile.cli.data import Corpus
from pscompile.cli.train import TrainSettings, build_model, no_decay, run_train
from pscompile.testing import ReferenceTrainer

# (name, n_layer, d_model, vocab, seq, batch): gpt(*shape[1:5]) is the model
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


def _batches(shape, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    _, _, _, vocab, seq, batch = shape
    return token_batches(vocab, batch, seq, n)


def _time_steps(shape, mode: str, budget: int, lock_free: bool, steps: int) -> dict:
    batches = _batches(shape, steps)
    _, stats = train(pscompile.compile(gpt(*shape[1:5]), batches[0], config=cpu_config(
        mode, device_memory=budget, lock_free=lock_free)), batches)
    return dict(step_s=[s.time_s for s in stats[2:]], optimizer_s=[s.optimizer_s for s in stats[2:]],
                within_budget=all(s.peak_device_bytes <= budget for s in stats))


def time_runs(shapes, modes, steps: int, rounds: int) -> list[dict]:
    out = []
    for shape in shapes:
        params = sum(p.numel() for p in gpt(*shape[1:5]).parameters())
        for mode in modes:
            least = pscompile.min_device_memory(gpt(*shape[1:5]), _batches(shape, 1)[0], cpu_config(mode))
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
    p = parser(__doc__, "lock_free", quick="tiny settings (a smoke test)", markdown=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--only", choices=("loss", "time"), help="run one part only")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds per setting (default 3; quick 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    losses = loss_runs(6 if args.quick else 450) if args.only != "time" else []
    print(table([[r["run"], "synchronous" if not r["lock_free"] else
                  f"lock-free, staleness {r['staleness']}" if r["run"] == "pscompile" else
                  f"each update {r['staleness']} step late", r["steps"], f"{r['loss_first']:.3f}",
                  f"{r['loss_last10']:.3f}", "-" if r["val_loss"] is None else f"{r['val_loss']:.3f}",
                  f"{r['mean_step_s'] * 1000:.0f}"] for r in losses],
                ["run", "optimizer step", "steps", "first loss", "mean of last 10", "validation loss", "ms/step"],
                markdown=args.markdown))
    print()
    rounds = args.rounds or (1 if args.quick else 3)
    timing = time_runs(SHAPES_QUICK if args.quick else SHAPES_FULL, ["compiled", "hooks"],
                       steps=5 if args.quick else 12, rounds=rounds) if args.only != "loss" else []
    print(table([[r["shape"], f"{r['params'] / 1e6:.1f}M", r["mode"], f"{r['budget'] / 2**20:.1f} MiB",
                  f"{r['sync_optimizer_share']:.0%}", f"{r['sync_step_s'] * 1000:.0f}",
                  f"{r['lock_free_step_s'] * 1000:.0f}", f"{r['speedup']:.2f}x"] for r in timing],
                ["model", "params", "mode", "budget", "optimizer share (sync)", "sync ms/step", "lock-free ms/step",
                 "speed-up"], markdown=args.markdown))
    ok = all(r["within_budget"] for r in losses + timing)
    print(f"every step within its budget: {ok}")
    write_json(args.out, dict(threads=args.threads, quick=args.quick, rounds=rounds, losses=losses, timing=timing))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
