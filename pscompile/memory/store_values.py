"""Parameter and optimizer-state values in and out of a ``ChunkStore``, by parameter name: a mixin.

``load_params`` fills the chunks from tensors (a frozen parameter's straight into its compute-dtype
home: it has no master; a weight loaded in 4 bits, an ``nf4.Quantized``, byte for byte into its NF4 home), ``gather`` reads one tensor back from a chunk list (a frozen one's weight
from its home, which is never written after loading) and ``scatter`` writes one into an optimizer
list (``load_state_dict``).
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch

from pscompile.memory import nf4
from pscompile.memory.disk_states import LISTS
from pscompile.memory.tiers import Tier

# which of a chunk's buffers: its compute-dtype parameters, or one of its fp32 optimizer lists
BufferKind = Literal["param", "master", "exp_avg", "exp_avg_sq"]


class StoreValues:
    """Mixin of ``ChunkStore``: values by parameter name (the module docstring)."""

    def open_home(self, c: int, *, read: bool = True) -> torch.Tensor:
        """Chunk ``c``'s parameters at home (compute-dtype or packed): its host buffer, or its disk
        home opened (``read=False``: to be overwritten whole); ``close_home`` after use."""
        return self.param_disk.open(c, read=read) if self.disk_homed(c) else self.host_param[c]

    # ---- filling -------------------------------------------------------------------------
    def load_params(self, params: Mapping[str, torch.Tensor], *, flush: bool = True) -> None:
        """Copy parameter values (any float dtype) into the fp32 master chunks and the
        compute-dtype chunks (the cast of the master); ``flush``: write the disk tier's caches
        back (False while filling module by module: once at the end, not once per module)."""
        touched = set()
        for fqn, value in params.items():
            e = self.layout.entry(fqn)
            if isinstance(value, nf4.Quantized):
                touched.update(self._write_codes(e, value))
                continue
            flat = value.detach().reshape(-1)
            for p in e.pieces:
                src = flat[p.tensor_offset:p.tensor_offset + p.numel]
                touched.add(p.chunk)
                if not self.kind(p.chunk).master:   # no master: the compute-dtype copy is the weight
                    self._write_frozen(p.chunk, p.chunk_offset, src)
                    continue
                master = self._states(p.chunk, write=True)[0][p.chunk_offset:p.chunk_offset + p.numel]
                if self.device_homed(p.chunk):      # straight to its home on the device
                    self.copies.move(master, src, "h2d")
                elif self.disk_homed(p.chunk):
                    master.copy_(src)
                    self.param_disk.open(p.chunk)[p.chunk_offset:p.chunk_offset + p.numel].copy_(master)
                    self.param_disk.close(p.chunk, dirty=True)
                else:
                    master.copy_(src)
                    if not self.shares_master(p.chunk):
                        self.host_param[p.chunk][p.chunk_offset:p.chunk_offset + p.numel].copy_(master)
        for c in touched:
            self.drop(c)
        if flush:
            self.flush_disk()

    def _write_codes(self, e, q: nf4.Quantized) -> list[int]:
        """An NF4 tensor's codes and absmax (a base loaded in 4 bits) copied as they are into its
        pieces' packed chunks; the chunks written."""
        if not e.quantized or q.shape != e.shape or q.block != nf4.BLOCK:
            raise ValueError(f"{e.fqn!r}: 4-bit codes of shape {tuple(q.shape)} (block {q.block}) for an entry "
                             f"of shape {tuple(e.shape)} kept {'in NF4' if e.quantized else 'in the compute dtype'}")
        for p in e.pieces:
            nf4.copy_piece(self.open_home(p.chunk), self.layout.chunk_size, p.chunk_offset, q, p.tensor_offset, p.numel)
            self.close_home(p.chunk, dirty=True)
        return [p.chunk for p in e.pieces]

    def _write_frozen(self, c: int, offset: int, src: torch.Tensor) -> None:
        """Frozen chunk ``c``'s weights at ``offset``, cast to the compute dtype, in its home."""
        home = self.open_home(c)
        if self.packed(c):
            nf4.write_piece(home, self.layout.chunk_size, offset, src)
        else:
            home[offset:offset + src.numel()].copy_(src)
        self.close_home(c, dirty=True)


    def gather(self, which: BufferKind, fqn: str) -> torch.Tensor:
        """A CPU fp32 (or compute dtype for ``which='param'``) copy of one tensor from a chunk list."""
        e = self.layout.entry(fqn)
        if not e.kind.master:
            if which not in ("master", "param"):
                raise KeyError(f"{fqn!r} is frozen (requires_grad=False): it has no {which}")
            return self._frozen_weight(e, torch.float32 if which == "master" else self.dtype)
        out = torch.empty(e.numel, dtype=self.dtype if which == "param" else torch.float32)
        for p in e.pieces:
            opened = which == "param" and self.disk_homed(p.chunk) and not self.resident(p.chunk)
            src = (self.param_disk.open(p.chunk) if opened else self.current(p.chunk) if which == "param"
                   else self._states(p.chunk)[LISTS.index(which)])
            dst, piece = out[p.tensor_offset:p.tensor_offset + p.numel], src[p.chunk_offset:p.chunk_offset + p.numel]
            if src.device != dst.device or self._on_device(which, p.chunk):
                self.copies.move(dst, piece, "d2h")          # a device tier's bytes cross to the host
            else:
                dst.copy_(piece)
            if opened:
                self.close_home(p.chunk)
        return out.view(e.shape)

    def _frozen_weight(self, e, dtype: torch.dtype) -> torch.Tensor:
        """A frozen parameter's weight, read from its home (never written after loading, so the
        home is its truth and no device copy in flight is touched)."""
        out = torch.empty(e.numel, dtype=dtype)
        for p in e.pieces:
            src = self.open_home(p.chunk)
            piece = (nf4.read_piece(src, self.layout.chunk_size, p.chunk_offset, p.numel, dtype) if self.packed(p.chunk)
                     else src[p.chunk_offset:p.chunk_offset + p.numel])
            out[p.tensor_offset:p.tensor_offset + p.numel].copy_(piece)
            self.close_home(p.chunk)
        return out.view(e.shape)

    def codes(self, fqn: str, homes: Mapping[int, torch.Tensor] | None = None) -> nf4.Quantized:
        """An NF4 parameter's codes and absmax, copied out of its home (what ``_write_codes`` wrote),
        or out of ``homes`` (chunk -> its packed bytes whole: ZeRO's, gathered from the ranks)."""
        e = self.layout.entry(fqn)
        if not e.quantized:
            raise KeyError(f"{fqn!r} is not kept in NF4: it has no codes")
        codes = torch.empty((e.numel + 1) // 2, dtype=torch.uint8)
        absmax = torch.empty(-(-e.numel // nf4.BLOCK), dtype=torch.float32)
        for p in e.pieces:
            home = self.open_home(p.chunk) if homes is None else homes[p.chunk]
            c, a = nf4.chunk_views(home, self.layout.chunk_size)
            n_codes, n_blocks = (p.numel + 1) // 2, -(-p.numel // nf4.BLOCK)
            codes[p.tensor_offset // 2:p.tensor_offset // 2 + n_codes] = c[p.chunk_offset // 2:p.chunk_offset // 2 + n_codes]
            absmax[p.tensor_offset // nf4.BLOCK:p.tensor_offset // nf4.BLOCK + n_blocks] = \
                a[p.chunk_offset // nf4.BLOCK:p.chunk_offset // nf4.BLOCK + n_blocks]
            if homes is None:
                self.close_home(p.chunk)
        return nf4.Quantized(codes, absmax, torch.Size(e.shape), nf4.BLOCK)

    def _on_device(self, which: BufferKind, c: int) -> bool:
        return self.resident(c) if which == "param" else self.os_tier[c] is Tier.DEVICE

    def scatter(self, which: BufferKind, fqn: str, value: torch.Tensor) -> None:
        """Write one tensor into an optimizer-state chunk list (used by load_state_dict)."""
        e = self.layout.entry(fqn)
        flat = value.detach().reshape(-1)
        for p in e.pieces:
            dst = self._states(p.chunk, write=True)[LISTS.index(which)][p.chunk_offset:p.chunk_offset + p.numel]
            piece = flat[p.tensor_offset:p.tensor_offset + p.numel]
            if self.os_tier[p.chunk] is Tier.DEVICE:
                self.copies.move(dst, piece, "h2d")
            else:
                dst.copy_(piece)
