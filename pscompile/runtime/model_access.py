"""The model while it trains: a mixin of ``ChunkEngine``.

While an engine trains, the user's module holds placeholders (its weights are in the chunks).
``materialize()`` puts the current weights into the module for a block of the user's code
(generation, an evaluation of their own, ``save_pretrained``) and takes them back out after;
``save_pretrained`` (Hugging Face models) and ``export`` (safetensors, any model) are built on it.

Cost: the whole model once, in the dtype asked for (fp32 by default: 4 bytes a parameter), on the
device asked for (the compute device by default; ``device="cpu"`` for a model larger than the
device), for as long as the block runs; under ZeRO every rank gathers the full masters (one
all-gather). Nothing the block does to the weights is kept: they are the engine's, and the next
step trains on the chunks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from pscompile.dist import checkpoint as shard_ckpt
from pscompile.runtime import bnb4bit


class ModelAccess:
    """Mixin of ``ChunkEngine``: ``materialize``, ``save_pretrained`` and ``export``, and the
    weights given back at ``close``."""

    def _init_model_access(self) -> None:
        """Each parameter's own device and dtype (the weights go back to them), and the NaN that
        released parameters show: one element broadcast to their shape, so any use outside the
        engine's access gives NaN instead of stale values (``_released``)."""
        self._orig = {fqn: (p.device, p.dtype) for fqn, p in self.params.items()}
        self._dummy = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)

    def _released(self, shape) -> torch.Tensor:
        """What a released parameter of ``shape`` points at (NaN, no memory of its own)."""
        return self._dummy.expand(shape)

    @contextlib.contextmanager
    def materialize(self, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
        """Within the ``with`` block the model holds the current weights (after every queued
        update) in ``dtype`` on ``device`` (default: the compute device) and can run as a plain
        module; afterwards it holds placeholders again. A collective under ZeRO. Steps,
        evaluations and checkpoints are refused inside the block."""
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"materialize(dtype={dtype}): use torch.float32 (the masters) or a 16-bit dtype")
        device = self.device if device is None else torch.device(device)
        with self.exclusive("materialize"):
            self._check_open()
            self._apply_queued_updates()
            full = self._full_masters() if self.comm is not None else None     # a collective
            buffers = _move_buffers(self.model, device) if device != self.device else []
            try:
                with torch.no_grad():
                    for fqn, p in self.params.items():
                        w = full[fqn] if full is not None else self.store.gather("master", fqn)
                        p.data = w.to(device=device, dtype=dtype)
                yield self.model
            finally:
                for p in self.params.values():
                    p.data = self._released(p.shape)
                for mod, name, buf, persistent in buffers:
                    mod.register_buffer(name, buf, persistent=persistent)
                self._count_outside_steps()

    def save_pretrained(self, folder: str | os.PathLike, **kwargs) -> Path:
        """A Hugging Face model's ``save_pretrained(folder)`` with the current fp32 weights
        (materialized on the host; rank 0 writes under ZeRO, every rank calls it)."""
        if not hasattr(self.model, "save_pretrained"):
            raise ValueError(f"save_pretrained: the model is a {type(self.model).__name__}, not a Hugging Face "
                             "PreTrainedModel; engine.export(path) writes any model's weights as safetensors")
        folder = Path(folder)
        with self.materialize(device="cpu") as model:
            if self.rank == 0:
                model.save_pretrained(folder, **kwargs)
        return folder

    def export(self, path: str | os.PathLike) -> Path:
        """The model's state dict with the current fp32 weights (buffers as they are), written as
        one safetensors file at ``path`` through a temporary file and a rename (rank 0 writes
        under ZeRO, every rank calls it). ``safetensors.torch.load_file(path)`` reads it back;
        ``model.load_state_dict`` takes it."""
        try:
            from safetensors.torch import save
        except ImportError as e:
            raise ImportError("engine.export writes safetensors: pip install safetensors") from e
        from pscompile.checkpoint.files import write_atomic
        state = self.full_state_dict()                     # (a collective under ZeRO)
        path = Path(path)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, save({k: v.contiguous() for k, v in state.items()}))
        return path


    def _give_back(self) -> None:
        """Each parameter gets its fp32 master in its original dtype and device; one built on the
        meta device goes back there (it held no values before either, and such a model may not fit
        in host memory: ``pscompile.save`` or ``engine.export`` keep the weights); a layer loaded in
        4 bits gets its codes back from the chunks."""
        with torch.no_grad():
            meta = {fqn for fqn, (device, _) in self._orig.items() if device.type == "meta"}
            for fqn in meta:
                p = self.params[fqn]
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=self._orig[fqn][1], device="meta"),
                                                         p.requires_grad))
            names = {id(p): fqn for fqn, p in self.params.items()}
            homes = None       # (ZeRO: a layer loaded in 4 bits takes its codes from every rank's shards)
            if self.comm is not None and bnb4bit.taken(self.model):
                homes = shard_ckpt.full_packed(self.store, self.comm)
            bnb4bit.give_back(self.model, lambda w: self.store.codes(names[id(w)], homes))
            if self.comm is not None:      # a collective: every rank closes its engine
                full = self._full_masters()
                for fqn, p in self.params.items():
                    if fqn not in meta:
                        p.data = full[fqn].to(*self._orig[fqn])
                return
            for fqn, p in self.params.items():
                if fqn not in meta:
                    p.data = self.store.gather("master", fqn).to(*self._orig[fqn])

    def _full_masters(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master, whole, on every rank (ZeRO: one all-gather)."""
        groups = shard_ckpt.full_groups(self.store, self.comm)
        out = {}
        for e in self.layout.entries:
            flat = torch.empty(e.numel, dtype=torch.float32)
            for p in e.pieces:
                flat[p.tensor_offset:p.tensor_offset + p.numel] = groups[p.chunk][p.chunk_offset:p.chunk_offset + p.numel]
            out[e.fqn] = flat.view(e.shape)
        return out

def _move_buffers(model: torch.nn.Module, device: torch.device) -> list:
    """Move the model's buffers to ``device``; what puts them back."""
    out = []
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                persistent = name not in mod._non_persistent_buffers_set
                out.append((mod, name, buf, persistent))
                mod.register_buffer(name, buf.to(device), persistent=persistent)
    return out
