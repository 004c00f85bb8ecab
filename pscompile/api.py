"""``pscompile.compile``: the one entry point."""

from __future__ import annotations

from typing import Any

from torch import nn

from pscompile.runtime.batching import LossFn
from pscompile.config import AdamW, Config
from pscompile.hooks.engine import HooksEngine


def compile(model: nn.Module, batch: Any, *, optimizer: AdamW | None = None,
            config: Config | None = None, loss_fn: LossFn | None = None):
    """Prepare ``model`` for training under ``config``'s memory budget.

    ``batch`` is an example batch (tuple -> ``model(*batch)``, dict -> ``model(**batch)``); the
    model's output is a scalar loss, an object or dict with a ``loss`` entry, or ``loss_fn(output,
    batch)`` turns it into one. The model's parameters move into chunks: afterwards train with
    ``engine.step(batch)`` and export with ``engine.full_state_dict()``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = optimizer if optimizer is not None else AdamW()
    config = config if config is not None else Config()
    if not isinstance(optimizer, AdamW):
        raise ValueError(f"optimizer must be pscompile.AdamW(...), got {type(optimizer).__name__}")
    if not isinstance(config, Config):
        raise ValueError(f"config must be pscompile.Config(...), got {type(config).__name__}")
    if config.disk_dir is not None:
        raise NotImplementedError(
            f"disk_dir={config.disk_dir!r}: the disk tier is not implemented yet; leave disk_dir=None "
            "(chunks live on the device and in host memory)")
    if config.mode == "compiled":
        from pscompile.compiled.engine import CompiledEngine
        return CompiledEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
    return HooksEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
