"""Chunk-by-chunk AdamW on fp32 master weights, dynamic loss scaling, gradient clipping.

One update touches four chunks with one layout: the param chunk (which holds the compute-dtype
gradient at this point), the fp32 master chunk and the two Adam state chunks. The gradient is
upcast to fp32 on the fly (one chunk-sized temporary) and handed, with the three fp32 chunks, to
torch's fused AdamW kernel (``torch._fused_adamw_``: the same math as ``torch.optim.AdamW``,
decoupled weight decay and bias correction), then the new master is cast back into the param
chunk. Padding is zero in every list and stays zero.

Parameters that received no gradient this step are left exactly as they were, as
``torch.optim.AdamW`` skips parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pscompile.config import AdamW


@dataclass
class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s rules (float16 compute only)."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0


def grad_sq_sum(buf: torch.Tensor) -> float:
    """Sum of squares of a gradient chunk, accumulated in fp32 like ``clip_grad_norm_``."""
    return float(torch.linalg.vector_norm(buf, dtype=torch.float32)) ** 2


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor (1.0 when not clipping)."""
    if max_norm is None:
        return 1.0
    return min(max_norm / (total_norm + 1e-6), 1.0)


class ChunkAdamW:
    """The update rule, applied to one chunk at a time; holds the step counter and the
    hyper-parameters of each parameter group (``hps[g]``)."""

    def __init__(self, hps: AdamW | list[AdamW]):
        self.hps = [hps] if isinstance(hps, AdamW) else list(hps)
        self.step_count = 0
        self._step_tensors: dict[torch.device, torch.Tensor] = {}

    @property
    def hp(self) -> AdamW:
        return self.hps[-1]

    def begin_step(self) -> None:
        self.step_count += 1
        for t in self._step_tensors.values():
            t.fill_(self.step_count)

    def _step_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._step_tensors.get(device)
        if t is None:
            t = self._step_tensors[device] = torch.tensor(float(self.step_count), device=device)
        return t

    def update_chunk(self, param: torch.Tensor | None, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, *, grad_factor: float,
                     frozen: list[tuple[int, int]], grad: torch.Tensor | None = None,
                     groups: list[tuple[int, list[tuple[int, int]] | None]] | None = None,
                     hps: tuple[AdamW, ...] | None = None) -> None:
        """Update one chunk in place. ``param`` holds the gradient on entry (unless ``grad``, e.g.
        an fp32 accumulation chunk, is given), new params on exit; None leaves the params to the
        caller (lock-free updating publishes them later).

        ``grad_factor`` multiplies the fp32 gradient (loss-scale inverse times clip coefficient).
        ``frozen`` lists (offset, numel) ranges of parameters without a gradient this step.
        ``groups`` lists each group's index and its (offset, numel) ranges in this chunk (None: the
        whole chunk); None updates the whole chunk with ``hp`` (the last group). ``hps`` replaces
        the groups' hyper-parameters (a queued update keeps the values of the step it belongs to).
        """
        hps = self.hps if hps is None else hps
        grad = (param if grad is None else grad).float()
        if grad_factor != 1.0:
            grad.mul_(grad_factor)
        saved = [(o, n, master[o:o + n].clone(), exp_avg[o:o + n].clone(), exp_avg_sq[o:o + n].clone())
                 for o, n in frozen]
        step = [self._step_tensor(master.device)]
        if groups is None:
            groups = [(len(hps) - 1, None)]
        for g, ranges in groups:
            hp = hps[g]
            ranges = [(0, master.numel())] if ranges is None else ranges
            pieces = [[t[o:o + n] for o, n in ranges] for t in (master, grad, exp_avg, exp_avg_sq)]
            torch._fused_adamw_(*pieces, [], step * len(ranges), lr=hp.lr, beta1=hp.betas[0],
                                beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps,
                                amsgrad=False, maximize=False)
        for o, n, ms, ea, eas in saved:
            master[o:o + n].copy_(ms)
            exp_avg[o:o + n].copy_(ea)
            exp_avg_sq[o:o + n].copy_(eas)
        del grad
        if param is not None:
            param.copy_(master)

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        for t in self._step_tensors.values():
            t.fill_(self.step_count)


def is_finite(x: float) -> bool:
    return math.isfinite(x)
