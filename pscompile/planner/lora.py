"""LoRA for the planner: "rank r on these projections", without ``peft``.

``add_lora`` freezes every parameter of a module and gives each ``nn.Linear`` whose name ends in
one of the targets a low-rank adapter (``A``: r x in, ``B``: out x r, trainable), as
``peft``'s LoRA does: ``y = base(x) + (x A^T) B^T * alpha / r``. On the meta device it costs
nothing, so ``plan`` and ``search`` can ask how large a base a LoRA run fine-tunes
(``pscompile plan --lora-rank 8 --lora-targets c_attn``). The bytes are what matter here: frozen
parameters cost their compute-dtype copy, adapters their copy plus 12 bytes of optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LoRA:
    """Adapters of ``rank`` on the linear layers whose names end in one of ``targets``."""

    rank: int
    targets: tuple[str, ...]
    alpha: float = 16.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank}: a positive number of adapter dimensions is needed (e.g. 8)")
        if not self.targets:
            raise ValueError("LoRA targets: name the projections to adapt, e.g. ('c_attn',) or ('q_proj', 'v_proj')")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` and its trainable low-rank adapter."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **kw).normal_(std=0.02))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale


def add_lora(module: nn.Module, lora: LoRA) -> nn.Module:
    """``module`` with every parameter frozen and adapters on its target projections (in place)."""
    module.requires_grad_(False)
    targets = [(name, m) for name, m in module.named_modules()
               if isinstance(m, nn.Linear) and name.split(".")[-1] in lora.targets]
    if not targets:
        linear = sorted({n.split(".")[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"LoRA targets {list(lora.targets)} name no linear layer of {type(module).__name__}; "
                         f"its linear layers are named {linear}")
    for name, m in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, LoRALinear(m, lora.rank, lora.alpha))
    return module
