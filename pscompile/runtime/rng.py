"""The random number generators a step draws from (dropout): the CPU's and the device's."""

from __future__ import annotations

import torch


def rng_state(device: torch.device) -> dict:
    """The CPU generator's state and, on an accelerator, the device's."""
    out = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        out[device.type] = torch.get_device_module(device).get_rng_state(device)
    return out


def set_rng_state(device: torch.device, state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type != "cpu" and device.type in state:
        torch.get_device_module(device).set_rng_state(state[device.type], device)


def rng_problems(device: torch.device, state) -> list[str]:
    """What keeps ``state`` from being set (checked before anything is loaded)."""
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        return ["rng: no CPU generator state (a dict with 'cpu': a uint8 tensor)"]
    out = []
    want = torch.get_rng_state()
    for name, have, ref in [("cpu", state["cpu"], want)] + (
            [(device.type, state[device.type], torch.get_device_module(device).get_rng_state(device))]
            if device.type != "cpu" and device.type in state else []):
        if not isinstance(have, torch.Tensor) or have.dtype != ref.dtype or have.shape != ref.shape:
            out.append(f"rng[{name!r}]: a {ref.dtype} tensor of shape {tuple(ref.shape)} is needed, got "
                       f"{getattr(have, 'dtype', type(have).__name__)} {tuple(getattr(have, 'shape', ()))}")
            continue
        try:                                 # set on a generator aside first: the bytes must be a state
            torch.Generator(device=device if name != "cpu" else "cpu").set_state(have.cpu())
        except RuntimeError as e:
            out.append(f"rng[{name!r}] is not a generator state ({str(e).splitlines()[0][:80]})")
    return out
