"""Runs of tests/test_checkpoint.py, each in its own process (spawned): a checkpoint must resume in
a process that shares nothing with the one that wrote it."""

from __future__ import annotations

import torch

import pscompile
from conftest import make_batches, make_model


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norms: the parameter group most training scripts exempt from weight decay."""
    return param.ndim < 2


# parameter groups as a training script sets them (lm_head.weight is wte.weight's tied name), so
# every resume here exercises them
HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                     param_groups=[{"params": no_decay, "weight_decay": 0.0}, {"params": ["lm_head.weight"], "lr": 5e-4}])
DROPOUT = 0.1


def config(mode: str, dtype: str, budget: int | None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=getattr(torch, dtype),
                            device_memory=budget)


def run(mode: str, dtype: str, budget: int | None, seed: int, steps: range, out: str,
        save: str | None = None, load: str | None = None, save_after: int | None = None) -> None:
    """Train ``steps`` (indices into the batch list) from a fresh engine seeded with ``seed``;
    ``load`` a checkpoint first, ``save`` one after ``save_after`` steps (default: all of them);
    write the losses and the state to ``out``."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    batches = make_batches("gpt", max(steps) + 1, distinct=3)
    engine = pscompile.compile(make_model("gpt", dropout=DROPOUT), batches[steps[0]], optimizer=HP,
                               config=config(mode, dtype, budget))
    if load is not None:
        pscompile.load(engine, load)
    losses, evictions = [], []
    for k, i in enumerate(steps):
        if save is not None and k == save_after:
            pscompile.save(engine, save)
        losses.append(engine.step(batches[i]))
        evictions.append(engine.stats.num_evictions)
    if save is not None and save_after is None:
        pscompile.save(engine, save)
    torch.save({"losses": losses, "evictions": evictions, "state": engine.state_dict()}, out)
    engine.close()


def killed_save(path: str, state_out: str, after_tensors: int) -> None:
    """Save after one step, take another, and die (``os._exit``, no cleanup) in the middle of the
    second save, once ``after_tensors`` of its tensors are written."""
    import os
    torch.set_num_threads(1)
    batch = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=config("hooks", "float32", None))
    engine.step(batch)
    pscompile.save(engine, path)
    torch.save(engine.state_dict(), state_out)
    engine.step(batch)
    tensors, real = [0], engine.checkpoint_tensors

    def dying():
        def die_after(get):
            def get_or_die():
                tensors[0] += 1
                if tensors[0] > after_tensors:
                    os._exit(0)
                return get()
            return get_or_die
        return [(n, d, k, die_after(get)) for n, d, k, get in real()]
    engine.checkpoint_tensors = dying
    pscompile.save(engine, path)
    raise AssertionError("the save should have died")
