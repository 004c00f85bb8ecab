"""``pscompile.compile`` (the one entry point) and ``pscompile.min_device_memory``."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from pscompile.config import AdamW, Config, available_host_bytes
from pscompile.errors import BudgetError
from pscompile.hooks.engine import HooksEngine
from pscompile.runtime.batching import LossFn, to_device
from pscompile.runtime.params import check_model
from pscompile.units import format_bytes

# Probes of hooks mode's minimum before giving up (each probe is one traced forward + backward).
_MAX_PROBES = 8


def compile(model: nn.Module, batch: Any, *, optimizer: AdamW | None = None,
            config: Config | None = None, loss_fn: LossFn | None = None):
    """Prepare ``model`` for training under ``config``'s memory budget.

    ``batch`` is an example batch (tuple -> ``model(*batch)``, dict -> ``model(**batch)``); the
    model's output is a scalar loss, an object or dict with a ``loss`` entry, or ``loss_fn(output,
    batch)`` turns it into one. The model's parameters move into chunks: afterwards train with
    ``engine.step(batch)`` and export with ``engine.full_state_dict()``. A budget below what the
    model needs raises ``BudgetError`` naming the smallest budget that compile accepts.
    """
    optimizer, config = _check_arguments(model, optimizer, config)
    if config.mode == "compiled":
        from pscompile.compiled.engine import CompiledEngine
        return CompiledEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
    try:
        return HooksEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
    except BudgetError as e:
        if e.minimum is None or config.chunk_size != "auto":
            raise
        # "auto" sizes chunks by the budget, so the minimum at this budget's chunk size may not hold
        # at the minimum's own: name the budget that really works
        least, chunk_size = _hooks_minimum(model, batch, optimizer, config, loss_fn, start=1)
        raise BudgetError(
            f"device_memory={format_bytes(config.device_memory)} ({config.device_memory} bytes) is below the "
            f"minimum {format_bytes(least)} ({least} bytes) this model needs in hooks mode (chunk_size='auto' "
            f"picks {chunk_size:,} elements there); at this budget it needs {format_bytes(e.minimum)} "
            f"{e.detail}; give device_memory >= {least}, a smaller batch or a smaller chunk_size",
            minimum=least) from e


def min_device_memory(model: nn.Module, batch: Any, config: Config | None = None, *,
                      optimizer: AdamW | None = None, loss_fn: LossFn | None = None) -> int:
    """The smallest ``device_memory`` that ``compile(model, batch, config=config)`` accepts and
    trains with (``config.device_memory`` itself is ignored).

    Compiled mode plans it on fake tensors (nothing is allocated; the model may be on the meta
    device); with ZeRO (an initialized process group) it is one rank's minimum; with a
    ``host_memory`` smaller than the model it includes the chunks that must live on the device. Hooks mode traces one forward and backward per chunk size it tries (``chunk_size=
    "auto"`` sizes chunks by the budget), with the model's weights handed back afterwards."""
    optimizer, config = _check_arguments(model, optimizer, config)
    if config.mode == "compiled":
        from pscompile.dist.comm import resolve_comm
        from pscompile.graph.pipeline import least_budget, plan_inputs
        from pscompile.memory.disk_states import STAGED_SETS
        from pscompile.optim.placement import host_shortfall_chunks, host_state_chunks
        batch = to_device(batch, config.torch_device)
        comm = resolve_comm(config.process_group)
        world = comm.world if comm is not None else 1
        layout, analyzed = plan_inputs(model, batch, config, loss_fn=loss_fn, world=world,
                                       per_chunk=config.collectives == "per_chunk")
        slot_bytes = layout.chunk_size * config.dtype.itemsize
        state_bytes = 3 * 4 * layout.chunk_size
        disk = config.disk_dir is not None and world == 1      # the host's shortfall goes to disk, not the device
        homes = 0 if config.host_memory is None or world > 1 or disk else host_shortfall_chunks(
            num_chunks=layout.num_chunks, chunk_bytes=slot_bytes + state_bytes, host_budget=config.host_memory)
        host = config.host_memory if config.host_memory is not None else int(0.8 * available_host_bytes())
        n, cs = layout.num_chunks, layout.chunk_size            # host room for activations, as the engine counts it
        owned = (len(range(comm.rank, n, world)) * cs if config.collectives == "per_chunk" and world > 1
                 else (n - homes) * (cs // world))
        room = max(0, host - owned * (config.dtype.itemsize + 12))
        if disk and room == 0:
            room = max(0, host_state_chunks(num_chunks=n, chunk_size=cs, param_bytes=config.dtype.itemsize,
                                            staging_chunks=STAGED_SETS, host_budget=host)[1])
        return least_budget(analyzed, layout, policy=config.activations, slot_bytes=slot_bytes, world=world,
                            device_homes=homes, state_bytes=state_bytes, host_room=room).nbytes
    return _hooks_minimum(model, batch, optimizer, config, loss_fn, start=1)[0]


def _hooks_minimum(model: nn.Module, batch: Any, optimizer: AdamW, config: Config, loss_fn: LossFn | None, *,
                   start: int) -> tuple[int, int]:
    """(the least budget B with minimum(chunk size at B) <= B, from ``start`` up; that chunk size).
    Each probe builds a hooks engine at the candidate budget (its trace names the minimum at its
    chunk size) and closes it again, handing the model its weights back."""
    budget = max(1, start)
    for _ in range(_MAX_PROBES):
        try:
            engine = HooksEngine(model, batch, optimizer=optimizer, loss_fn=loss_fn,
                                 config=dataclasses.replace(config, device_memory=budget))
            engine.close()
            return budget, engine.layout.chunk_size
        except BudgetError as e:
            if e.minimum is None or e.minimum <= budget:
                raise
            budget = e.minimum
    raise BudgetError(f"no budget found in {_MAX_PROBES} probes for hooks mode with chunk_size='auto' (last tried "
                      f"{budget} bytes); give chunk_size explicitly")


def _check_arguments(model: nn.Module, optimizer: AdamW | None, config: Config | None) -> tuple[AdamW, Config]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_model(model)
    optimizer = optimizer if optimizer is not None else AdamW()
    config = config if config is not None else Config()
    if not isinstance(optimizer, AdamW):
        raise ValueError(f"optimizer must be pscompile.AdamW(...), got {type(optimizer).__name__}")
    if not isinstance(config, Config):
        raise ValueError(f"config must be pscompile.Config(...), got {type(config).__name__}")
    return optimizer, config
