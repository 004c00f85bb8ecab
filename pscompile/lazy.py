"""``pscompile.compile(model)`` without a batch: an engine built at its first step, as
``torch.compile(model)`` compiles at its first call.

``LazyEngine`` holds the model, optimizer, config and loss function (checked at once) and builds
the real engine (``HooksEngine`` or ``CompiledEngine``) from the first batch that ``step`` or
``evaluate`` receives: the parameters' order, the chunk layout, the plan and (compiled mode) the
capture and lowering all come from that batch, exactly as ``compile(model, batch)`` makes them, so
the two forms train step for step alike. What a built engine has, the lazy one forwards to it.

Before the first step the engine already has what a training script sets up: ``optimizer`` (an
``EngineOptimizer`` over the groups ``AdamW(param_groups=...)`` names, for ``torch.optim``'s LR
schedulers; the built engine takes this same object over), ``lr`` / ``set_lr`` / ``param_groups``,
and ``pscompile.load``, which checks the file (size, SHA-256, format) at once, returns its
``client_state`` and loads it into the engine when the engine is built. What moves to the first
step: a batch the model cannot take, a budget below the minimum (``BudgetError``), a model the
capture cannot trace, and a checkpoint that does not fit the model. ``state_dict``, ``save`` and
the statistics exist from the first step on.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from torch import nn

from pscompile.config import AdamW, Config
from pscompile.errors import closed_message
from pscompile.resolved import resolve
from pscompile.profiling import Profiled
from pscompile.optim.groups import resolve_groups
from pscompile.optim.torch_optimizer import EngineOptimizer, updated_hps
from pscompile.runtime.batching import LossFn, as_batch, micro_batches
from pscompile.runtime.groups import set_group_lr

BEFORE = ("it is built at its first step(batch) or evaluate(batch); compile(model, batch) builds it at once "
          "(and raises a budget or capture error there)")


class NotBuilt(AttributeError):
    """An attribute of a lazily compiled engine that exists once its first step has run."""


class LazyEngine(Profiled):
    """What ``pscompile.compile(model)`` returns: see the module's docstring."""

    def __init__(self, model: nn.Module, *, optimizer: AdamW, config: Config, loss_fn: LossFn | None,
                 build: Callable[[Any], Any], load: Callable[[Any, Path], Any]):
        """``build(batch)``: the engine ``compile(model, batch, ...)`` makes; ``load(engine,
        path)``: ``pscompile.load``, for a checkpoint loaded before the first step."""
        self.model, self.config, self.hp, self.loss_fn = model, resolve(config), optimizer, loss_fn
        self._build, self._load = build, load
        self.built = None                          # the engine, from the first step on
        self.closed = False
        self._pending_load: Path | None = None
        groups = _resolved(model, optimizer)
        self.optimizer = EngineOptimizer(groups.describe(), self._take_groups)
        self._hps = list(groups.hps)

    # ---- what exists before the first step ---------------------------------------------------
    def _take_groups(self) -> None:
        self._hps = updated_hps(self.optimizer.param_groups, self._hps)

    @property
    def lr(self) -> float:
        return self.built.lr if self.built is not None else self.optimizer.param_groups[-1]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.set_lr(value)

    def set_lr(self, value: float, group: int | None = None) -> None:
        set_group_lr(self.optimizer, value, group)     # (the built engine's optimizer is this one)

    @property
    def param_groups(self) -> list[dict]:
        if self.built is not None:
            return self.built.param_groups
        return [dict(g, params=list(g["params"])) for g in self.optimizer.param_groups]

    # ---- building -----------------------------------------------------------------------------
    def ensure_built(self, batch: Any):
        """The engine, built from ``batch`` if it is not yet (and a pending checkpoint loaded)."""
        if self.closed:
            raise RuntimeError(closed_message(""))
        if self.built is None:
            engine = self._build(batch)
            try:
                self._hand_over(engine)
                if self._pending_load is not None:
                    self._load(engine, self._pending_load)
            except BaseException:
                engine.close()                     # the model gets its weights back
                raise
            self.built, self._pending_load = engine, None
        return self.built

    def _hand_over(self, engine) -> None:
        """The built engine takes this engine's optimizer (schedulers hold it) and its values."""
        ours, theirs = self.optimizer.param_groups, engine.optimizer.param_groups
        if [sorted(g["params"]) for g in ours] != [sorted(g["params"]) for g in theirs]:
            raise RuntimeError("the parameter groups resolved at compile() differ from the built engine's; "
                               "compile(model, batch) builds the engine at once")
        for g, t in zip(ours, theirs):
            g["params"] = list(t["params"])        # (in the order of first use)
        self.optimizer._apply = engine._take_groups
        engine.optimizer = self.optimizer
        engine._take_groups()

    def step(self, batch: Any) -> float:
        batch = as_batch(batch)
        micro = micro_batches(batch)          # a list of micro-batches: built from the first
        return self.ensure_built(batch if micro is None else micro[0]).step(batch)

    def evaluate(self, batch: Any) -> float:
        batch = as_batch(batch, "evaluate")
        return self.ensure_built(batch).evaluate(batch)

    @contextlib.contextmanager
    def materialize(self, **kwargs):
        """The built engine's ``materialize``; before the first step the model still holds its own
        weights, as given, and is yielded as it is."""
        if self.built is not None:
            with self.built.materialize(**kwargs) as model:
                yield model
            return
        yield self.model

    def defer_load(self, path: Path) -> None:
        """``pscompile.load`` before the first step (which checked the file): loaded when the
        engine is built."""
        self._pending_load = path

    def close(self) -> None:
        """Close the built engine (the model gets its trained weights back); before the first
        step the model was never touched."""
        if self.built is not None:
            self.built.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        built = self.__dict__.get("built")
        if built is not None:
            return getattr(built, name)
        raise NotBuilt(f"engine.{name}: this engine was compiled without a batch, and {BEFORE}")

    def __repr__(self) -> str:
        return repr(self.built) if self.built is not None else f"<pscompile engine (not built: {BEFORE})>"


def built_engine(engine, call: str):
    """The engine ``call`` works on: a lazy engine's built one (refused before its first step)."""
    if not isinstance(engine, LazyEngine):
        return engine
    if engine.built is None:
        raise RuntimeError(f"{call}: this engine was compiled without a batch and has not been built yet; "
                           f"{BEFORE}")
    return engine.built


def _resolved(model: nn.Module, hp: AdamW):
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    params = {n[0]: p for n, p in ((names[id(p)], p) for p in model.parameters())}
    aliases = {o: n[0] for n in names.values() for o in n[1:]}
    return resolve_groups(hp, params, aliases)

