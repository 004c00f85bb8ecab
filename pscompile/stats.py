"""StepStats: what one training step did, measured (not planned)."""

from __future__ import annotations

from dataclasses import dataclass, fields


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
