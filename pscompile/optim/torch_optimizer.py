"""``engine.optimizer``: the engine's parameter groups as a ``torch.optim.Optimizer``.

Training scripts drive the learning rate through ``torch.optim.lr_scheduler`` (warm-up, cosine,
``LambdaLR``, ``OneCycleLR``, ``SequentialLR``, ``ReduceLROnPlateau``), which reads and writes an
optimizer's ``param_groups``. ``EngineOptimizer`` is that optimizer for an engine: one dict per
parameter group, in ``torch.optim.AdamW``'s order and form (``lr``, ``betas``, ``eps``,
``weight_decay``, with parameter *names* under ``params``: the tensors live in the engine's chunks).
Every ``engine.step`` begins by calling its ``step()``, which takes the groups' values into that
step's update (so a scheduler sees ``optimizer.step()`` called before its own ``step()``, as it
expects); a value that ``pscompile.AdamW`` would refuse raises there, naming the group, before
anything changes. Keys a scheduler adds (``initial_lr``, ``max_lr``, ...) stay in the groups and are
saved with the engine's state.

The Adam moments and master weights are not here: they are in the chunks, saved by
``engine.state_dict()`` and ``pscompile.save``. ``state_dict()`` here holds the groups only.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections import OrderedDict, defaultdict
from typing import Callable

import torch

from pscompile.config import AdamW

HP_KEYS = ("lr", "betas", "eps", "weight_decay")


class EngineOptimizer(torch.optim.Optimizer):
    """The parameter groups of an engine, for ``torch.optim.lr_scheduler``. ``apply`` takes the
    groups' values into the engine's next update (``step``)."""

    def __init__(self, groups: list[dict], apply: Callable[[], None]):
        # torch.optim.Optimizer.__init__ takes ownership of parameter tensors; the parameters here
        # live in the engine's chunks, so this sets the attributes its methods and the schedulers
        # read, without tensors.
        self.param_groups = [dict(g, params=list(g["params"])) for g in groups]
        self.defaults = {k: self.param_groups[-1][k] for k in HP_KEYS}
        self.state: defaultdict = defaultdict(dict)
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._apply = apply

    @property
    def _apply(self) -> Callable[[], None]:
        fn = self._apply_ref()
        if fn is None:
            raise RuntimeError("engine.optimizer: its engine is gone")
        return fn

    @_apply.setter
    def _apply(self, apply: Callable[[], None]) -> None:
        # a bound method is held weakly: the engine holds its optimizer, and a cycle back would
        # keep a dropped engine (its threads, its disk file) alive until the cycle collector runs
        self._apply_ref = weakref.WeakMethod(apply) if hasattr(apply, "__self__") else (lambda: apply)

    def step(self, closure=None):    # noqa: D401 (torch's signature)
        """Take the groups' values into the engine's next update (``engine.step`` calls this; the
        update itself runs in ``engine.step``). Raises ``ValueError`` naming the group for a value
        ``pscompile.AdamW`` refuses."""
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure): the engine runs forward, backward and the update "
                             "in engine.step(batch); a closure is not supported")
        self._apply()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each ``engine.step`` consumes the gradients it produces."""

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("engine.optimizer.add_param_group: the engine's groups are fixed when it is built; "
                         "give them as pscompile.AdamW(param_groups=[...])")

    def state_dict(self) -> dict:
        """The groups (values and the keys schedulers added); the moments are in the engine's state."""
        return {"state": {}, "param_groups": copy.deepcopy(self.param_groups)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take back ``state_dict()``'s groups: the same parameters, group by group."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        problem = groups_problem(groups, self.param_groups)
        if problem:
            raise ValueError(f"engine.optimizer.load_state_dict: {problem}; nothing was loaded")
        old = self.param_groups
        self.param_groups = [dict(copy.deepcopy(g), params=list(g["params"])) for g in groups]
        try:
            self._apply()
        except ValueError:
            self.param_groups = old
            raise

    def __repr__(self) -> str:
        rows = [f"  group {i}: {len(g['params'])} params, " + ", ".join(f"{k}={g[k]}" for k in HP_KEYS)
                for i, g in enumerate(self.param_groups)]
        return "EngineOptimizer (pscompile AdamW on chunks) (\n" + "\n".join(rows) + "\n)"


def groups_problem(groups, ours: list[dict]) -> str | None:
    """Why ``groups`` cannot replace ``ours`` (None: they can)."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return "param_groups must be a list of dicts, as state_dict() gives"
    if [list(g.get("params", ())) for g in groups] != [list(g["params"]) for g in ours]:
        return (f"param_groups hold other parameters than this engine's {len(ours)} groups; build the engine with "
                "the same AdamW(param_groups=...)")
    missing = [f"param_groups[{i}]['{k}']" for i, g in enumerate(groups) for k in HP_KEYS if k not in g]
    return f"{missing[:3]} missing" if missing else None


def updated_hps(groups: list[dict], hps: list[AdamW]) -> list[AdamW]:
    """``hps`` with the groups' values, each checked as ``pscompile.AdamW`` checks it."""
    if len(groups) != len(hps):
        raise ValueError(f"engine.optimizer.param_groups has {len(groups)} groups, the engine {len(hps)}; groups "
                         "cannot be added or removed after the engine is built")
    out = []
    for i, (g, hp) in enumerate(zip(groups, hps)):
        try:
            betas = g["betas"]
            out.append(dataclasses.replace(hp, lr=_number(g["lr"]), eps=_number(g["eps"]),
                                           weight_decay=_number(g["weight_decay"]),
                                           betas=tuple(_number(b) for b in betas)
                                           if isinstance(betas, (tuple, list)) else betas))
        except (KeyError, ValueError) as e:
            raise ValueError(f"engine.optimizer.param_groups[{i}]: {e}") from None
    return out


def _number(v):
    """A scheduler may write a 0-d tensor or a numpy scalar: its value."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v.item() if hasattr(v, "item") and not isinstance(v, (int, float)) else v
