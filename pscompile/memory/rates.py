"""Rates: how fast the device computes and the link copies, for the activation planner's choice.

Recomputing a segment costs its floating-point operations at the device's rate; offloading it
costs its bytes twice (out and back) at the link's rate, less what the copies overlap with compute. ``measure_rates`` times both once on the
machine at hand: a square matmul in the compute dtype, and a device->host copy (unless
``link_bandwidth`` emulates the link, whose rate is then known), and keeps the figures for every
later process on the machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pscompile.config import LINK_PRESETS  # (defined with the Config that names them)

__all__ = ["LINK_PRESETS", "Rates", "best_of", "calibrated_link", "measure_rates"]

REPLACE_FACTOR = 2.0

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
                  *, size: int = 256, copy_bytes: int = 16 << 20, cache: Path | None | bool = None) -> Rates:
    """Time a ``size``-cubed matmul and a ``copy_bytes`` device->host copy (best of three), once per
    machine: the first process to measure keeps its figures in ``cache`` (None: Inductor's cache
    folder; False: measure every time), and every later process on the machine plans with those.

    Plans weigh recomputing against offloading with these rates, and a measurement changes by up to
    a third from one process to the next (a busy machine), enough to flip a choice. Measured in each
    process, the same seeds gave other schedules, so other compiled kernels and other rounding, in
    some processes. Measured once, every process plans the same, unless it measures either rate at
    least ``REPLACE_FACTOR`` times faster (the kept figures came from a busy machine): then its own
    replace them. Delete the file to measure again."""
    rates = _measure(device, dtype, link_bandwidth, size=size, copy_bytes=copy_bytes)
    path = None if cache is False else _rates_path(device, dtype, link_bandwidth, size, copy_bytes,
                                                   None if cache is True else cache)
    if path is None:
        return rates
    kept = _read(path)
    if kept is not None and not _much_faster(rates, kept):
        return kept
    if kept is not None:                             # the kept figures were measured on a busy machine
        _replace(path, rates)
    return _keep_first(path, rates)


def _much_faster(new: Rates, kept: Rates) -> bool:
    """A measurement at least ``REPLACE_FACTOR`` times the kept one in either rate: the kept one came
    from a busy machine (a best of three under load measured 40x under the idle rate here), and is
    replaced. Noise between processes stays well under the factor, so the kept figures hold."""
    return (new.flops_per_s > REPLACE_FACTOR * kept.flops_per_s
            or new.link_bytes_per_s > REPLACE_FACTOR * kept.link_bytes_per_s)


def _read(path: Path) -> Rates | None:
    try:
        return Rates(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None                                  # (none, or unreadable: written anew)


def _replace(path: Path, rates: Rates) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rates_path(device, dtype: torch.dtype, link_bandwidth, size: int, copy_bytes: int, cache: Path | None) -> Path:
    """Where this machine's figures for this measurement are kept: the name hashes everything the
    figures depend on (the device and its model, the dtype, torch's thread count and version)."""
    device = torch.device(device)
    if cache is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        cache = Path(cache_dir())
    if device.type == "cuda":
        model = torch.cuda.get_device_name(device)
    else:
        model = platform.processor() + "|" + _cpu_model()
    what = (device.type, model, str(dtype), torch.get_num_threads(), torch.__version__, link_bandwidth, size, copy_bytes)
    key = hashlib.blake2b(repr(what).encode(), digest_size=8).hexdigest()
    return Path(cache) / "pscompile" / f"rates-{key}.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _keep_first(path: Path, rates: Rates) -> Rates:
    """Write ``rates`` to ``path`` unless another process did first (a new file linked into place,
    which fails where one exists); the figures in the file, whoever wrote them."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(dataclasses.asdict(rates), f)
        try:
            os.link(f.name, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(f.name)
        return Rates(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return rates                                # (no cache to be had: this process's own figures)


def _measure(device: torch.device | str, dtype: torch.dtype, link_bandwidth: float | None, *, size: int,
             copy_bytes: int) -> Rates:
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
