"""Chunk-by-chunk AdamW on fp32 master weights, dynamic loss scaling, gradient clipping.

One update touches four chunks with one layout: the param chunk (which holds the compute-dtype
gradient at this point), the fp32 master chunk and the two Adam state chunks, and hands them to
torch's fused AdamW kernel (``torch._fused_adamw_``: the same math as ``torch.optim.AdamW``,
decoupled weight decay and bias correction). An fp32 gradient goes to the kernel as it is, and the
new master is copied into the param chunk -- or is the param chunk already, when the store shares
the two (``ChunkStore.shares_master``: the caller passes ``param=None`` and the gradient's own
buffer). A 16-bit gradient is updated in blocks of ``UPDATE_BLOCK`` elements: upcast into a small
reused fp32 buffer, the kernel, the new master cast back, each block while it is in cache. The
kernel is elementwise, so blocks give the same bits as one call. Padding is zero in every list and
stays zero.

On the host, a chunk of one parameter group can instead go through one compiled pass that fuses
the upcast, the update and the cast back (``optim/host_kernel.py``; ``Config.optimizer_kernel``).

Parameters that received no gradient this step are left exactly as they were, as
``torch.optim.AdamW`` skips parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pscompile.config import AdamW
from pscompile.optim.host_kernel import HostKernels, coefficients


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


def grad_norm(buf: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a gradient chunk, accumulated in fp32 like ``clip_grad_norm_`` (a 0-dim tensor
    on the chunk's device: the host reads every chunk's at once, ``sum_of_squares``)."""
    return torch.linalg.vector_norm(buf, dtype=torch.float32)


def sum_of_squares(norms: list[torch.Tensor]) -> float:
    """The sum of the squared ``norms``, in their order, in double precision; one read per device
    (a GPU synchronizes once, not once per chunk)."""
    values: list[float] = [0.0] * len(norms)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(norms):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([norms[i] for i in idx]).tolist()):
            values[i] = v
    sq = 0.0
    for v in values:
        sq += v ** 2
    return sq


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor (1.0 when not clipping)."""
    if max_norm is None:
        return 1.0
    return min(max_norm / (total_norm + 1e-6), 1.0)


# Elements per block of a 16-bit gradient's update on the CPU: its fp32 upcast (256 KiB) stays in
# cache between the cast, the kernel and the cast of the new master back (bench/foundation.py,
# section 3). A GPU updates a whole range per kernel call.
UPDATE_BLOCK = 1 << 16


def _kernel_args(hp: AdamW) -> dict:
    return dict(lr=hp.lr, beta1=hp.betas[0], beta2=hp.betas[1], weight_decay=hp.weight_decay, eps=hp.eps,
                amsgrad=False, maximize=False)


def _gaps(ranges: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The (offset, numel) ranges of [0, numel) that no range in ``ranges`` covers."""
    out, at = [], 0
    for o, n in sorted(ranges):
        if o > at:
            out.append((at, o - at))
        at = max(at, o + n)
    if at < numel:
        out.append((at, numel - at))
    return out


class ChunkAdamW:
    """The update rule, applied to one chunk at a time; holds the step counter and the
    hyper-parameters of each parameter group (``hps[g]``)."""

    def __init__(self, hps: AdamW | list[AdamW], *, blocked: bool | None = None,
                 kernels: HostKernels | None = None):
        self.hps = [hps] if isinstance(hps, AdamW) else list(hps)
        self.blocked = blocked      # 16-bit updates in cache-sized blocks (None: on the CPU only)
        self.kernels = kernels      # the compiled host kernels (None: torch._fused_adamw_ only)
        self.step_count = 0
        self._step_tensors: dict[torch.device, torch.Tensor] = {}
        # one block's fp32 gradient, by (device, background): an update on a thread beside the
        # compute (an early update) may run while the main thread updates another chunk
        self._scratches: dict[tuple[torch.device, bool], torch.Tensor] = {}

    @property
    def hp(self) -> AdamW:
        return self.hps[-1]

    def begin_step(self) -> None:
        self.step_count += 1
        for t in self._step_tensors.values():
            t.fill_(self.step_count)

    def undo_step(self) -> None:
        """Take back ``begin_step`` (a step whose early updates were undone)."""
        self.step_count -= 1
        for t in self._step_tensors.values():
            t.fill_(self.step_count)

    def _step_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._step_tensors.get(device)
        if t is None:
            t = self._step_tensors[device] = torch.tensor(float(self.step_count), device=device)
        return t

    def update_chunk(self, param: torch.Tensor | None, master: torch.Tensor, exp_avg: torch.Tensor,
                     exp_avg_sq: torch.Tensor, *, grad_factor: float,
                     gradless: list[tuple[int, int]], grad: torch.Tensor | None = None,
                     groups: list[tuple[int, list[tuple[int, int]] | None]] | None = None,
                     hps: tuple[AdamW, ...] | None = None, background: bool = False) -> None:
        """Update one chunk in place. ``param`` holds the gradient on entry (unless ``grad``, e.g.
        an fp32 accumulation chunk, is given), new params on exit; None leaves the params to the
        caller (lock-free updating publishes them later).

        ``grad_factor`` multiplies the fp32 gradient (loss-scale inverse times clip coefficient).
        ``gradless`` lists (offset, numel) ranges of parameters without a gradient this step.
        ``groups`` lists each group's index and its (offset, numel) ranges in this chunk (None: the
        whole chunk); None updates the whole chunk with ``hp`` (the last group). ``hps`` replaces
        the groups' hyper-parameters (a queued update keeps the values of the step it belongs to).
        ``background``: called on a thread beside the compute (``HostKernels.update``).
        """
        hps = self.hps if hps is None else hps
        src = param if grad is None else grad               # the gradient, in its own dtype
        param, master, src = _to_extent(exp_avg.numel(), param, master, src)
        saved = [(o, n, master[o:o + n].clone(), exp_avg[o:o + n].clone(), exp_avg_sq[o:o + n].clone())
                 for o, n in gradless]
        step = [self._step_tensor(master.device)]
        if groups is None:
            groups = [(len(hps) - 1, None)]
        if (self.kernels is not None and len(groups) == 1 and groups[0][1] is None
                and self.kernels.wanted(master, src, param, grad_factor)):
            hp = hps[groups[0][0]]
            self.kernels.update(src, master, exp_avg, exp_avg_sq, hp, coefficients(hp, self.step_count, grad_factor),
                                param, background=background)
            self._restore(saved, master, exp_avg, exp_avg_sq)
            if param is not None:                 # the gradless ranges' params: their masters' cast
                for o, n, *_ in saved:
                    param[o:o + n].copy_(master[o:o + n])
            return
        groups = [(g, [(0, master.numel())] if ranges is None else ranges) for g, ranges in groups]
        if src.dtype == torch.float32:                      # no upcast: whole ranges, one kernel call per group
            if grad_factor != 1.0:
                src.mul_(grad_factor)
            for g, ranges in groups:
                pieces = [[t[o:o + n] for o, n in ranges] for t in (master, src, exp_avg, exp_avg_sq)]
                torch._fused_adamw_(*pieces, [], step * len(ranges), **_kernel_args(hps[g]))
            self._restore(saved, master, exp_avg, exp_avg_sq)
            if param is not None:
                param.copy_(master)
            return
        # 16-bit gradient: block by block, the upcast, the update and the cast of the new master
        # back into the param chunk. On the CPU a block is cache-sized (in a small reused buffer),
        # so it stays in cache between the three; on a GPU a block is a whole range, because kernel
        # launches cost there, not caches (the upcast is a temporary the placement reserves room
        # for: optim/placement.UPDATE_TEMP_BYTES_PER_ELEMENT)
        blocked = master.device.type == "cpu" if self.blocked is None else self.blocked
        scratch = self._scratch(master.device, background) if blocked else None
        for g, ranges in groups:
            args = _kernel_args(hps[g])
            for o, n in ranges:
                for b0 in range(o, o + n, UPDATE_BLOCK if blocked else max(n, 1)):
                    b1 = min(b0 + UPDATE_BLOCK, o + n) if blocked else o + n
                    gb = scratch[:b1 - b0] if blocked else torch.empty(b1 - b0, dtype=torch.float32,
                                                                        device=master.device)
                    gb.copy_(src[b0:b1])
                    if grad_factor != 1.0:
                        gb.mul_(grad_factor)
                    torch._fused_adamw_([master[b0:b1]], [gb], [exp_avg[b0:b1]], [exp_avg_sq[b0:b1]], [], step,
                                        **args)
                    if param is not None:
                        param[b0:b1].copy_(master[b0:b1])
        self._restore(saved, master, exp_avg, exp_avg_sq)
        if param is not None:     # what no block wrote (gradless ranges, padding) is the master's cast too
            for o, n in [*(r[:2] for r in saved), *_gaps([r for _, ranges in groups for r in ranges],
                                                          master.numel())]:
                param[o:o + n].copy_(master[o:o + n])

    def update_chunk_out(self, param_out: torch.Tensor | None, master: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, states_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
                         grad: torch.Tensor, grad_factor: float, gradless: list[tuple[int, int]],
                         groups: list[tuple[int, list[tuple[int, int]] | None]] | None = None) -> None:
        """``update_chunk`` out of place: the new master and moments go into ``states_out``, the new
        params into ``param_out`` (None: the master is the param chunk); ``grad``, ``master`` and the
        moments are left as they were, so the update can be dropped (``runtime/early_update.py``).
        The same bits as ``update_chunk``; it runs beside the compute (``background``)."""
        groups_ = [(len(self.hps) - 1, None)] if groups is None else groups
        param_out, master, grad = _to_extent(exp_avg.numel(), param_out, master, grad)
        mo, eo, vo = (b[:exp_avg.numel()] for b in states_out)
        # the kernel exactly where ``update_chunk`` would use it: the same bits
        if (self.kernels is not None and len(groups_) == 1 and groups_[0][1] is None
                and self.kernels.wanted(master, grad, param_out, grad_factor)):
            hp = self.hps[groups_[0][0]]
            self.kernels.update(grad, master, exp_avg, exp_avg_sq, hp, coefficients(hp, self.step_count, grad_factor),
                                param_out, states_out=states_out, background=True)
            for o, n in gradless:                  # no gradient: the old values, and their params' cast
                mo[o:o + n].copy_(master[o:o + n])
                eo[o:o + n].copy_(exp_avg[o:o + n])
                vo[o:o + n].copy_(exp_avg_sq[o:o + n])
                if param_out is not None:
                    param_out[o:o + n].copy_(master[o:o + n])
            return
        mo.copy_(master)                         # (the eager path: copies, then the update in place)
        eo.copy_(exp_avg)
        vo.copy_(exp_avg_sq)
        if grad.dtype == torch.float32 and grad_factor != 1.0:
            grad = grad.clone()                  # (its fp32 path scales the gradient in place)
        self.update_chunk(param_out, mo, eo, vo, grad_factor=grad_factor, gradless=gradless, grad=grad, groups=groups,
                          background=True)

    @staticmethod
    def _restore(saved, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Put the gradless ranges' masters and states back (no gradient: no update, no decay)."""
        for o, n, ms, ea, eas in saved:
            master[o:o + n].copy_(ms)
            exp_avg[o:o + n].copy_(ea)
            exp_avg_sq[o:o + n].copy_(eas)

    def _scratch(self, device: torch.device, background: bool) -> torch.Tensor:
        buf = self._scratches.get((device, background))
        if buf is None:
            buf = self._scratches[device, background] = torch.empty(UPDATE_BLOCK, dtype=torch.float32, device=device)
        return buf

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, sd: dict) -> None:
        self.step_count = int(sd["step"])
        for t in self._step_tensors.values():
            t.fill_(self.step_count)


def _to_extent(n: int, param: torch.Tensor | None, *bufs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Chunk-sized buffers cut to a chunk's state extent (its states cover only the elements up
    to its last trainable piece: ``ChunkLayout.state_extent``). The new parameters' padding after
    it is zeroed (``param`` may be a fresh buffer; a fetch carries the padding to the device, where
    the gradient norm reads whole chunks)."""
    if param is not None and param.numel() > n:
        param[n:].zero_()
    return [b if b is None or b.numel() <= n else b[:n] for b in (param, *bufs)]


def is_finite(x: float) -> bool:
    return math.isfinite(x)
