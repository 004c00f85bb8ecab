"""NF4: 4-bit NormalFloat, the format QLoRA keeps a frozen base in (bitsandbytes' ``quant_type="nf4"``).

A tensor is flattened and cut into blocks of ``block`` elements (64, bitsandbytes' default; the
last block may be shorter). Each block keeps its largest magnitude (``absmax``, float32, the
block's statistic) and each element the nearest of the 16 NF4 levels to ``x / absmax``: the
quantiles of a normal distribution scaled to [-1, 1], with an exact zero. Two codes share a byte,
the first element in the high nibble. That is bitsandbytes' layout (``quantize_4bit`` with
``compress_statistics=False``), so a tensor quantized here dequantizes there to the same values and
the other way round (``tests/test_nf4.py`` checks both where bitsandbytes is installed).

    quantize(x, block=64)                      -> Quantized(codes uint8 [(n+1)//2], absmax fp32 [blocks])
    dequantize(q, dtype)                       -> tensor of q.shape in dtype
    Quantized.nbytes                           the bytes it keeps: n/2 + 4 per block (0.5625 B per
                                               element at block 64, 28% of bfloat16's 2 B)

Both are plain tensor code (``torch.bucketize``; a lookup of each byte's two levels and a multiply),
so they run on any device and Inductor fuses ``dequantize`` into one kernel where a compiled
program holds it (``bench/dequant.py`` measures it against a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LEVELS", "Quantized", "quantize", "dequantize", "packed_bytes", "write_piece", "read_piece",
           "dequantize_chunk", "workspace_bytes"]

# the 16 NF4 levels (QLoRA, appendix E; bitsandbytes' table), in code order
LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
          -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
          0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
          0.7229568362236023, 1.0)
# the decision points between neighbours (a value on one takes the lower level)
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(LEVELS, LEVELS[1:]))


@dataclass(frozen=True)
class Quantized:
    """A tensor in NF4: ``codes`` (uint8, two per byte, the first in the high nibble), ``absmax``
    (float32, one per block of ``block`` elements) and the ``shape`` it dequantizes to."""

    codes: torch.Tensor
    absmax: torch.Tensor
    shape: torch.Size
    block: int = 64

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.absmax.numel() * self.absmax.element_size()


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as rows of ``block`` elements, the last padded with zeros (zeros change no absmax)."""
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def quantize(x: torch.Tensor, block: int = 64) -> Quantized:
    """``x`` (any floating dtype and shape) in NF4 with blocks of ``block`` elements."""
    if not x.is_floating_point():
        raise ValueError(f"NF4 quantizes floating-point tensors; this one has dtype {x.dtype}")
    if block < 2 or block % 2:
        raise ValueError(f"NF4 block must be an even number of elements >= 2 (bitsandbytes uses 64), got {block}")
    n = x.numel()
    rows = _blocks(x.detach().reshape(-1).float(), block)
    absmax = rows.abs().amax(dim=1)
    scale = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    normed = (rows * scale[:, None]).reshape(-1)[:n]
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    codes = torch.bucketize(normed, mids).to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    packed = (pairs[:, 0] << 4) | pairs[:, 1]
    return Quantized(packed.contiguous(), absmax.contiguous(), x.shape, block)


def _pair_levels(device: torch.device) -> torch.Tensor:
    """The two levels each byte stands for, by byte: a (256, 2) float32 table (one lookup per byte,
    not per element: twice as fast as looking the nibbles up one by one, eager and through Inductor)."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=device)
    return torch.stack([levels.repeat_interleave(16), levels.repeat(16)], dim=1)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``q`` stands for, in ``dtype`` (each code's level times its block's absmax,
    in float32, then cast)."""
    pairs = torch.index_select(_pair_levels(q.codes.device), 0, q.codes.to(torch.int32)).view(-1)
    values = _blocks(pairs, q.block).mul_(q.absmax[:, None])
    return values.view(-1)[:q.numel].to(dtype).view(q.shape)


# ---- a chunk in NF4: its home on the host, its bytes over the link -----------------------------
# A chunk of ``n`` elements (a multiple of ``block``, as every chunk size is) keeps, in one uint8
# buffer, its codes (n / 2 bytes) and then its blocks' absmax (4 bytes each): the buffer a fetch
# copies. The tensors in it start at multiples of ``block`` (the layout aligns them), so its blocks
# are each tensor's own blocks, the same statistics bitsandbytes keeps per tensor.

BLOCK = 64           # elements a float32 absmax covers: bitsandbytes' default, the only block pscompile keeps
_TABLE_BYTES = 4096   # the (256, 2) float32 level table and the 16 levels it is made from
PIECES = 16        # a chunk dequantizes in this many pieces: the temporaries are a piece's, not a chunk's


def packed_bytes(numel: int, block: int = 64) -> int:
    """Bytes of ``numel`` elements in NF4: the codes and one float32 absmax per block."""
    return (numel + 1) // 2 + 4 * (-(-numel // block))


def chunk_views(buf: torch.Tensor, numel: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8) and absmax (float32) inside a chunk's packed buffer ``buf``."""
    if numel % block or (numel // 2) % 4:
        raise ValueError(f"an NF4 chunk holds a multiple of {block} elements (and of 8), not {numel}")
    codes = buf[:numel // 2]
    absmax = buf[numel // 2:numel // 2 + 4 * (numel // block)].view(torch.float32)
    return codes, absmax


def write_piece(buf: torch.Tensor, numel: int, offset: int, values: torch.Tensor, block: int = 64) -> None:
    """Quantize ``values`` (flat) into the chunk ``buf`` at element ``offset`` (a multiple of ``block``)."""
    if offset % block:
        raise ValueError(f"an NF4 piece starts on a block boundary ({block} elements), not at {offset}")
    q = quantize(values.reshape(-1), block)
    codes, absmax = chunk_views(buf, numel, block)
    codes[offset // 2:offset // 2 + q.codes.numel()].copy_(q.codes)
    absmax[offset // block:offset // block + q.absmax.numel()].copy_(q.absmax.to(absmax.device))


def copy_piece(buf: torch.Tensor, numel: int, offset: int, q: Quantized, start: int, count: int) -> None:
    """Elements ``[start, start + count)`` of the NF4 tensor ``q`` into the chunk ``buf`` at element
    ``offset``, codes and absmax as they are (both starts on a block boundary)."""
    if offset % q.block or start % q.block:
        raise ValueError(f"an NF4 piece starts on a block boundary ({q.block} elements), not at {offset} / {start}")
    codes, absmax = chunk_views(buf, numel, q.block)
    n_codes, n_blocks = (count + 1) // 2, -(-count // q.block)
    codes[offset // 2:offset // 2 + n_codes].copy_(q.codes[start // 2:start // 2 + n_codes])
    absmax[offset // q.block:offset // q.block + n_blocks].copy_(q.absmax[start // q.block:start // q.block + n_blocks])


def read_piece(buf: torch.Tensor, numel: int, offset: int, count: int, dtype: torch.dtype,
               block: int = 64) -> torch.Tensor:
    """Elements ``[offset, offset + count)`` of the chunk ``buf``, dequantized to ``dtype``."""
    codes, absmax = chunk_views(buf, numel, block)
    q = Quantized(codes[offset // 2:offset // 2 + (count + 1) // 2],
                  absmax[offset // block:offset // block + -(-count // block)], torch.Size([count]), block)
    return dequantize(q, dtype)


def workspace_bytes(numel: int, block: int = 64) -> int:
    """Device bytes ``dequantize_chunk`` takes besides the chunk: a copy of its packed bytes, and one
    piece's int32 codes (2 B per element) and float32 values (4 B per element), and the level table."""
    return packed_bytes(numel, block) + 6 * -(-numel // PIECES) + _TABLE_BYTES


def dequantize_chunk(slot: torch.Tensor, block: int = 64, shards: int = 1) -> None:
    """``slot`` (a chunk of compute-dtype elements) holds its packed bytes at its start, as a fetch
    left them: write the values over them, in place. The packed bytes are copied aside first, and
    the values made ``PIECES`` pieces at a time (``workspace_bytes``). ``shards``: the packed bytes
    are that many equal shards' one after another (a ZeRO group all-gathered from its owners)."""
    n = slot.numel()
    s = n // shards
    each = packed_bytes(s, block)
    packed = slot.view(torch.uint8)[:shards * each].clone()
    table = _pair_levels(slot.device)
    step = -(-n // PIECES // block) * block
    for r in range(shards):
        codes, absmax = chunk_views(packed[r * each:(r + 1) * each], s, block)
        out = slot[r * s:(r + 1) * s]
        for a in range(0, s, step):
            b = min(s, a + step)
            pairs = torch.index_select(table, 0, codes[a // 2:b // 2].to(torch.int32)).view(-1, block)
            out[a:b].copy_(pairs.mul_(absmax[a // block:b // block, None]).view(-1))
            del pairs                  # (before the next piece's: one piece's temporaries at a time)
