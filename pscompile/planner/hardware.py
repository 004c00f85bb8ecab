"""Hardware: what a machine offers the planner (memory per tier, compute rate, link rates).

Every figure is per GPU except ``cpu_memory``, ``cpu_bandwidth`` and ``disk`` (the node's,
shared by its GPUs). Rates are the ones the cost model (``planner/cost.py``) charges:

- compute: ``peak_flops`` (the GPU's dense 16-bit tensor peak) times ``efficiency``, for matmuls,
  convolutions and attention; every other node moves its bytes at ``memory_bandwidth``; each
  executed node also costs ``op_overhead_s`` (kernel launch);
- transfers: ``pcie`` bytes/s in each direction between a GPU and the host (PCIe is full duplex),
  ``interconnect`` for ZeRO collectives between GPUs of the node;
- the host optimizer: AdamW streams about ``ADAM_BYTES_PER_PARAM`` bytes per parameter through
  ``cpu_bandwidth``; optimizer states on the GPU stream them through ``memory_bandwidth``.

The presets' link figures are what pinned copies reach over PCIe (about 3/4 of the wire rate:
12 GB/s on gen 3, 24 on gen 4, 48 on gen 5, ``PCIE``); the paper machines' memory sizes and
GPUs are the papers' (docs/paper-scale.md). ``efficiency``, ``cpu_bandwidth`` and
``op_overhead_s`` are assumptions, stated here once: a planner's answer is only as good as them.
``calibrated`` measures them on the machine at hand instead (CPU as the device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pscompile.memory.rates import best_of
from pscompile.units import parse_rate, parse_size

__all__ = ["Hardware", "HARDWARE", "PCIE", "ADAM_BYTES_PER_PARAM", "hardware_preset", "calibrated"]

GiB = 1 << 30
PCIE = {3: 12e9, 4: 24e9, 5: 48e9}        # bytes/s one way, pinned memory, x16
# AdamW per parameter: reads the fp32 master, exp_avg, exp_avg_sq and gradient, writes the first
# three and the compute-dtype parameter (4 * 4 + 4 + 3 * 4 + 2, rounded)
ADAM_BYTES_PER_PARAM = 34


@dataclass(frozen=True)
class Hardware:
    """One node: ``gpus`` accelerators with ``gpu_memory`` bytes each, ``cpu_memory`` bytes of
    host RAM shared by them, an optional ``disk`` (bytes) for optimizer states."""

    name: str
    gpus: int
    gpu_memory: int                  # bytes per GPU, as the device reports it
    cpu_memory: int                  # bytes of host RAM for the whole node
    peak_flops: float                # dense 16-bit tensor FLOP/s per GPU
    memory_bandwidth: float          # GPU memory bytes/s
    pcie: float                      # host <-> GPU bytes/s per direction, per GPU
    interconnect: float              # GPU <-> GPU bytes/s per GPU (NVLink, or PCIe through the host)
    cpu_bandwidth: float             # host RAM bytes/s (the host optimizer's bound)
    disk: int | None = None          # bytes of disk for optimizer states (None: no disk tier)
    disk_bandwidth: float = 2e9      # bytes/s
    efficiency: float = 0.5          # fraction of peak_flops matmuls reach
    op_overhead_s: float = 5e-6      # per executed graph node (launch)
    reserved: int = 1 * GiB          # per GPU: CUDA context, allocator slack; not for the plan
    note: str = ""

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"Hardware.gpus={self.gpus} must be at least 1")
        for f in ("gpu_memory", "cpu_memory"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)} must be a positive number of bytes")
        if self.gpu_memory <= self.reserved:
            raise ValueError(f"Hardware.gpu_memory={self.gpu_memory} leaves nothing after reserved={self.reserved}")
        for f in ("peak_flops", "memory_bandwidth", "pcie", "interconnect", "cpu_bandwidth", "disk_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)} must be a positive rate")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Hardware.efficiency={self.efficiency} must be in (0, 1]")

    @property
    def device_budget(self) -> int:
        """``device_memory`` for each GPU's plan: its memory less ``reserved``."""
        return self.gpu_memory - self.reserved

    @property
    def host_budget(self) -> int:
        """``host_memory`` for each GPU's plan: its share of the node's RAM."""
        return self.cpu_memory // self.gpus

    def with_(self, *, gpus: int | None = None, gpu_memory: int | str | None = None,
              cpu_memory: int | str | None = None, disk: int | str | None = None) -> "Hardware":
        """This machine with other counts or sizes (strings like "32GB" are parsed)."""
        kw: dict = {}
        if gpus is not None:
            kw["gpus"] = int(gpus)
        if gpu_memory is not None:
            kw["gpu_memory"] = parse_size(gpu_memory, "gpu_memory")
        if cpu_memory is not None:
            kw["cpu_memory"] = parse_size(cpu_memory, "cpu_memory")
        if disk is not None:
            kw["disk"] = parse_size(disk, "disk")
        return replace(self, **kw)

    def describe(self) -> str:
        disk = f", {self.disk / 1e12:.1f} TB disk" if self.disk else ""
        return (f"{self.name}: {self.gpus} x {self.gpu_memory / GiB:.0f} GiB GPU "
                f"({self.peak_flops / 1e12:.0f} TFLOP/s peak, {self.efficiency:.0%} assumed), "
                f"{self.cpu_memory / GiB:.0f} GiB CPU{disk}, PCIe {self.pcie / 1e9:.0f} GB/s, "
                f"GPU-GPU {self.interconnect / 1e9:.0f} GB/s")


def _preset(name, gpus, gpu_gib, cpu_gib, peak, hbm, pcie_gen, interconnect, cpu_bw, note, **kw) -> Hardware:
    return Hardware(name=name, gpus=gpus, gpu_memory=int(gpu_gib * GiB), cpu_memory=int(cpu_gib * GiB),
                    peak_flops=peak, memory_bandwidth=hbm, pcie=PCIE[pcie_gen], interconnect=interconnect,
                    cpu_bandwidth=cpu_bw, note=note, **kw)


# The papers' machines (PatrickStar: YARD, SuperPod, the $700 PC; ANGEL-PTM's server) and today's.
HARDWARE: dict[str, Hardware] = {
    "yard": _preset("yard", 8, 32, 240e9 / GiB, 125e12, 900e9, 3, 150e9, 100e9,
                    "PatrickStar's YARD node: 8x V100 32 GB (NVLink), a 12-core CPU with 240 GB memory"),
    "superpod": _preset("superpod", 8, 40, 1024, 312e12, 1555e9, 4, 300e9, 200e9,
                        "PatrickStar's SuperPod node: 8x A100 40 GB (NVLink), a 192-core CPU with 1 TB memory"),
    "pc700": _preset("pc700", 1, 8, 16, 52e12, 336e9, 3, 12e9, 25e9,
                     "the $700 PC of PatrickStar's first version: one RTX 2060 8 GB, a Ryzen 7 3700X with 16 GB"),
    "angel": _preset("angel", 8, 40, 1024, 312e12, 1555e9, 4, 300e9, 200e9,
                     "ANGEL-PTM's server: 8x A100 40 GB (NVLink 3), 4x 48-core EPYC with 1 TB, 11 TB SSD "
                     "(3.5 GB/s)", disk=int(11e12), disk_bandwidth=3.5e9),
    # DGX-class nodes carry 8 NVMe drives (30.72 TB); 25 GB/s for them together is an assumption
    # (about 3 GB/s a drive, reads and writes mixed), not a measurement
    "h100": _preset("h100", 8, 80, 2048, 989e12, 3350e9, 5, 450e9, 300e9,
                    "an 8x H100 80 GB SXM node (DGX H100-like), 2 TB CPU memory, 30.7 TB NVMe (25 GB/s assumed)",
                    disk=int(30.72e12), disk_bandwidth=25e9),
    "h200": _preset("h200", 8, 141, 2048, 989e12, 4800e9, 5, 450e9, 300e9,
                    "an 8x H200 141 GB node, 2 TB CPU memory, 30.7 TB NVMe (25 GB/s assumed)",
                    disk=int(30.72e12), disk_bandwidth=25e9),
}


def hardware_preset(name: str) -> Hardware:
    key = name.strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not a preset; use one of {sorted(HARDWARE)} or build a Hardware(...)")
    return HARDWARE[key]


def calibrated(*, gpu_memory: int | str, cpu_memory: int | str, link_bandwidth: float | str | None,
               dtype: torch.dtype = torch.float32, matmul: int = 256) -> Hardware:
    """This machine as the planner's hardware, its CPU the device (``device="cpu"``), every rate
    measured: a ``matmul``-cubed matmul in ``dtype`` (``efficiency`` 1: the measured rate is the
    rate), a 64 MiB copy (memory and host bandwidth), the cost of one small eager op (per-node
    overhead), and ``link_bandwidth`` as ``Config.link_bandwidth`` emulates it (None: the copy rate)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(matmul, matmul, generator=g, dtype=dtype)
    b = torch.randn(matmul, matmul, generator=g, dtype=dtype)
    flops = 2 * matmul ** 3 / best_of(lambda: torch.mm(a, b))
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_bw = src.numel() / best_of(lambda: dst.copy_(src))
    small = torch.randn(8, dtype=dtype)
    overhead = best_of(lambda: [torch.add(small, small) for _ in range(200)]) / 200
    link = copy_bw if link_bandwidth is None else parse_rate(link_bandwidth, "link_bandwidth")
    return Hardware(name="this machine", gpus=1, gpu_memory=parse_size(gpu_memory, "gpu_memory") + 1,
                    cpu_memory=parse_size(cpu_memory, "cpu_memory"), peak_flops=flops,
                    memory_bandwidth=copy_bw, pcie=link, interconnect=link, cpu_bandwidth=copy_bw,
                    efficiency=1.0, op_overhead_s=overhead, reserved=1,
                    note=f"measured: {flops / 1e9:.1f} GFLOP/s matmul ({dtype}), {copy_bw / 1e9:.1f} GB/s copy, "
                         f"{overhead * 1e6:.1f} us per op")
