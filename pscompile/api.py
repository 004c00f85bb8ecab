"""``pscompile.compile`` (the one entry point) and ``pscompile.min_device_memory``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from pscompile.config import AdamW, Config
from pscompile.errors import BudgetError
from pscompile.hooks.engine import HooksEngine
from pscompile.lazy import LazyEngine
from pscompile.runtime.batching import LossFn, as_batch, tensor_problem, to_device
from pscompile.resolved import ResolvedConfig, resolve
from pscompile.runtime.params import check_model
from pscompile.units import format_bytes
from pscompile.kinds import Backend, Collectives, Mode

log = logging.getLogger("pscompile")

# Probes of hooks mode's minimum before giving up (each probe is one traced forward + backward).
_MAX_PROBES = 8


def compile(model: nn.Module, batch: Any = None, *, optimizer: AdamW | None = None,
            config: Config | None = None, loss_fn: LossFn | None = None):
    """Prepare ``model`` for training under ``config``'s memory budget.

    ``batch`` is an example batch (tuple -> ``model(*batch)``, dict -> ``model(**batch)``); the
    model's output is a scalar loss, an object or dict with a ``loss`` entry, or ``loss_fn(output,
    batch)`` turns it into one. The model's parameters move into chunks: afterwards train with
    ``engine.step(batch)`` and export with ``engine.full_state_dict()``. A budget below what the
    model needs raises ``BudgetError`` naming the smallest budget that compile accepts.

    Without ``batch`` (``compile(model)``) the engine is built at its first ``step`` or
    ``evaluate``, from that batch, as ``torch.compile`` compiles at the first call; the budget and
    capture errors move there (``pscompile/lazy.py``). The two forms train step for step alike.
    """
    optimizer, config = _check_arguments(model, optimizer, config)
    if batch is None:
        from pscompile.saving import load
        return LazyEngine(model, optimizer=optimizer, config=config, loss_fn=loss_fn, load=load,
                          build=lambda b: compile(model, b, optimizer=optimizer, config=config, loss_fn=loss_fn))
    batch = as_batch(batch, "compile")
    problem = tensor_problem(batch)
    if problem is not None:
        raise ValueError(f"compile(): {problem}")
    try:
        if config.mode == Mode.COMPILED:
            from pscompile.compiled.engine import CompiledEngine
            return CompiledEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
        return HooksEngine(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
    except BudgetError as e:
        given = config.device_memory
        if e.minimum is None or given is None:
            raise
        if config.chunk_size != "auto":
            if not _programs(config):
                raise
            raise BudgetError(f"{e}; {_both_minima(e.minimum, config)}", minimum=e.minimum, detail=e.detail) from None
        # "auto" sizes chunks by the budget, so the minimum at this budget's chunk size may not hold
        # at the minimum's own: name the budget that really works
        least, chunk_size = _least_budget(model, batch, optimizer, config, loss_fn)
        if least == e.minimum:
            raise
        budget = f"device_memory={format_bytes(given)} ({given} bytes)"
        there = f"chunk_size='auto' picks {chunk_size:,} elements there"
        needs = (f"it needs {format_bytes(e.minimum)}" if e.minimum > given else "it does not fit") + \
            (f" {e.detail}" if e.detail else "")
        if least > given:
            program = f"; {_both_minima(least, config)}" if _programs(config) else ""
            raise BudgetError(
                f"{budget} is below the minimum {format_bytes(least)} ({least} bytes) this model needs in "
                f"{config.mode} mode ({there}); at this budget {needs}; give device_memory >= {least}, a smaller "
                f"batch or a smaller chunk_size{program}", minimum=least) from None      # (one figure: the least)
        # the least budget is at most this one, yet the layout "auto" picks here does not fit (a larger
        # budget may pick larger chunks): the message must not call this budget below that minimum
        raise BudgetError(
            f"{budget} is at least the minimum {format_bytes(least)} ({least} bytes) this model needs in "
            f"{config.mode} mode ({there}), but the layout chunk_size='auto' picks at this budget does not fit in "
            f"it: {needs}; give device_memory={least} or an explicit chunk_size", minimum=least) from None


def min_device_memory(model: nn.Module, batch: Any, config: Config | None = None, *,
                      optimizer: AdamW | None = None, loss_fn: LossFn | None = None) -> int:
    """The smallest ``device_memory`` at which ``compile(model, batch, config=config)`` trains with
    compiled code (``config.device_memory`` itself is ignored).

    With the default backend (compiled mode, Inductor) that is the budget from which its program
    runs: the plan's minimum plus 1/7 of it in float32 (1/5 in 16-bit) for the buffers Inductor's
    kernels hold beyond eager code's (``graph.minimum.program_least``). ``compile`` accepts budgets
    from the plan's minimum, where the schedule runs as compiled eager; ``describe()`` and a
    ``BudgetError`` name both.

    Compiled mode plans it on fake tensors (nothing is allocated; the model may be on the meta
    device); with ZeRO (an initialized process group) it is one rank's minimum; with a
    ``host_memory`` smaller than the model it includes the chunks that must live on the device.
    Hooks mode traces one forward and backward per chunk size it tries. With ``chunk_size="auto"``
    the chunk size depends on the budget (at most an eighth of it), so both search for the least
    budget whose own layout fits in it.

    With sizes named up front (``Config(dynamic=...)`` with ``pscompile.Dim``s) compiled mode
    answers for the range: the least budget at which the range's symbolic capture, planned at every
    Dim's ``max``, fits; ``batch`` only shows the structure (its sizes must lie within the Dims).
    Where the engine would refuse that capture (a model that needs plain sizes: its INFO line says
    why), every shape gets a plan of its own, and the answer falls back, with a WARNING, to the
    minimum of one batch at the Dims' maxima (as plain captures of each shape). Hooks mode and ZeRO
    answer for ``batch`` as given."""
    optimizer, config = _check_arguments(model, optimizer, config)
    least = _least_budget(model, as_batch(batch, "min_device_memory"), optimizer, config, loss_fn)[0]
    return _for_backend(least, config)


def _least_budget(model: nn.Module, batch: Any, optimizer: AdamW, config: Config,
                  loss_fn: LossFn | None) -> tuple[int, int]:
    """(the least budget B from 1 up whose layout's minimum is at most B; the chunk size there)."""
    if config.mode == Mode.COMPILED:
        return _compiled_minimum(model, batch, config, loss_fn)
    return _hooks_minimum(model, batch, optimizer, config, loss_fn, start=1)


def _compiled_minimum(model: nn.Module, batch: Any, config: Config, loss_fn: LossFn | None) -> tuple[int, int]:
    """Compiled mode's search, on one capture. The engine weighs several layouts at a budget
    (``pipeline.layout_candidates``, sized by the budget with "auto"); it accepts a budget when one
    of them fits in it. From 1 up: the least budget over the candidates at the probed budget, until
    that is no more than the probe."""
    from pscompile.dist.comm import resolve_comm
    from pscompile.graph.pipeline import config_least, gather_bytes, layout_candidates, regather
    from pscompile.runtime.batching import call_model
    from pscompile.runtime.params import collect_params
    batch = to_device(batch, config.torch_device)
    comm = resolve_comm(config.process_group)
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    per_chunk = config.collectives == Collectives.PER_CHUNK
    mp = collect_params(model, call_model, batch)
    analyzed = _analyzed(model, batch, mp.params, config, loss_fn, world)
    leasts: dict[int, int] = {}             # chunk size -> least budget of its layout
    variants: dict = {}                      # activation rewrites, shared by every layout

    def least(budget: int | None) -> tuple[int, int]:
        best = None
        for layout in layout_candidates(mp, config, budget, world=world, per_chunk=per_chunk):
            if layout.chunk_size not in leasts:
                a = regather(analyzed, gather_bytes(layout, config.dtype))
                leasts[layout.chunk_size] = config_least(a, layout, config, world=world, rank=rank,
                                                         variants=variants)
            if best is None or leasts[layout.chunk_size] < best[0]:
                best = (leasts[layout.chunk_size], layout.chunk_size)
        return best
    if config.chunk_size != "auto":
        return least(None)
    budget = 1
    for _ in range(_MAX_PROBES):
        need, chunk_size = least(budget)
        if need <= budget:
            return budget, chunk_size
        budget = need
    raise BudgetError(f"no budget found in {_MAX_PROBES} probes for compiled mode with chunk_size='auto' (last "
                      f"tried {budget} bytes); give chunk_size explicitly")


def _for_backend(least: int, config: Config) -> int:
    """The least budget named for ``config``: compiled mode with Inductor, the room its program needs
    (``minimum.program_least``); below it (from ``least`` up) the schedule runs as compiled eager."""
    from pscompile.graph.minimum import program_least
    return program_least(least, config) if _programs(config) else least


def _programs(config: Config) -> bool:
    return config.mode == Mode.COMPILED and config.backend == Backend.INDUCTOR


def _both_minima(least: int, config: Config) -> str:
    """What a BudgetError adds with Inductor: the two minima, and which is which."""
    from pscompile.graph.minimum import program_least
    return (f"Inductor's program needs device_memory >= {program_least(least, config)}; from {least} up to that the "
            "schedule runs as compiled eager")


def _analyzed(model: nn.Module, batch: Any, params: dict, config: Config, loss_fn: LossFn | None, world: int):
    """What ``_compiled_minimum`` plans on: the batch's capture, or with sizes named up front
    (``pscompile/dims.py``) the range's symbolic capture analyzed at the Dims' maxima, as the engine
    plans it (``compiled/planning.py``); where that capture is refused, a capture of the batch at
    the maxima."""
    from pscompile.dims import DynamicShapes
    from pscompile.graph.analysis import analyze_at_bound, capture_and_analyze, guards_refuse_bound, range_refusal
    from pscompile.graph.capture import capture_joint
    spec = config.dynamic
    if not isinstance(spec, DynamicShapes) or world > 1:
        return capture_and_analyze(model, batch, params=params, dtype=config.dtype, loss_fn=loss_fn)
    declared = spec.resolve(batch)
    try:
        captured = capture_joint(model, batch, params=dict(params), loss_fn=loss_fn, param_dtype=config.dtype,
                                 loss_scale=config.dtype == torch.float16, dynamic=declared.dims)
        why = range_refusal(captured)
    except Exception as e:  # noqa: BLE001 - the engine refuses the range alike (a plan per shape)
        why = f"the capture with symbolic sizes failed ({type(e).__name__}: {str(e)[:200]})"
    if why is None:
        refusing = guards_refuse_bound(captured, declared.maxes)
        if refusing is not None:
            log.warning("pscompile: min_device_memory: the maxima %s of Config.dynamic break the model's traced shape "
                        "guards (%s): this answer is for sizes no batch of the range runs; lower the Dims' max",
                        list(declared.maxes), refusing)
        return analyze_at_bound(captured, declared.maxes)
    log.warning("pscompile: min_device_memory: the range Config.dynamic names is refused (%s); each shape gets a "
                "plan of its own, so this is the minimum of one batch at the maxima %s", why, list(declared.maxes))
    return capture_and_analyze(model, declared.at_max(batch), params=params,
                               dtype=config.dtype, loss_fn=loss_fn)


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


def _check_arguments(model: nn.Module, optimizer: AdamW | None,
                     config: Config | None) -> tuple[AdamW, ResolvedConfig]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_model(model)
    optimizer = optimizer if optimizer is not None else AdamW()
    config = config if config is not None else Config()
    if not isinstance(optimizer, AdamW):
        raise ValueError(f"optimizer must be pscompile.AdamW(...), got {type(optimizer).__name__}")
    if not isinstance(config, Config):
        raise ValueError(f"config must be pscompile.Config(...), got {type(config).__name__}")
    return optimizer, resolve(config)
