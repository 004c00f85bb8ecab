"""The order in which a model first uses its parameters, found by a forward on fake tensors.

Chunks are filled in first-use order so that the tensors used together share chunks. Module
pre-forward hooks record which module runs when; the forward runs under ``FakeTensorMode`` so it
costs no real compute or memory. If the model cannot run on fake tensors, the order falls back
to ``named_parameters()`` (construction order, PatrickStar's choice) and says so.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map


def direct_params(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """module name -> [(full fqn, parameter)] of the parameters it owns directly."""
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        own = [(f"{mname}.{pname}" if mname else pname, p)
               for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False)]
        if own:
            out.setdefault(mname, own)
    return out


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
    rng = torch.get_rng_state()
    how = "first use (fake-tensor forward)"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, batch)
            with torch.no_grad():
                run(model, fake)
    except Exception as e:  # noqa: BLE001 - any failure means: use construction order
        how = f"construction order (fake forward failed: {type(e).__name__})"
    finally:
        for h in handles:
            h.remove()
        torch.set_rng_state(rng)
    for p in model.parameters():      # unused parameters go last, in construction order
        seen.setdefault(id(p), p)
    return list(seen.values()), how
