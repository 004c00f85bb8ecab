"""A base that bitsandbytes loaded in 4 bits (QLoRA), taken as it is.

This is the model QLoRA users build:
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4"))``, then ``peft``'s LoRA. Its linear layers are bitsandbytes
``Linear4bit`` modules, and their weights are ``Params4bit`` (uint8 codes and a ``quant_state``).

``adopt(model)`` replaces each such layer by a ``Loaded4bitLinear``. That is an ``nn.Linear`` whose
frozen weight sits on the meta device, so it holds no values. The layer's codes and per-block
absmax are kept as ``source`` until the engine copies them into its NF4 chunks, byte for byte
(``take_packed``). A nested absmax (bitsandbytes' ``bnb_4bit_use_double_quant``) is dequantized once,
here.

pscompile's NF4 (``memory/nf4.py``) is bitsandbytes' own: the same levels, block 64, two codes a byte,
the first in the high nibble, and a float32 absmax per block. So nothing is quantized again, and the
adapters train against the weights that were loaded.

The layer computes as ``Linear4bit`` does:
- the input is cast to the layer's ``compute_dtype``;
- the weight (the engine gives it, dequantized on the device) and the bias are cast to that dtype;
- the output is cast back to the input's dtype.

Every layer is checked before any is replaced: NF4 with blocks of 64, already quantized. A model
with no bitsandbytes layer is left untouched, and bitsandbytes is never imported for it.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pscompile.memory import nf4


class Loaded4bitLinear(nn.Linear):
    """A bitsandbytes ``Linear4bit`` whose weight the engine keeps in NF4 chunks. ``source`` holds
    the loaded codes until the engine takes them."""

    def __init__(self, layer: nn.Module, source: nf4.Quantized, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype, device="meta"),
                                   requires_grad=False)
        self.bias = layer.bias                       # (the same Parameter: optimizers and ties keep it)
        self.compute_dtype = getattr(layer, "compute_dtype", None)
        self.source: nf4.Quantized | None = source

    def reset_parameters(self) -> None:
        raise RuntimeError("a layer loaded in 4 bits keeps its loaded weights; it has no initialisation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        weight = self.weight
        if weight.is_meta:            # (not taken by an engine yet: the loaded codes, dequantized for this call)
            if self.source is None:
                raise RuntimeError("this layer was loaded in 4 bits and its weights live in a pscompile engine's "
                                   "NF4 chunks; run the model through the engine (engine.step, engine.evaluate), "
                                   "or inside engine.materialize() for code of your own")
            weight = nf4.dequantize(self.source, self.weight.dtype).to(x.device)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight.to(x.dtype), bias).to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, NF4 (loaded by bitsandbytes), compute_dtype={self.compute_dtype}"


def adopt(model: nn.Module) -> int:
    """Replace every bitsandbytes ``Linear4bit`` in ``model`` (under each name it has) by a
    ``Loaded4bitLinear``; how many were replaced. Raises, with nothing replaced, for a layer
    pscompile cannot keep as it was loaded."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:                      # (no bitsandbytes imported: no layer of its kind exists)
        return 0
    names: dict[int, list[str]] = {}
    layers: dict[int, nn.Module] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, bnb.nn.Linear4bit):
            names.setdefault(id(m), []).append(name)
            layers[id(m)] = m
    replaced = {key: Loaded4bitLinear(m, _source(names[key][0], m, bnb), _state(m).dtype)
                for key, m in layers.items()}
    for key, new in replaced.items():
        for name in names[key]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
    return len(replaced)


def take_packed(module: nn.Module) -> dict[str, nf4.Quantized]:
    """The values of ``module``'s own parameters that are codes, not floats: ``{"weight": codes}``
    for a ``Loaded4bitLinear`` (given once: the module drops them, the chunks own them from then on),
    ``{}`` for any other module."""
    if not isinstance(module, Loaded4bitLinear):
        return {}
    if module.source is None:
        raise ValueError("a layer loaded in 4 bits has had its codes taken by an engine already: its weights "
                         "live in that engine's chunks. Compile the model once; to train it again, load it again")
    source, module.source = module.source, None
    weight = module.weight         # (a meta tensor takes no host data: a stand-in of no memory, the same object)
    torch.utils.swap_tensors(weight, nn.Parameter(torch.zeros(1, dtype=weight.dtype).expand(weight.shape),
                                                  requires_grad=False))
    return {"weight": source}


def taken(model: nn.Module) -> bool:
    """Some ``Loaded4bitLinear`` of ``model`` has had its codes taken by an engine."""
    return any(isinstance(m, Loaded4bitLinear) and m.source is None for m in model.modules())


def give_back(model: nn.Module, codes_of: Callable[[nn.Parameter], nf4.Quantized]) -> None:
    """Each ``Loaded4bitLinear`` whose codes an engine took gets them back (``codes_of(weight)``,
    read from the engine's chunks), so the model is again as it was loaded."""
    for m in model.modules():
        if isinstance(m, Loaded4bitLinear) and m.source is None:
            m.source = codes_of(m.weight)


def _state(layer: nn.Module):
    return getattr(layer.weight, "quant_state", None)


def _source(name: str, layer: nn.Module, bnb) -> nf4.Quantized:
    """The layer's codes and float32 absmax, checked."""
    where = f"bitsandbytes Linear4bit {name!r}"
    state = _state(layer)
    if state is None or layer.weight.dtype != torch.uint8:
        raise ValueError(f"{where} holds no 4-bit weights yet (bitsandbytes quantizes when the layer moves to a "
                         "device); load the model with quantization_config=BitsAndBytesConfig(load_in_4bit=True) "
                         "and device_map, or call .to(device) on it, before pscompile.compile")
    if state.quant_type != "nf4":
        raise ValueError(f"{where} is quantized as {state.quant_type!r}; pscompile keeps 4-bit weights in NF4 "
                         "only: load it with BitsAndBytesConfig(bnb_4bit_quant_type='nf4')")
    if state.blocksize != nf4.BLOCK:
        raise ValueError(f"{where} has blocks of {state.blocksize} elements; pscompile's NF4 has blocks of "
                         f"{nf4.BLOCK} (bitsandbytes' default): load it with the default block size")
    shape = torch.Size(state.shape)
    if getattr(state, "packing_format_for_cpu", False):
        codes, absmax = _from_cpu_packing(layer.weight.detach(), state.absmax, shape)
    else:
        codes, absmax = layer.weight.detach().reshape(-1), state.absmax
        if state.nested:              # double quantization: the absmax are themselves 8-bit blocks
            absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    # (on the host, where the chunks' homes are: a layer loaded on a GPU frees its memory there)
    return nf4.Quantized(codes.cpu(), absmax.float().reshape(-1).cpu(), shape, nf4.BLOCK)


_TILE = 32       # rows of a tile in bitsandbytes' CPU inference layout


def _from_cpu_packing(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size):
    """The standard codes and absmax of a layer bitsandbytes has repacked for its AVX512-BF16 CPU
    kernel (its first forward in eval mode, without gradients, does that): ``packed`` [N, K/2] holds
    each tile of 32 rows by 2 columns (64 codes, row by row) as 32 bytes, the tile's first 32 codes
    in the low nibbles and its last 32 in the high ones; the absmax is [K/64, N] in bfloat16 (a
    nested one dequantized first). The codes come back exactly; the absmax are the bfloat16 values
    the layer computes with from then on (re-quantizing them, as saving the layer does, would
    change them again)."""
    n, k = shape
    tiles = packed.reshape(-1, _TILE)
    tiles = torch.cat([tiles & 0xF, tiles >> 4], dim=-1)                   # [tiles, 64]: (row, column)
    codes = tiles.reshape(n // _TILE, k // 2, _TILE, 2).transpose(1, 2).reshape(-1)     # row-major [N, K]
    return (codes[0::2] << 4) | codes[1::2], absmax.T.reshape(-1)
