"""Rates: how fast the device computes and the link copies, for the activation planner's choice.

Recomputing a segment costs its floating-point operations at the device's rate; offloading it
costs its bytes twice (out and back) at the link's rate, less what the copies overlap with compute. ``measure_rates`` times both once on the
machine at hand: a square matmul in the compute dtype, and a device->host copy (unless
``link_bandwidth`` emulates the link, whose rate is then known).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pscompile.config import LINK_PRESETS  # (defined with the Config that names them)

__all__ = ["LINK_PRESETS", "Rates", "best_of", "calibrated_link", "measure_rates"]

# LINK_PRESETS: FLOP of compute per byte over the device<->host link, per accelerator (its dense
# 16-bit tensor peak over its PCIe x16 bandwidth). ``link_bandwidth="v100"`` gives the CPU an
# emulated link with the same ratio to this machine's measured matmul rate (``calibrated_link``).


@dataclass(frozen=True)
class Rates:
    flops_per_s: float        # the device's compute rate (matmul, compute dtype)
    link_bytes_per_s: float   # device <-> host copies

    def recompute_s(self, flops: int) -> float:
        return flops / self.flops_per_s

    def offload_s(self, nbytes: int, overlap_flops: int = 0) -> float:
        """The time offloading ``nbytes`` adds: out after the forward and back before the backward,
        each copy hidden behind compute as far as it goes. Copies run one ahead (``offload_activations``),
        so the way out overlaps about the next segment's forward and the way back the previous
        segment's backward; ``overlap_flops`` (the segment's own forward, a stand-in for its
        neighbour's) and twice that are the compute they hide behind."""
        copy = nbytes / self.link_bytes_per_s
        hidden = overlap_flops / self.flops_per_s
        return max(0.0, copy - hidden) + max(0.0, copy - 2 * hidden)

    def describe(self) -> str:
        return f"{self.flops_per_s / 1e9:.1f} GFLOP/s compute, {self.link_bytes_per_s / 1e9:.2f} GB/s link"


def best_of(fn, repeats: int = 3) -> float:
    fn()                                   # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_rates(device: torch.device | str, dtype: torch.dtype, link_bandwidth: float | None = None,
                  *, size: int = 256, copy_bytes: int = 16 << 20) -> Rates:
    """Time a ``size``-cubed matmul and a ``copy_bytes`` device->host copy (best of three)."""
    device = torch.device(device)
    sync = torch.get_device_module(device).synchronize if device.type != "cpu" else (lambda: None)
    g = torch.Generator().manual_seed(0)       # the global generators (dropout's) are left alone
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)

    def matmul():
        torch.mm(a, b)
        sync()
    flops = 2 * size ** 3 / best_of(matmul)
    if link_bandwidth is not None:
        return Rates(flops, float(link_bandwidth))
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def copy():
        dst.copy_(src)
        sync()
    return Rates(flops, copy_bytes / best_of(copy))


def calibrated_link(preset: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Bytes/s of a link as slow, relative to this machine's measured matmul rate (``dtype``, the
    current torch thread count), as ``preset``'s PCIe link is relative to its accelerator: the rate
    divided by the preset's FLOP per byte (``LINK_PRESETS``). A 512-cubed matmul, best of three."""
    key = preset.lower()
    if key not in LINK_PRESETS:
        raise ValueError(f"link_bandwidth={preset!r} is not a rate or a preset; use e.g. '50MB/s' or one of "
                         f"{sorted(LINK_PRESETS)}")
    flops = measure_rates(device, dtype, link_bandwidth=1.0, size=512).flops_per_s
    return flops / LINK_PRESETS[key][1]
