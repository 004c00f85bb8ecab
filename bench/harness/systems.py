"""The systems several scripts train: plain PyTorch counted tensor by tensor and hooks mode
(bench/foundation.py and its sections, bench/capacity.py), plain PyTorch with fused AdamW and compiled
mode on the CPU (bench/first_step.py, bench/program.py); and the sections' log and table cells."""

from __future__ import annotations

import sys
import time

import torch

import pscompile
from pscompile.memory.tracker import NonModelTracker
from pscompile.testing import ReferenceTrainer

from .specs import adamw


def _persistent(trainer) -> list[torch.Tensor]:
    """A ``ReferenceTrainer``'s parameters, master copies and Adam states: what it keeps between steps."""
    ts = list(trainer.params) + list(trainer.master)
    for st in trainer.opt.state.values():
        ts += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return ts


def plain_tracked_step(trainer, batch) -> tuple[float, NonModelTracker, float]:
    """One plain PyTorch step under a tracker that counts every tensor it holds.

    The persistent tensors (parameters, master copies, Adam states, buffers) and the batch were
    made before the tracker enters, so they are added explicitly; gradients, activations and
    temporaries are created inside and counted as they appear. Returns (loss, tracker, seconds).
    """
    tr = NonModelTracker(torch.device("cpu"), is_model_storage=lambda ptr: False, model_bytes=lambda: 0)
    tr.add_tensors(_persistent(trainer) + list(trainer.model.buffers()) + list(batch))
    tr.reset_peaks()
    t0 = time.perf_counter()
    with tr:
        loss = trainer.step(batch)
    return loss, tr, time.perf_counter() - t0


def persistent_bytes(trainer) -> int:
    """Bytes of the distinct storages of what the trainer keeps between steps."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _persistent(trainer)}
    return sum(storages.values())


def plain_step(model: torch.nn.Module, backend: str | None = None):
    """A plain PyTorch training step (``torch.optim.AdamW(fused=True)``) on ``model``; with a
    ``backend``, of ``torch.compile(model, backend=backend)``. ``step(batch)`` returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    f = model if backend is None else torch.compile(model, backend=backend)

    def step(b) -> float:
        loss = f(*b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step


def compiled(model: torch.nn.Module, batch, backend: str, budget: int | None, **kw):
    """``model`` in compiled mode on the CPU, float32, with ``pscompile.AdamW(lr=1e-3)`` (``kw``: more ``Config``)."""
    return pscompile.compile(model, batch, optimizer=pscompile.AdamW(lr=1e-3), config=pscompile.Config(
        mode="compiled", backend=backend, device="cpu", dtype=torch.float32, device_memory=budget, **kw))


def short(msg, n: int = 90) -> str:
    """``msg`` on one line, cut to ``n`` characters."""
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def hooks_engine(model: torch.nn.Module, batch, budget: int | None, dtype: torch.dtype):
    """``model`` in hooks mode on the CPU under ``budget``, with ``pscompile.AdamW(lr=1e-4)``."""
    cfg = pscompile.Config(mode="hooks", device="cpu", device_memory=budget, dtype=dtype)
    return pscompile.compile(model, batch, optimizer=adamw(1e-4), config=cfg)


def plain_trainer(model: torch.nn.Module, dtype: torch.dtype):
    """Plain PyTorch (``ReferenceTrainer``) on the CPU with the same optimizer as ``hooks_engine``."""
    return ReferenceTrainer(model, optimizer=adamw(1e-4), dtype=dtype, device="cpu", copy_model=False)


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
