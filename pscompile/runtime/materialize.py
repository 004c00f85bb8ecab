"""Meta-device models: give their parameters real memory and values, one module at a time.

A model built under ``torch.device("meta")`` holds no memory. ``check_meta`` refuses what cannot be
materialized (meta buffers, a module with meta parameters and no ``reset_parameters()``) before
anything is built, and counts the meta parameters. ``materialize_module`` then gives one module's
meta parameters CPU memory *in place* (the same ``Parameter`` objects, so ties stay tied) and runs
the module's own ``reset_parameters()`` (its default initialisation), then the model's
``_init_weights(module)`` where the model has one (the Hugging Face convention, which pscompile's
GPT and BERT follow: the values the model would have been built with). The engine does that just
before it copies the module's values into the chunks and frees them, so a model far larger than
the host's memory is never whole on the host.
"""

from __future__ import annotations

import torch
from torch import nn


def check_meta(model: nn.Module) -> int:
    """How many distinct parameters of ``model`` are on the meta device; raises for what
    ``materialize_module`` cannot materialize."""
    for mname, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b.is_meta:
                raise ValueError(f"buffer {mname + '.' if mname else ''}{bname} is on the meta device; pscompile "
                                 "materializes meta parameters only: create buffers with real values")
        if any(p.is_meta for p in mod.parameters(recurse=False)) and not hasattr(mod, "reset_parameters"):
            raise ValueError(
                f"module {mname or type(mod).__name__!r} ({type(mod).__name__}) has parameters on the meta device "
                "and no reset_parameters(); initialise them (e.g. model.to_empty(device='cpu') and your own init) "
                "before compile")
    return len({id(p) for p in model.parameters() if p.is_meta})


def materialize_module(mod: nn.Module, init_weights=None) -> bool:
    """Give ``mod``'s own meta parameters CPU memory and run its ``reset_parameters()``, then
    ``init_weights(mod)`` if given; a parameter it shares with a module done before keeps its
    values (it gets scratch memory while the initialisation runs). True if anything was
    materialized."""
    own = list(mod.named_parameters(recurse=False))
    if not any(p.is_meta for _, p in own):
        return False
    kept = {}
    for name, p in own:
        if not p.is_meta:
            kept[name] = p.data
            p.data = torch.empty(p.shape, dtype=p.dtype)
        else:                 # (a meta tensor cannot take CPU data: swap in a CPU one, same object)
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
    with torch.no_grad():
        mod.reset_parameters()
        if init_weights is not None:
            init_weights(mod)
    for name, data in kept.items():
        getattr(mod, name).data = data
    return True
