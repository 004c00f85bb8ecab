"""Plain PyTorch mixed-precision training: the yardstick every pscompile mode must match.

Compute-dtype parameters for forward and backward, fp32 master weights updated by
``torch.optim.AdamW``, gradients upcast to fp32; float16 uses ``torch.amp.GradScaler``-style
dynamic loss scaling; optional ``clip_grad_norm_``. Everything lives on one device, so its peak
memory is what training without pscompile needs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pscompile.runtime.batching import LossFn, call_model, extract_loss, micro_batches, to_device
from pscompile.config import AdamW
from pscompile.optim.adamw import LossScaler


class ReferenceTrainer:
    def __init__(self, model: nn.Module, *, optimizer: AdamW, dtype: torch.dtype,
                 device: str | torch.device = "cpu", loss_fn: LossFn | None = None,
                 initial_loss_scale: float = 2.0**16, growth_interval: int = 2000, copy_model: bool = True):
        self.device = torch.device(device)
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.model = copy.deepcopy(model) if copy_model else model
        self.model.to(self.device)
        self.params = list(self.model.parameters())
        if dtype == torch.float32:       # fp32 compute: the parameters are their own master copy
            self.master = self.params
        else:
            self.master = [p.detach().float().clone() for p in self.params]
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.data = m.to(dtype)
            for m in self.master:
                m.requires_grad_(True)
        hp = optimizer
        self.hp = hp
        self.opt = torch.optim.AdamW(self.master, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                     weight_decay=hp.weight_decay)
        self.scaler = LossScaler(initial_loss_scale, growth_interval) if dtype == torch.float16 else None

    def step(self, batch: Any) -> float:
        """One update; a list of micro-batches accumulates ``(loss / k).backward()`` over them."""
        micro = micro_batches(batch)
        batches = [to_device(b, self.device) for b in (micro if micro is not None else [batch])]
        scale = self.scaler.scale if self.scaler is not None else 1.0
        losses = []
        for b in batches:
            loss = extract_loss(call_model(self.model, b), b, self.loss_fn)
            (loss * (scale / len(batches))).backward()
            losses.append(float(loss.detach()))
        loss = torch.tensor(sum(losses) / len(losses))
        if self.master is not self.params:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [m.grad for m in self.master if m.grad is not None]
        if self.scaler is not None:
            found_inf = not all(torch.isfinite(g).all() for g in grads)
            self.scaler.update(found_inf)
            if found_inf:
                self.opt.zero_grad(set_to_none=True)
                return float(loss.detach())
            for g in grads:
                g.mul_(1.0 / scale)
        if self.hp.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.master if m.grad is not None], self.hp.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        return float(loss.detach())

    def master_state(self) -> dict[str, torch.Tensor]:
        """fqn -> fp32 master weight (tied parameters under their first name)."""
        names = {}
        for fqn, p in self.model.named_parameters():
            names[id(p)] = fqn
        return {names[id(p)]: m.detach() for p, m in zip(self.params, self.master)}
