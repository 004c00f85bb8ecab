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
