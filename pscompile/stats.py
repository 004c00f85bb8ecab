"""StepStats: what one training step did, measured (not planned). ``str(stats)`` is a few lines
with units (``print(engine.stats)``); ``repr`` is the dataclass's, every field."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pscompile.units import format_bytes


@dataclass(frozen=True)
class StepStats:
    loss: float                    # the step's loss (unscaled)
    h2d_bytes: int                 # host -> device bytes copied
    d2h_bytes: int                 # device -> host bytes copied
    disk_read_bytes: int           # disk -> host bytes (disk tier)
    disk_write_bytes: int          # host -> disk bytes (disk tier)
    peak_device_bytes: int         # peak of model + non-model bytes on the compute device
    peak_device_model_bytes: int   # peak of chunk bytes on the compute device
    peak_nonmodel_bytes: int       # peak of non-model bytes (activations, temporaries) on the device
    num_fetches: int               # chunk moves host -> device
    num_evictions: int             # chunk moves device -> host (including drops of clean copies)
    allgather_bytes: int           # ZeRO all-gather bytes received (0 on one rank)
    reduce_scatter_bytes: int      # ZeRO reduce-scatter bytes sent (0 on one rank)
    skipped: bool                  # the update was skipped (fp16 overflow)
    loss_scale: float              # loss scale used (1.0 without scaling)
    time_s: float                  # wall time of the whole step
    forward_s: float               # forward time (including its transfers)
    backward_s: float              # backward time (including its transfers)
    optimizer_s: float             # gradient reduction + clipping + update time
    transfer_s: float              # time spent inside chunk copies (all phases)
    offload_bytes: int = 0         # saved activations device -> host (part of d2h_bytes)
    reload_bytes: int = 0          # saved activations host -> device (part of h2d_bytes)
    # CUDA only: the caching allocator's own peak over the step (torch.cuda.max_memory_allocated,
    # reset when the step starts) less the device bytes the process held outside the step when it
    # began (other models, caches; memory/tracker.py) -- the independent check of
    # peak_device_bytes; None elsewhere
    allocator_peak_bytes: int | None = None
    # peak of the host bytes model data held over the step: host-homed chunks, optimizer states,
    # the disk tier's staging buffers, gradient accumulation and lock-free gradient buffers (the
    # figure host_memory bounds; offloaded activations use the room host_memory leaves besides)
    peak_host_bytes: int = 0
    # compiled mode: the step's compute operators (every executed op but views, getitems, memory
    # nodes and parameter gathers), and those of them that ran inside compiled code (Inductor
    # regions); hooks mode and backend="eager": compiled_ops is 0
    compute_ops: int = 0
    compiled_ops: int = 0
    # the gradients' global 2-norm before clipping, unscaled, over every rank under ZeRO (what
    # torch.nn.utils.clip_grad_norm_ returns; inf or NaN for a float16 step skipped on overflow)
    grad_norm: float | None = None
    # the device budget the step ran under (Config.device_memory, or on CUDA 90% of the free memory;
    # ZeRO: the smallest rank's), the bound on peak_device_bytes; None: no limit
    device_memory: int | None = None

    @property
    def compiled_share(self) -> float:
        """The share of the step's compute operators that ran inside compiled code (0.0-1.0)."""
        return self.compiled_ops / self.compute_ops if self.compute_ops else 0.0

    @property
    def chunk_h2d_bytes(self) -> int:
        """Host -> device bytes of model data (chunks), without reloaded activations."""
        return self.h2d_bytes - self.reload_bytes

    @property
    def chunk_d2h_bytes(self) -> int:
        """Device -> host bytes of model data (chunks), without offloaded activations."""
        return self.d2h_bytes - self.offload_bytes

    @property
    def bytes_moved(self) -> int:
        return self.h2d_bytes + self.d2h_bytes + self.disk_read_bytes + self.disk_write_bytes

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        """A short summary, one topic a line (a line with nothing to say is left out): time and
        loss; device and host peaks against the budget; bytes moved, fetches and evictions;
        activation and ZeRO traffic; the compiled share, gradient norm and loss scale."""
        lines = (self._time_line(), self._device_line(), self._moved_line(), self._extra_moves_line(),
                 self._other_line())
        return "\n".join(line for line in lines if line)

    def _time_line(self) -> str:
        return (f"step {_seconds(self.time_s)} (forward {_seconds(self.forward_s)}, backward "
                f"{_seconds(self.backward_s)}, optimizer {_seconds(self.optimizer_s)}; copies "
                f"{_seconds(self.transfer_s)}), loss {self.loss:.4g}"
                + (" -- update skipped (float16 overflow)" if self.skipped else ""))

    def _device_line(self) -> str:
        budget = "no budget"
        if self.device_memory is not None:
            share = self.peak_device_bytes / max(1, self.device_memory)
            budget = f"{share:.0%} of the {format_bytes(self.device_memory)} budget"
        allocator = ("" if self.allocator_peak_bytes is None else
                     f"; CUDA allocator peak {format_bytes(self.allocator_peak_bytes)}")
        return (f"device peak {format_bytes(self.peak_device_bytes)} ({budget}; chunks up to "
                f"{format_bytes(self.peak_device_model_bytes)}, non-model up to {format_bytes(self.peak_nonmodel_bytes)})"
                f"{allocator}; host peak {format_bytes(self.peak_host_bytes)}")

    def _moved_line(self) -> str:
        disk = (f", disk read {format_bytes(self.disk_read_bytes)}, written {format_bytes(self.disk_write_bytes)}"
                if self.disk_read_bytes or self.disk_write_bytes else "")
        return (f"moved {format_bytes(self.bytes_moved)}: host->device {format_bytes(self.h2d_bytes)}, device->host "
                f"{format_bytes(self.d2h_bytes)}{disk}; {self.num_fetches} fetches, {self.num_evictions} evictions")

    def _extra_moves_line(self) -> str:
        parts = []
        if self.offload_bytes or self.reload_bytes:
            parts.append(f"activations offloaded {format_bytes(self.offload_bytes)}, reloaded "
                         f"{format_bytes(self.reload_bytes)} (within the moves above)")
        if self.allgather_bytes or self.reduce_scatter_bytes:
            parts.append(f"ZeRO all-gather {format_bytes(self.allgather_bytes)}, reduce-scatter "
                         f"{format_bytes(self.reduce_scatter_bytes)}")
        return "; ".join(parts)

    def _other_line(self) -> str:
        parts = []
        if self.compute_ops:
            parts.append(f"compiled share {self.compiled_share:.0%} ({self.compiled_ops} of {self.compute_ops} ops)")
        if self.grad_norm is not None:
            parts.append(f"grad norm {self.grad_norm:.4g}")
        if self.loss_scale != 1.0:
            parts.append(f"loss scale {self.loss_scale:g}")
        return "; ".join(parts)


def _seconds(s: float) -> str:
    """A duration with its unit: '850 ms', '2.31 s'."""
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"
