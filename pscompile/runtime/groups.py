"""The parameter groups' values while an engine trains: a mixin of ``ChunkEngine``.

``engine.optimizer`` (an ``EngineOptimizer``) holds them in ``torch.optim``'s form, which
``torch.optim.lr_scheduler`` schedulers drive; ``engine.lr`` and ``set_lr`` write the same groups.
Each step takes them into its update (``_take_groups``).
"""

from __future__ import annotations

from pscompile.config import AdamW
from pscompile.optim.torch_optimizer import EngineOptimizer, HP_KEYS, updated_hps


class GroupControl:
    """Mixin of ``ChunkEngine``: ``optimizer``, ``lr``, ``set_lr`` and ``param_groups``."""

    def _make_optimizer(self) -> None:
        self.optimizer = EngineOptimizer(self.groups.describe(), self._take_groups)

    def _take_groups(self) -> None:
        """The optimizer's groups' values become the next update's (checked first)."""
        self.adam.hps = updated_hps(self.optimizer.param_groups, list(self.adam.hps))

    def _put_groups(self, hps: list[AdamW], saved: list[dict] | None = None) -> None:
        """Loaded values (and the keys schedulers added to the saved groups): into the
        optimizer's groups and the next update."""
        for i, (g, hp) in enumerate(zip(self.optimizer.param_groups, hps)):
            if saved is not None:
                g.update({k: v for k, v in saved[i].items() if k != "params"})
            g.update(lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
        self.adam.hps = list(hps)

    @property
    def lr(self) -> float:
        """The learning rate of the next update (of the last parameter group: the parameters no
        group named); assign to it to follow a schedule: every group gets the value."""
        return self.optimizer.param_groups[-1]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.set_lr(value)

    def set_lr(self, value: float, group: int | None = None) -> None:
        """Set the learning rate of parameter group ``group`` (an index into ``param_groups``), or
        of every group (None)."""
        set_group_lr(self.optimizer, value, group)

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups in ``torch.optim.Optimizer.param_groups``' form, with parameter
        names for ``params`` (a copy: change values through ``engine.optimizer`` or ``set_lr``)."""
        return [{"params": list(g["params"]), **{k: g[k] for k in HP_KEYS},
                 **{k: v for k, v in g.items() if k not in HP_KEYS and k != "params"}}
                for g in self.optimizer.param_groups]


def set_group_lr(optimizer: EngineOptimizer, value: float, group: int | None) -> None:
    """``value`` as the learning rate of ``optimizer``'s group ``group`` (None: every group),
    checked first, then taken into the next update (``optimizer.step()``)."""
    groups = optimizer.param_groups
    n = len(groups)
    if group is not None and not (isinstance(group, int) and -n <= group < n):
        raise ValueError(f"group={group!r} is not a parameter group; this engine has {n} (0..{n - 1})")
    AdamW(lr=value)                            # validated before anything changes
    for g in range(n) if group is None else [group % n]:
        groups[g]["lr"] = value
    optimizer.step()
