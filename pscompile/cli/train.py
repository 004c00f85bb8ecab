"""``python -m pscompile train``: a real training run under a device budget.

It trains a GPT preset on a byte-level corpus made from the Python standard library's own sources
(``pscompile.cli.data``) under a device-memory budget, shows progress, and prints a summary table
(optionally written as JSON). The defaults are a real ~1-minute run on a 2-core CPU
(gpt-small-test, 450 steps of 16 x 128 bytes, float32; loss ~5.3 -> ~2.1) under a 44 MiB device
budget: the run needs ~48 MiB to keep everything resident (~41 MiB of it activations), so only
part of the 6.9 MiB of model data fits next to the activations and most of the 9 chunks are
evicted and fetched back every step (tests/test_cli_docs.py checks this, and docs/cli.md's sample
of the summary). float32 is the default because on CPUs without native bf16 matmuls (AVX2 only)
bfloat16 backward is 10-100x slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tabulate import tabulate

from pscompile.api import compile as ps_compile
from pscompile.config import AdamW, Config
from pscompile.cli.data import VOCAB_SIZE, Corpus
from pscompile.cli.flags import check_output, size_flag
from pscompile.dist.launch import init_from_env
from pscompile.checkpoint.files import write_atomic
from pscompile.stats import StepStats
from pscompile.units import format_bytes
from pscompile.kinds import Backend, Mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATIONS = ("auto", "keep", "recompute", "offload")


# ==================================================================== train: settings
@dataclass(frozen=True)
class TrainSettings:
    """Everything ``train`` runs with; built from the flags and validated here."""

    model: str = "gpt-small-test"      # GPT preset name (pscompile.models.gpt.GPT_PRESETS)
    n_layer: int | None = None         # override the preset's number of blocks
    d_model: int | None = None         # override the preset's hidden size
    n_head: int | None = None          # override the preset's attention heads
    vocab_size: int = VOCAB_SIZE       # embedding rows; the corpus is bytes (ids 0-255), so at least 256
    steps: int = 450                   # optimizer steps
    batch_size: int = 16               # sequences per step
    seq_len: int = 128                 # bytes per sequence (also the model's position table)
    lr: float = 1e-3                   # AdamW learning rate (constant)
    device: str = "cpu"                # compute device
    device_memory: str | None = "44MiB"  # budget for everything on the device; None = no limit
    host_memory: str | None = None     # budget for chunks in host RAM; None = 80% of available
    chunk_size: int | str = "auto"     # elements per chunk or "auto"
    dtype: str = "float32"             # compute dtype name (see DTYPES)
    mode: str = "compiled"             # "compiled" (the planned schedule) | "hooks" (PatrickStar's runtime)
    backend: str = "eager"             # compiled mode: "eager" | "inductor" (cold compile 20-45 s on 2 cores)
    activations: str = "auto"          # compiled mode: "auto" | "keep" | "recompute" | "offload" (Config.activations)
    lock_free: bool = False            # the optimizer on its own host thread (Config.lock_free)
    staleness: int = 1                 # lock-free: steps an update may lag (Config.staleness)
    seed: int = 0                      # model init and batch sampling
    grad_accum: int = 1                # micro-batches per step (batch_size is split into them)
    eval_every: int = 0                # validation loss every N steps (0: only after the last step)
    eval_batches: int = 4              # validation batches (of batch_size) per evaluation; 0 = none
    log_every: int = 50                # plain progress line every N steps (0 = never)
    json_path: str | None = None       # write the summary here as JSON
    progress: bool = True              # tqdm bar when tqdm is importable and stderr is a terminal

    def __post_init__(self):
        for flag, value, low in (("--steps", self.steps, 1), ("--batch-size", self.batch_size, 1),
                                 ("--seq-len", self.seq_len, 2), ("--log-every", self.log_every, 0),
                                 ("--grad-accum", self.grad_accum, 1), ("--eval-every", self.eval_every, 0),
                                 ("--eval-batches", self.eval_batches, 0), ("--staleness", self.staleness, 1)):
            if value < low:
                raise ValueError(f"{flag}={value} must be >= {low}")
        for flag, value in (("--n-layer", self.n_layer), ("--d-model", self.d_model), ("--n-head", self.n_head)):
            if value is not None and value < 1:
                raise ValueError(f"{flag}={value} must be a positive int (or leave it out to keep the preset's)")
        if self.vocab_size < VOCAB_SIZE:
            raise ValueError(f"--vocab-size={self.vocab_size} must be >= {VOCAB_SIZE}: the tokens are bytes "
                             f"(ids 0-{VOCAB_SIZE - 1}); a larger vocabulary adds embedding rows no byte uses")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be > 0, e.g. 1e-3")
        if self.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(self.json_path))):
            raise ValueError(f"--json={self.json_path}: its folder does not exist; create it or give another path")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size={self.batch_size} is not divisible by --grad-accum={self.grad_accum}; "
                             "each step splits its batch into that many equal micro-batches")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype} is not supported; use one of {', '.join(DTYPES)}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def parse_chunk_size(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of elements or 'auto'") from None


def add_model_arguments(m: argparse._ActionsContainer, d: TrainSettings) -> None:
    """The GPT flags ``train`` and ``inspect`` share: a preset, its shape overridden."""
    m.add_argument("--model", metavar="NAME", default=d.model,
                   help=f"GPT preset name, e.g. gpt-tiny, gpt-small-test, gpt-mini, gpt2 (default {d.model}); "
                        "the project's GPT only (pscompile.models.gpt): for another model use the Python API")
    m.add_argument("--n-layer", metavar="N", type=int, help="override the preset's number of blocks")
    m.add_argument("--d-model", metavar="N", type=int, help="override the preset's hidden size")
    m.add_argument("--n-head", metavar="N", type=int,
                   help="override the preset's attention heads (must divide d_model)")
    m.add_argument("--vocab-size", metavar="N", type=int, default=d.vocab_size,
                   help=f"embedding rows (default {d.vocab_size}: the bytes; a larger one adds rows no byte uses)")


def add_memory_arguments(e: argparse._ActionsContainer, d: TrainSettings) -> None:
    """The budget flags ``train`` and ``inspect`` share (sizes: GB = 10^9 bytes, GiB = 2^30)."""
    e.add_argument("--device-memory", metavar="SIZE", type=size_flag("--device-memory", none_ok=True),
                   default=d.device_memory,
                   help=f"budget for everything on the device, e.g. 64MiB (2^20 bytes each) or 64MB (10^6), or "
                        f"'none' (default {d.device_memory}: below what the default run needs, so chunks are "
                        "evicted every step; the error names the minimum when a budget is too small)")
    e.add_argument("--chunk-size", metavar="N|auto", type=parse_chunk_size, default=d.chunk_size,
                   help="elements per chunk, or 'auto' (default auto)")
    e.add_argument("--activations", choices=ACTIVATIONS, default=d.activations,
                   help="compiled mode: take saved activations off the device when the budget needs it, "
                        "recomputed or offloaded to the host, whichever costs less here (auto), never (keep), "
                        f"all recomputed (recompute) or all offloaded (offload) (default {d.activations})")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    add_model_arguments(p.add_argument_group("model (the project's byte-level GPT)"), d)
    t = p.add_argument_group("training")
    t.add_argument("--steps", metavar="N", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    t.add_argument("--batch-size", metavar="N", type=int, default=d.batch_size,
                   help=f"sequences per step (default {d.batch_size})")
    t.add_argument("--seq-len", metavar="N", type=int, default=d.seq_len,
                   help=f"bytes per sequence (default {d.seq_len})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr})")
    t.add_argument("--grad-accum", metavar="K", type=int, default=d.grad_accum,
                   help="split each step's batch into K micro-batches whose gradients accumulate into one "
                        f"update (default {d.grad_accum})")
    t.add_argument("--eval-every", metavar="N", type=int, default=d.eval_every,
                   help="validation loss every N steps (default: after the last step only)")
    t.add_argument("--eval-batches", metavar="N", type=int, default=d.eval_batches,
                   help=f"validation batches per evaluation, 0 for none (default {d.eval_batches})")
    t.add_argument("--seed", metavar="N", type=int, default=d.seed,
                   help=f"seed for init and batches (default {d.seed})")
    e = p.add_argument_group("memory and engine")
    e.add_argument("--device", metavar="DEV", default=d.device,
                   help=f"compute device: cpu, cuda, cuda:N (default {d.device})")
    add_memory_arguments(e, d)
    e.add_argument("--host-memory", metavar="SIZE", type=size_flag("--host-memory", none_ok=True), default=None,
                   help="budget for chunks in host RAM, e.g. 2GiB or 2GB (default: 80%% of available RAM)")
    e.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype,
                   help="compute dtype (default float32: on CPUs without native bf16 matmuls "
                        "bfloat16 backward is 10-100x slower)")
    e.add_argument("--mode", choices=("hooks", "compiled"), default=d.mode, help=f"engine (default {d.mode})")
    e.add_argument("--backend", choices=("inductor", "eager"), default=d.backend,
                   help=f"compiled mode: compute regions eagerly or compiled by Inductor (default {d.backend}: "
                        "Inductor's cold compile, 20-45 s on a 2-core CPU, would not fit the one-minute demo)")
    e.add_argument("--lock-free", action="store_true",
                   help="run the optimizer on its own host thread while the next steps' forward and backward "
                        "run (ANGEL-PTM's lock-free updating); step t trains on weights missing the last "
                        "--staleness updates")
    e.add_argument("--staleness", metavar="S", type=int, default=d.staleness,
                   help=f"with --lock-free: how many steps an update may lag (default {d.staleness})")
    o = p.add_argument_group("output")
    o.add_argument("--log-every", metavar="N", type=int, default=d.log_every,
                   help=f"print a progress line every N steps when no bar is shown (default {d.log_every}; 0 = never)")
    o.add_argument("--json", dest="json_path", metavar="PATH", help="write the summary as JSON to PATH")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no tqdm bar (plain lines every --log-every steps instead)")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    names = {f.name for f in fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in vars(args).items() if k in names})


# ==================================================================== train: the run
def build_model(s: TrainSettings) -> torch.nn.Module:
    """The GPT preset with the flag overrides, ``vocab_size`` rows and ``seq_len`` positions."""
    from pscompile.models.gpt import GPT, gpt_config

    overrides = {k: v for k, v in (("n_layer", s.n_layer), ("d_model", s.d_model), ("n_head", s.n_head))
                 if v is not None}
    cfg = gpt_config(s.model, vocab_size=s.vocab_size, seq_len=s.seq_len, **overrides)
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"--n-head={cfg.n_head} must divide --d-model={cfg.d_model}; "
                         f"try --n-head {next(h for h in (8, 4, 2, 1) if cfg.d_model % h == 0)}")
    torch.manual_seed(s.seed)
    return GPT(cfg)


class _Progress:
    """A tqdm bar when possible, else a plain line every ``log_every`` steps."""

    def __init__(self, s: TrainSettings):
        self.total, self.log_every, self.bar = s.steps, s.log_every, None
        if s.progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=s.steps, desc="train", unit="step", dynamic_ncols=True)

    def update(self, step: int, stats: StepStats, tokens_per_s: float) -> None:
        text = (f"loss {stats.loss:.3f} | {tokens_per_s:,.0f} tok/s | "
                f"moved {format_bytes(stats.bytes_moved)} | evicted {stats.num_evictions}")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif self.log_every and (step % self.log_every == 0 or step in (1, self.total)):
            print(f"step {step:>{len(str(self.total))}}/{self.total} | {text}", flush=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.log_every:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norms train without weight decay, as GPT-2 and BERT training scripts do."""
    return param.ndim < 2


def run_train(s: TrainSettings, *, rank: int = 0, world: int = 1) -> dict:
    """Train as ``s`` says and return the summary (a JSON-ready dict). Under ``torchrun`` (``world``
    ranks, ZeRO by chunk) every rank draws the same global batch and trains on its share of the
    rows, as with DDP; only rank 0 shows progress."""
    if s.batch_size % (world * s.grad_accum):
        raise ValueError(f"--batch-size={s.batch_size} is the global batch: it must split into {world} ranks x "
                         f"--grad-accum={s.grad_accum} equal micro-batches")
    t0 = time.perf_counter()
    model = build_model(s)  # first: a bad preset name fails before any work
    cfg = model.config
    t_model = time.perf_counter()
    corpus = Corpus.from_stdlib()
    t_data = time.perf_counter()
    gen = torch.Generator().manual_seed(s.seed)
    val_gen = torch.Generator().manual_seed(s.seed + 1)
    val = [piece for _ in range(s.eval_batches)        # held-out batches, in micro-batch pieces
           for piece in _pieces(_share(corpus.batch("val", s.batch_size, s.seq_len, val_gen), rank, world),
                                s.grad_accum)]
    batch = _share(corpus.batch("train", s.batch_size, s.seq_len, gen), rank, world)
    engine = ps_compile(
        model, batch,
        optimizer=AdamW(lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
                        param_groups=[{"params": no_decay, "weight_decay": 0.0}]),
        config=Config(mode=s.mode, backend=s.backend, device=s.device, device_memory=s.device_memory, host_memory=s.host_memory,
                      dtype=DTYPES[s.dtype], chunk_size=s.chunk_size,
                      activations=s.activations if s.mode == Mode.COMPILED else "auto", lock_free=s.lock_free,
                      staleness=s.staleness))
    t_compile = time.perf_counter()
    history: list[StepStats] = []
    evals: list[tuple[int, float]] = []           # (step, mean validation loss)
    progress = _Progress(s if rank == 0 else dataclasses.replace(s, progress=False, log_every=0))
    if world > 1:
        progress.note(f"ZeRO: {world} ranks, each owns {engine.layout.num_chunks} shards of "
                      f"{engine.layout.chunk_size // world:,} elements; progress from rank 0")
    if s.mode == Mode.COMPILED:                      # the plan, before anything runs
        progress.note(schedule_summary(engine, s))
    try:
        for step in range(1, s.steps + 1):
            if step > 1:
                batch = _share(corpus.batch("train", s.batch_size, s.seq_len, gen), rank, world)
            engine.step(batch if s.grad_accum == 1 else _pieces(batch, s.grad_accum))
            history.append(engine.stats)
            progress.update(step, engine.stats, s.tokens_per_step / engine.stats.time_s)
            if val and (step == s.steps or (s.eval_every and step % s.eval_every == 0)):
                evals.append((step, statistics.fmean(engine.evaluate(b) for b in val)))
                progress.note(f"step {step}: validation loss {evals[-1][1]:.4f}")
    finally:
        progress.close()
        engine.close()      # hooks off; the model gets its (trained) parameters back
    t_end = time.perf_counter()
    summary = _summarise(s, cfg, corpus, engine, history,
                         setup_s=t_compile - t0, data_s=t_data - t_model, train_s=t_end - t_compile)
    summary["val_losses"] = [{"step": st, "loss": v} for st, v in evals]
    summary["world_size"] = world
    summary["dist_backend"] = torch.distributed.get_backend() if world > 1 else None
    return summary


def _share(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch (all of it on one process)."""
    return batch if world == 1 else tuple(t.chunk(world)[rank].contiguous() for t in batch)


def schedule_summary(engine, s: TrainSettings) -> str:
    """The compiled schedule's provenance header (passes, budget, planned traffic), and what the
    backend means; ``python -m pscompile inspect`` prints and saves the whole schedule."""
    note = ("# backend eager: the schedule's regions between memory nodes run as eager graph code; --backend "
            "inductor compiles the whole schedule as one program, memory nodes inside (cold compile 20-45 s here)"
            if s.backend == Backend.EAGER else
            "# backend inductor: the first step measures node by node, then the whole schedule is compiled as "
            "one program, memory nodes inside (cold compile 20-45 s here)")
    return engine.schedule.header() + "\n" + note


def _pieces(batch: tuple[torch.Tensor, torch.Tensor], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batch`` split into ``k`` equal micro-batches (gradient accumulation, and evaluation
    under the same device memory)."""
    return [tuple(t.contiguous() for t in piece) for piece in zip(*(t.chunk(k) for t in batch))]


def seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux /proc; None elsewhere): includes imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _summarise(s: TrainSettings, cfg, corpus: Corpus, engine, history: list[StepStats], *,
               setup_s: float, data_s: float, train_s: float) -> dict:
    steady = history[1:] or history         # step 1 also pays the first fetch of every chunk
    mean = lambda key: statistics.fmean(getattr(h, key) for h in steady)  # noqa: E731
    budget = engine.budget
    peak = max(h.peak_device_bytes for h in history)
    last_k = history[-min(10, len(history)):]
    return {
        "settings": asdict(s),
        "model": {"preset": s.model, "params": engine.layout.total_numel, "n_layer": cfg.n_layer,
                  "d_model": cfg.d_model, "n_head": cfg.n_head, "vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len},
        "corpus": {"source": corpus.source, "train_bytes": len(corpus.train), "val_bytes": len(corpus.val)},
        "chunk_size": engine.layout.chunk_size,
        "num_chunks": engine.layout.num_chunks,
        "utilisation": engine.layout.utilisation,
        "budget_bytes": budget,
        "steps": len(history),
        "tokens_per_step": s.tokens_per_step,
        "loss_first": history[0].loss,
        "loss_last": history[-1].loss,
        "loss_last10_mean": statistics.fmean(h.loss for h in last_k),
        "losses": [h.loss for h in history],
        "tokens_per_s": statistics.median(s.tokens_per_step / h.time_s for h in steady),
        "mean_step_s": mean("time_s"),
        "peak_device_bytes": peak,
        "peak_device_model_bytes": max(h.peak_device_model_bytes for h in history),
        "peak_nonmodel_bytes": max(h.peak_nonmodel_bytes for h in history),
        "within_budget": budget is None or peak <= budget,
        "h2d_bytes_per_step": mean("h2d_bytes"),
        "d2h_bytes_per_step": mean("d2h_bytes"),
        "fetches_per_step": mean("num_fetches"),
        "allgather_bytes_per_step": mean("allgather_bytes"),
        "reduce_scatter_bytes_per_step": mean("reduce_scatter_bytes"),
        "rank_model_bytes": sum(engine.model_data().values()),
        "model_data_device_bytes": engine.model_data()["device"],
        "model_data_host_bytes": engine.model_data()["host"],
        "activations": _activations(engine),
        "evictions_per_step": mean("num_evictions"),
        "per_step": {"fetches": [h.num_fetches for h in history], "evictions": [h.num_evictions for h in history],
                     "h2d_bytes": [h.h2d_bytes for h in history], "d2h_bytes": [h.d2h_bytes for h in history]},
        "skipped_steps": sum(h.skipped for h in history),
        "setup_s": setup_s,
        "corpus_s": data_s,
        "train_s": train_s,
        "process_s": seconds_since_process_start(),
    }


def _activations(engine) -> str:
    """What the engine does with saved activations (compiled mode plans it; hooks mode keeps what
    the model's autograd keeps)."""
    plan = getattr(engine, "schedule", None)
    plan = plan.scheduled.activations if plan is not None else None
    return plan.describe() if plan is not None else "kept as the model's autograd keeps them (hooks mode)"


def summary_table(r: dict) -> str:
    """The summary as a two-column table."""
    m, b = r["model"], r["budget_bytes"]
    mib = format_bytes
    peak_ok = "OK" if r["within_budget"] else "OVER BUDGET"
    rows = [
        ("model", f"{m['preset']}: {m['params']:,} params, {m['n_layer']} layers, d_model {m['d_model']}, "
                  f"{m['n_head']} heads, vocab {m['vocab_size']}, seq {m['seq_len']}"),
        ("data", f"{r['corpus']['source']} bytes: {r['corpus']['train_bytes']:,} train / "
                 f"{r['corpus']['val_bytes']:,} val"),
        ("engine", f"{r['settings']['mode']}" + (f" ({r['settings']['backend']} backend)" if r['settings']['mode'] == Mode.COMPILED
                                                   else "") + f" on {r['settings']['device']}, {r['settings']['dtype']}"),
        ("chunks", f"{r['num_chunks']} x {r['chunk_size']:,} elements ({r['utilisation']:.1%} utilised)"),
        ("device budget", "none" if b is None else f"{mib(b)} ({b:,} bytes)"),
        ("model data", f"device {mib(r['model_data_device_bytes'])} (chunks living there), host "
                       f"{mib(r['model_data_host_bytes'])}"),
        ("activations", r["activations"]),
        ("steps", f"{r['steps']} x {r['tokens_per_step']:,} tokens"),
        ("loss first / last", f"{r['loss_first']:.3f} / {r['loss_last']:.3f} "
                              f"(mean of last {min(10, r['steps'])}: {r['loss_last10_mean']:.3f})"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f} (median, steps after the first)"),
        ("step time", f"{r['mean_step_s']:.3f} s mean"),
        ("peak device", f"{mib(r['peak_device_bytes'])}" + ("" if b is None else f" <= {mib(b)} {peak_ok}")),
        ("peak model / non-model", f"{mib(r['peak_device_model_bytes'])} / {mib(r['peak_nonmodel_bytes'])}"),
        ("moved per step", f"h2d {mib(r['h2d_bytes_per_step'])}, d2h {mib(r['d2h_bytes_per_step'])}"),
        ("fetches / evictions per step", f"{r['fetches_per_step']:.1f} / {r['evictions_per_step']:.1f}"),
        ("time", f"setup {r['setup_s']:.1f} s (corpus {r['corpus_s']:.1f} s), train {r['train_s']:.1f} s"
                 + ("" if r["process_s"] is None else f", {r['process_s']:.1f} s since process start")),
    ]
    def insert_after(label: str, row: tuple[str, str]) -> None:
        rows.insert(next(i for i, (name, _) in enumerate(rows) if name == label) + 1, row)

    if r.get("val_losses"):
        v = r["val_losses"]
        insert_after("loss first / last", ("validation loss", f"{v[-1]['loss']:.3f} after step {v[-1]['step']} "
                                           f"({r['settings']['eval_batches']} held-out batches, evaluate())"))
    if r["settings"].get("lock_free"):
        insert_after("engine", ("optimizer", f"lock-free: on its own thread, updates lag "
                                             f"{r['settings']['staleness']} step(s)"))
    if r["settings"]["grad_accum"] > 1:
        insert_after("steps", ("gradient accumulation", f"{r['settings']['grad_accum']} micro-batches of "
                                                        f"{r['settings']['batch_size'] // r['settings']['grad_accum']} "
                                                        "per step"))
    if r.get("world_size", 1) > 1:
        i = next(i for i, (name, _) in enumerate(rows) if name == "chunks")
        rows[i] = ("chunks", f"{r['num_chunks']} groups x {r['chunk_size']:,} elements ({r['utilisation']:.1%} "
                             f"utilised), each {r['world_size']} chunks of {r['chunk_size'] // r['world_size']:,}, "
                             "one per rank")
        insert_after("chunks", ("ZeRO ranks", f"{r['world_size']} ({r['dist_backend']}), model data per rank "
                                              f"{mib(r['rank_model_bytes'])}; "
                                              f"per step all-gathered {mib(r['allgather_bytes_per_step'])}, "
                                              f"reduce-scattered {mib(r['reduce_scatter_bytes_per_step'])} (rank 0)"))
    if r["skipped_steps"]:
        rows.append(("skipped steps (fp16 overflow)", str(r["skipped_steps"])))
    return tabulate(rows, tablefmt="outline")


def train_command(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    check_output(s.json_path, "--json")
    rank, world, joined = init_from_env(s.device)
    # after a failure the error propagates without tearing the group down (the launcher stops the
    # other ranks; destroying it under their collectives could hang them)
    result = run_train(s, rank=rank, world=world)
    if joined:             # every rank is done with every collective before any tears its side down
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    print(summary_table(result), flush=True)
    if s.json_path:
        write_atomic(Path(s.json_path), json.dumps(result, indent=2).encode())
        print(f"summary written to {s.json_path}")
    return 0
