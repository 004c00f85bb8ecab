"""The order in which a model first uses its parameters, found by a forward on fake tensors.

Chunks are filled in first-use order so that the tensors used together share chunks. Module
pre-forward hooks record which module runs when; the forward runs under ``FakeTensorMode`` with
the parameters swapped for fake tensors, so it costs no real compute or memory and works on a model
built on the meta device. If the model cannot run on fake tensors, the order falls back
to ``named_parameters()`` (construction order, PatrickStar's choice) and says so.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map

from pscompile.runtime.rng import rng_state, set_rng_state


def direct_params(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """module name -> [(full fqn, parameter)] of the parameters it owns directly."""
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        own = [(f"{mname}.{pname}" if mname else pname, p)
               for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
        if own:
            out.setdefault(mname, own)
    return out


class _Run(nn.Module):
    """``run(model, batch)`` as a module, so ``functional_call`` can swap the parameters."""

    def __init__(self, model: nn.Module, run: Callable[[nn.Module, Any], Any]):
        super().__init__()
        self.model = model
        self.run = run

    def forward(self, batch: Any) -> Any:
        return self.run(self.model, batch)


def first_use_order(model: nn.Module, run: Callable[[nn.Module, Any], Any], batch: Any
                    ) -> tuple[list[nn.Parameter], str]:
    """Parameters (each once) in first-use order, and how the order was found."""
    owned = direct_params(model)
    seen: dict[int, nn.Parameter] = {}
    handles = []

    def record(name):
        def hook(mod, args):
            for _, p in owned.get(name, ()):
                seen.setdefault(id(p), p)
        return hook

    for name, mod in model.named_modules(remove_duplicate=False):
        if name in owned:
            handles.append(mod.register_forward_pre_hook(record(name)))
    how = "first use (fake-tensor forward)"
    leaves = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    rng = rng_state(device)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
            # parameters as fake tensors on the batch's device (a meta-device model has no values)
            params = {f"model.{n}": (torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
                                     if p.is_meta else mode.from_tensor(p))
                      for n, p in model.named_parameters()}
            with torch.no_grad():
                functional_call(_Run(model, run), params, (fake,))
    except Exception as e:  # noqa: BLE001 - any failure means: use construction order
        how = f"construction order (fake forward failed: {type(e).__name__})"
    finally:
        for h in handles:
            h.remove()
        set_rng_state(device, rng)
    for p in model.parameters():      # unused parameters go last, in construction order
        seen.setdefault(id(p), p)
    return list(seen.values()), how
