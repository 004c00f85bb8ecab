"""Fine-tune a Hugging Face causal language model under a device budget smaller than the model.

    python examples/finetune_hf.py --steps 200 --out runs/ft            # train, evaluate, sample, save
    python examples/finetune_hf.py --steps 400 --out runs/ft --resume   # go on from the last checkpoint

The model is built from its config class (GPT-2 or Llama; nothing is downloaded) with a byte-level
vocabulary, so any text file is a data set: ``--text FILE``, or by default a file of the Python
standard library's sources that the script writes once. A DataLoader feeds batches of windows of the
file; a warm-up + cosine schedule drives ``engine.optimizer``; every ``--eval-every`` steps the
script evaluates held-out text and samples a continuation from the model as it trains
(``engine.materialize()``); every ``--save-every`` steps it writes a checkpoint with the
scheduler's state and the data position, from which ``--resume`` goes on exactly. Metrics go to
TensorBoard when it is installed, else to ``metrics.csv``; progress goes to the ``logging`` module
(``--log-level INFO`` shows pscompile's plan summaries too). The trained model is saved with
``save_pretrained`` at the end.

This script is its own loop on purpose: it shows what the engine offers a loop written by hand
(``engine.step``, ``engine.optimizer`` under a scheduler, ``materialize``, ``pscompile.save``
with the data position). With the Hugging Face ``Trainer``, the same run is
``pscompile.integrations.transformers.PscompileTrainer`` in place of ``Trainer`` (the README's
block; docs/hugging-face.md maps every ``TrainingArguments`` field).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import logging
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

import pscompile
from pscompile.cli.data import fallback_text, stdlib_sources
from pscompile.units import format_bytes

log = logging.getLogger("finetune")


# ------------------------------------------------------------------------------ data
class ByteWindows(Dataset):
    """Consecutive windows of ``seq_len`` bytes of one part of a text file (a byte is a token)."""

    def __init__(self, path: Path, seq_len: int, part: str, val_fraction: float = 0.05):
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        cut = int(len(data) * (1 - val_fraction))
        self.data, self.seq_len = (data[:cut] if part == "train" else data[cut:]), seq_len
        if len(self) == 0:
            raise ValueError(f"{path}: too little text for {part} windows of {seq_len} bytes")

    def __len__(self) -> int:
        return len(self.data) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * self.seq_len:(i + 1) * self.seq_len].long()


def collate(windows: list[torch.Tensor]) -> dict:
    ids = torch.stack(windows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def train_batches(data: ByteWindows, batch_size: int, seed: int, start: int):
    """Batch ``start`` onwards of an endless, reshuffled-every-epoch stream: epoch ``e`` is shuffled
    with seed ``seed + e``, so a resumed run sees exactly the batches the first run would have."""
    per_epoch = len(data) // batch_size
    epoch, skip = divmod(start, per_epoch)
    while True:
        order = RandomSampler(data, generator=torch.Generator().manual_seed(seed + epoch))
        loader = DataLoader(data, batch_size, sampler=order, drop_last=True, collate_fn=collate)
        yield from itertools.islice(loader, skip, None)
        epoch, skip = epoch + 1, 0


def text_file(args) -> Path:
    if args.text is not None:
        return Path(args.text)
    path = args.out / "corpus.txt"
    if not path.exists():
        path.write_bytes(stdlib_sources(args.corpus_bytes) or fallback_text())
    return path


# ------------------------------------------------------------------------------ model
def build_model(args) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(args.seed)
    common = dict(vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    if args.arch == "llama":
        config = tf.LlamaConfig(hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                                num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                                num_key_value_heads=args.n_head, max_position_embeddings=args.seq_len, **common)
        return tf.LlamaForCausalLM(config)
    config = tf.GPT2Config(n_embd=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                           n_positions=args.seq_len, **common)
    return tf.GPT2LMHeadModel(config)


def schedule(optimizer, warmup: int, steps: int, peak: float):
    """Linear warm-up over ``warmup`` steps, then cosine decay to a tenth of ``peak`` over the rest."""
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps - warmup), eta_min=peak / 10)],
        milestones=[warmup])


# ------------------------------------------------------------------------------ metrics
class Metrics:
    """TensorBoard when installed, else one CSV row per logged value."""

    def __init__(self, folder: Path, force_csv: bool):
        self.writer = None
        if not force_csv:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(str(folder / "tensorboard"))
            except ImportError:
                pass
        self.csv = None if self.writer is not None else open(folder / "metrics.csv", "a", newline="")

    def log(self, step: int, **values: float) -> None:
        for name, value in values.items():
            if self.writer is not None:
                self.writer.add_scalar(name, value, step)
            else:
                csv.writer(self.csv).writerow([step, name, repr(value)])
        (self.writer or self.csv).flush()

    def close(self) -> None:
        (self.writer or self.csv).close()


def sample(engine, model, prompt: bytes, n: int) -> str:
    """A greedy continuation of ``prompt`` by the model as it is now (the current fp32 weights)."""
    ids = torch.tensor([list(prompt)])
    model.eval()
    with engine.materialize():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    model.train()
    return bytes(out[0, len(prompt):].tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------ the run
def main(argv=None) -> int:
    args = parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    path = text_file(args)
    train, val = ByteWindows(path, args.seq_len, "train"), ByteWindows(path, args.seq_len, "val")
    model = build_model(args)
    val_batch = collate([val[i] for i in range(min(len(val), args.batch_size))])
    config = pscompile.Config(device=args.device, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
                              backend=args.backend, device_memory=args.device_memory)
    if config.device_memory is None:        # a device smaller than the model: 1.25x the least budget
        least = pscompile.min_device_memory(model, val_batch, config)
        config = pscompile.Config(**{**config.__dict__, "device_memory": int(least * 1.25)})
    hp = pscompile.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
                         param_groups=[{"params": lambda name, p: p.ndim < 2, "weight_decay": 0.0}])
    engine = pscompile.compile(model, optimizer=hp, config=config, loss_fn=None)     # built at the first step
    scheduler = schedule(engine.optimizer, args.warmup, args.steps, args.lr)
    ckpt, start = args.out / "checkpoint", 0
    if args.resume and ckpt.exists():
        client = pscompile.load(engine, ckpt)
        scheduler.load_state_dict(client["scheduler"])
        start = client["step"]
        log.info("resuming at step %d from %s", start, ckpt)
    params = sum(p.numel() for p in model.parameters())
    log.info("%s: %.2fM parameters, model data %s, device budget %s; %d train windows of %d bytes from %s",
             args.arch, params / 1e6, format_bytes(params * 16), format_bytes(config.device_memory), len(train),
             args.seq_len, path)
    metrics = Metrics(args.out, args.csv)
    batches = train_batches(train, args.batch_size, args.seed, start)
    t0 = time.perf_counter()
    for step in range(start + 1, min(args.steps, args.stop_after or args.steps) + 1):
        loss = engine.step(next(batches))
        lr = engine.optimizer.param_groups[-1]["lr"]
        scheduler.step()
        metrics.log(step, loss=loss, lr=lr, peak_device_bytes=engine.stats.peak_device_bytes)
        log.info("step %d/%d  loss %.4f  lr %.2e  peak %s of %s  %.2f s/step", step, args.steps, loss, lr,
                 format_bytes(engine.stats.peak_device_bytes), format_bytes(config.device_memory),
                 (time.perf_counter() - t0) / (step - start))
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            val_loss = engine.evaluate(val_batch)
            model.train()
            metrics.log(step, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
            log.info("step %d  val loss %.4f  sample: %r", step, val_loss, sample(engine, model, b"def ", 24))
        if step % args.save_every == 0 or step == args.steps:
            pscompile.save(engine, ckpt, client_state={"scheduler": scheduler.state_dict(), "step": step})
    if args.steps > start and not args.stop_after:
        final = engine.save_pretrained(args.out / "final")
        log.info("saved the trained model to %s (from_pretrained loads it)", final)
    metrics.close()
    engine.close()
    return 0


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/finetune"), help="checkpoints, metrics, the final model")
    p.add_argument("--text", help="a text file to train on (default: the Python standard library's sources)")
    p.add_argument("--corpus-bytes", type=int, default=2 << 20, help="bytes of the default corpus")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="the model family")
    p.add_argument("--d-model", type=int, default=256, help="hidden size")
    p.add_argument("--n-layer", type=int, default=4, help="layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=200, help="the last step of the run")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate and sample every this many steps")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every this many steps")
    p.add_argument("--resume", action="store_true", help="go on from --out's checkpoint if there is one")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step, as an interrupted run would (then --resume goes on)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--device-memory", default=None, help="the device budget (default: 1.25x the least)")
    p.add_argument("--backend", choices=["eager", "inductor"], default="eager", help="compiled mode's compute")
    p.add_argument("--seed", type=int, default=0, help="the model's initialisation and the data order")
    p.add_argument("--csv", action="store_true", help="write metrics.csv even if TensorBoard is installed")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
