"""Parameter groups: which AdamW hyper-parameters each parameter is updated with.

``resolve_groups`` turns ``AdamW.param_groups`` (names or predicates) into one ``AdamW`` per
group and the parameters of each, in ``torch.optim.AdamW``'s order: the user's groups as given,
then a last group of every parameter no group named (with the top-level values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch

from pscompile.config import AdamW


@dataclass(frozen=True)
class ResolvedGroups:
    hps: tuple[AdamW, ...]                 # one per group: the values its parameters are updated with
    names: tuple[tuple[str, ...], ...]     # the parameters (primary names) of each group
    index: Mapping[str, int]               # primary name -> its group

    def describe(self) -> list[dict]:
        """The groups in ``torch.optim.Optimizer.param_groups``' form, with names for parameters."""
        return [{"params": list(names), "lr": hp.lr, "betas": hp.betas, "eps": hp.eps,
                 "weight_decay": hp.weight_decay} for hp, names in zip(self.hps, self.names)]


def resolve_groups(hp: AdamW, params: Mapping[str, torch.Tensor],
                   aliases: Mapping[str, str] | None = None) -> ResolvedGroups:
    """``params``: primary name -> parameter, in the model's order; ``aliases``: every other name
    of a tied parameter -> its primary name. Raises ``ValueError`` for a name the model does not
    have and for a parameter two groups name."""
    aliases = dict(aliases or {})
    base = dataclasses.replace(hp, param_groups=())
    index: dict[str, int] = {}
    hps, names = [], []
    for i, group in enumerate(hp.param_groups):
        if callable(group.params):
            members = [f for f, p in params.items() if _ask(group.params, i, f, p)]
        else:
            members = []
            for n in group.params:
                f = n if n in params else aliases.get(n)
                if f is None:
                    close = [m for m in params if n.split(".")[-1] == m.split(".")[-1]][:3]
                    raise ValueError(f"param_groups[{i}] names {n!r}, which the model does not have as a parameter"
                                     + (f"; parameters with that last part: {close}" if close else
                                        "; see model.named_parameters() for the names"))
                members.append(f)
        twice = [f for f in members if f in index]
        if twice:
            raise ValueError(f"param_groups[{i}] names {twice[:3]}, already in param_groups[{index[twice[0]]}]; "
                             "a parameter can be in one group only (as in torch.optim)")
        members = list(dict.fromkeys(members))
        for f in members:
            index[f] = i
        hps.append(dataclasses.replace(base, **group.overrides()))
        names.append(tuple(members))
    rest = tuple(f for f in params if f not in index)
    if rest or not hps:
        for f in rest:
            index[f] = len(hps)
        hps.append(base)
        names.append(rest)
    return ResolvedGroups(tuple(hps), tuple(names), index)


def _ask(predicate, i: int, name: str, param: torch.Tensor) -> bool:
    answer = predicate(name, param)
    if not isinstance(answer, bool):
        raise ValueError(f"param_groups[{i}]['params'] is a predicate; it must return True or False, it returned "
                         f"{answer!r} for {name!r}")
    return answer
