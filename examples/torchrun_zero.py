"""Train one model over several processes, each holding 1/world of the model data (ZeRO by chunk).

    torchrun --nproc_per_node 2 examples/torchrun_zero.py --steps 20 --out runs/zero

Every rank builds the same model (same seed) and calls ``pscompile.compile`` under an initialized
process group: the engine then shards the chunks over the ranks, all-gathers each before use and
reduce-scatters its gradients. Each rank trains on its own batches (the global batch is world x
``--batch-size``), a cosine schedule drives ``engine.optimizer`` on every rank alike, and
``pscompile.save`` writes one folder that every rank contributes a file to and rank 0 commits.
On the CPU the ranks talk over gloo; with ``--device cuda`` each rank takes GPU ``LOCAL_RANK`` and
NCCL.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

import pscompile
from pscompile.cli.data import Corpus
from pscompile.models.gpt import GPT, gpt_config


def main(argv=None) -> int:
    args = parse(argv)
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)
    torch.manual_seed(0)                             # the same initial model on every rank
    model = GPT(gpt_config("gpt-tiny", n_layer=args.n_layer, d_model=args.d_model, seq_len=args.seq_len))
    config = pscompile.Config(device=device, dtype=torch.bfloat16 if cuda else torch.float32, backend="eager",
                              device_memory=args.device_memory)
    engine = pscompile.compile(model, optimizer=pscompile.AdamW(lr=args.lr, weight_decay=0.1), config=config)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=args.steps)
    corpus = Corpus.from_stdlib(max_bytes=1 << 20)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    for step in range(1, args.steps + 1):
        loss = engine.step(corpus.batch("train", args.batch_size, args.seq_len, generator=gen))
        scheduler.step()
        if rank == 0:
            print(f"step {step}/{args.steps}  loss {loss:.4f} (mean over {world} ranks)  "
                  f"peak {engine.stats.peak_device_bytes / 2**20:.2f} MiB  "
                  f"all-gathered {engine.stats.allgather_bytes / 2**20:.2f} MiB", flush=True)
    folder = pscompile.save(engine, Path(args.out) / "checkpoint", client_state={"scheduler": scheduler.state_dict()})
    if rank == 0:
        print(f"saved {folder} (one file per rank, committed by manifest.json)")
    engine.close()
    dist.destroy_process_group()
    return 0


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--n-layer", type=int, default=2, help="layers")
    p.add_argument("--d-model", type=int, default=64, help="hidden size")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-3, help="the learning rate before the cosine decay")
    p.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes GPU LOCAL_RANK)")
    p.add_argument("--device-memory", default=None, help="each rank's device budget (default: unlimited)")
    p.add_argument("--out", default="runs/zero", help="where the checkpoint folder goes")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
