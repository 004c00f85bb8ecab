"""Meta-device models: give their parameters real memory and values, module by module.

A model built under ``torch.device("meta")`` holds no memory. ``materialize_meta`` runs each
module's own ``reset_parameters()`` on CPU memory (the module's default initialisation), keeping
tied parameters tied. Modules without ``reset_parameters`` and meta buffers are refused with an
error naming them.
"""

from __future__ import annotations

from torch import nn


def materialize_meta(model: nn.Module) -> int:
    """Materialize meta parameters in place; returns how many were materialized."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if p.is_meta:
                owners.setdefault(id(p), []).append((mod, name))
    for mname, mod in model.named_modules():
        for bname, b in mod.named_buffers(recurse=False):
            if b.is_meta:
                raise ValueError(f"buffer {mname + '.' if mname else ''}{bname} is on the meta device; pscompile "
                                 "materializes meta parameters only: create buffers with real values")
    if not owners:
        return 0
    done: dict[int, nn.Parameter] = {}
    for mname, mod in model.named_modules():
        metas = {n: p for n, p in mod.named_parameters(recurse=False) if p.is_meta and id(p) not in done}
        if not metas:
            continue
        if not hasattr(mod, "reset_parameters"):
            raise ValueError(
                f"module {mname or type(mod).__name__!r} ({type(mod).__name__}) has parameters on the meta device "
                "and no reset_parameters(); initialise them (e.g. model.to_empty(device='cpu') and your own init) "
                "before compile")
        mod.to_empty(device="cpu", recurse=False)
        mod.reset_parameters()
        for n, old in metas.items():
            done[id(old)] = getattr(mod, n)
    for key, places in owners.items():          # re-tie: every owner gets the one new parameter
        for mod, name in places:
            if getattr(mod, name) is not done[key]:
                setattr(mod, name, done[key])
    return len(owners)
