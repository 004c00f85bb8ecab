"""PlanReport: what ``pscompile.plan`` found, and its printed form."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tabulate import tabulate

from pscompile.units import format_bytes

__all__ = ["Baseline", "PlanReport"]


@dataclass(frozen=True)
class Baseline:
    """A static partition planned from the same capture (ZeRO-Offload's placement): every
    compute-dtype parameter on each GPU next to the non-model bytes of the graph with every
    activation segment recomputed; gradients (compute dtype), fp32 masters and Adam states on the
    host, 14 bytes per parameter for the node."""

    device_bytes: int        # per GPU: parameters + peak non-model bytes
    host_bytes: int          # the node's
    device_budget: int
    host_budget: int

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.device_budget and self.host_bytes <= self.host_budget

    def why_not(self) -> str:
        out = []
        if self.device_bytes > self.device_budget:
            out.append(f"GPU needs {format_bytes(self.device_bytes)} > {format_bytes(self.device_budget)}")
        if self.host_bytes > self.host_budget:
            out.append(f"CPU needs {format_bytes(self.host_bytes)} > {format_bytes(self.host_budget)}")
        return "; ".join(out)


@dataclass(frozen=True)
class PlanReport:
    """One model on one machine, as compiled mode would plan it (per GPU unless said otherwise)."""

    model: str
    hardware: str
    params: int
    gpus: int
    batch: str
    dtype: str
    fits: bool
    overflow: str                  # "" when it fits; else which tier overflows, where, by how much
    device_budget: int             # per GPU: gpu_memory - reserved
    host_budget: int               # per GPU: its share of the node's CPU memory
    disk_budget: int
    chunk_size: int                # elements
    num_chunks: int
    utilisation: float             # the layout's parameter elements / chunk capacity
    device_model_bytes: int        # slots at the plan's peak + optimizer states kept on the device
    host_model_bytes: int          # compute-dtype homes + fp32 masters and Adam states on the host
    disk_model_bytes: int          # optimizer states (and compute-dtype chunks) on disk
    disk_io_bytes: int             # per iteration, at most: the states read and written once, the
    #                                parameters on disk at each fetch, writeback and update
    disk_s: float                  # ... at the node's disk bandwidth (shared by its GPUs)
    activations: str               # the activation policy's choice
    peak_device_bytes: int         # planned, model + non-model
    h2d_bytes: int                 # PCIe, per iteration
    d2h_bytes: int
    offload_bytes: int             # saved activations sent to the host (and back)
    allgather_bytes: int           # GPU-GPU, received per rank
    reduce_scatter_bytes: int      # GPU-GPU, sent per rank
    compute_s: float
    iteration_s: float             # the cost model's estimate of a step in the steady state
    first_iteration_s: float       # ... of the first step (none started with chunks in flight)
    optimizer_s: float
    tflops_per_gpu: float
    baseline_fits: bool
    baseline_detail: str
    baseline_device_bytes: int     # the static partition's need per GPU (parameters + non-model peak)
    baseline_host_bytes: int       # ... and the node's CPU memory (14 bytes per parameter)
    min_device_memory: int | None  # the least per-GPU budget the plan needs (when it did not fit)
    plan_s: float                  # seconds it took to capture and plan
    param_disk_bytes: int = 0      # the part of disk_model_bytes that is compute-dtype chunks (one GPU)

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        """A human-readable table."""
        b = format_bytes
        rows = [
            ("model", f"{self.model}: {self.params / 1e9:.2f}B parameters, batch {self.batch}, {self.dtype}"),
            ("hardware", self.hardware),
            ("fits", "yes" if self.fits else f"NO: {self.overflow}"),
            ("chunks", f"{self.num_chunks} x {self.chunk_size / 1e6:.1f}M elements, {self.utilisation:.2%} utilised"),
            ("model data per GPU", f"GPU {b(self.device_model_bytes)}, CPU {b(self.host_model_bytes)}, "
                                   f"disk {b(self.disk_model_bytes)}"
                                   + (f" ({b(self.param_disk_bytes)} of it parameters)" if self.param_disk_bytes else "")),
            *([("disk per iteration", f"{b(self.disk_io_bytes)} read and written, {self.disk_s:.3f} s at the "
                                      "node's disk bandwidth (" + ("behind the forward, backward and host optimizer"
                                                                   if self.param_disk_bytes else
                                                                   "behind the host optimizer") + ")")]
              if self.disk_io_bytes else []),
            ("activations", self.activations),
            ("peak GPU bytes", f"{b(self.peak_device_bytes)} of {b(self.device_budget)}"),
            ("PCIe per iteration", f"{b(self.h2d_bytes)} to the GPU, {b(self.d2h_bytes)} to the CPU "
                                   f"({b(self.offload_bytes)} of activations each way)"),
            ("GPU-GPU per iteration", f"{b(self.allgather_bytes)} all-gathered, "
                                      f"{b(self.reduce_scatter_bytes)} reduce-scattered"),
            ("iteration (estimate)", f"{self.iteration_s:.3f} s ({self.compute_s:.3f} s compute, "
                                     f"{self.optimizer_s:.3f} s optimizer), {self.tflops_per_gpu:.1f} TFLOP/s per GPU"
                                     + (f"; the first step {self.first_iteration_s:.3f} s"
                                        if abs(self.first_iteration_s - self.iteration_s) > 5e-4 else "")),
            ("static partition", "fits" if self.baseline_fits else f"does not fit: {self.baseline_detail}"),
            ("planned in", f"{self.plan_s:.1f} s"),
        ]
        if not self.fits and self.min_device_memory:
            rows.insert(3, ("least GPU memory", b(self.min_device_memory)))
        return tabulate(rows, tablefmt="simple")
