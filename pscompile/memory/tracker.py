"""Non-model memory measurement: live storages on the compute device, per operator.

``NonModelTracker`` is a TorchDispatchMode. After every operator it adds the storages the operator
created (identified by a serial number; raw addresses are reused
after a free and would corrupt the curve), and samples the live non-model bytes *while the
operator runs* (its inputs are still alive, its outputs exist); storages that died are
forgotten whenever the count could set a new peak (the samples that matter are exact). Chunk buffers are model data and
are skipped. On CUDA the sample is the caching allocator's ``memory_allocated`` minus the chunk
bytes and minus ``external_bytes``: what the process held on the device when the measurement began
that is neither chunks nor a tensor given to ``add_tensor`` (another model, a reference trainer, an
earlier engine not yet collected). Like the CPU count, which sees only storages made during the
step, the figure is then the step's own and does not depend on what else lives on the GPU.
Scratch memory inside a kernel is invisible to both.

The owner reads ``window_peak`` (largest sample since the last ``start_window``; exact only with
``exact_windows=True``, which sweeps after every operator) at its own decision points
("moments"), and ``model_bytes()`` is added to each sample to keep the true device peak.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves


_expired = torch.UntypedStorage._expired   # the C check behind StorageWeakRef.expired()


class OverBudget(RuntimeError):
    """A sample of a tracker with a ``limit`` went over it (the run stops at that operator)."""

    def __init__(self, total: int, limit: int):
        super().__init__(f"device bytes reached {total}, over the limit {limit}")
        self.total, self.limit = total, limit


class NonModelTracker(TorchDispatchMode):
    def __init__(self, device: torch.device, is_model_storage: Callable[[int], bool],
                 model_bytes: Callable[[], int], *, exact_windows: bool = False):
        super().__init__()
        self.exact_windows = exact_windows   # sweep after every operator: exact window_peak
        self.device = device
        self.is_model_storage = is_model_storage
        self.model_bytes = model_bytes
        self._serials = itertools.count()
        self._live: dict[int, tuple[int, StorageWeakRef, int]] = {}  # cdata -> (serial, ref, nbytes)
        self.live_bytes = 0
        self.window_peak = 0          # largest non-model sample since start_window()
        self.peak_nonmodel = 0        # largest non-model sample since reset_peaks()
        self.peak_total = 0           # largest (non-model + model) sample since reset_peaks()
        self.peak_model = 0
        self.num_ops = 0
        self._paused = 0
        self._cuda = device.type == "cuda"
        self.external_bytes = 0       # CUDA: device bytes held outside this measurement (set once)
        self.limit: int | None = None  # a sample over it raises ``OverBudget`` (a plan not yet proven)
        self._external_set = False

    # ---- bookkeeping -----------------------------------------------------------------------
    def add_tensor(self, t: torch.Tensor) -> None:
        """Count a tensor created outside the mode (e.g. the batch) as non-model data."""
        self._add(t)
        self._sample()

    def add_tensors(self, values) -> None:
        """Count every tensor among ``values`` (a region's outputs), then take one sample."""
        for v in values:
            if isinstance(v, torch.Tensor):
                self._add(v)
        self._sample()

    def _add(self, t: torch.Tensor) -> None:
        if t.device != self.device or t.is_meta:
            return
        st = t.untyped_storage()
        key = st._cdata
        old = self._live.get(key)
        if old is not None and not _expired(old[1].cdata):
            return  # a view of a storage already counted
        nbytes = st.nbytes()
        if nbytes == 0 or self.is_model_storage(st.data_ptr()):
            return
        if old is not None:
            self.live_bytes -= old[2]
        self._live[key] = (next(self._serials), StorageWeakRef(st), nbytes)
        self.live_bytes += nbytes

    def _sweep(self) -> None:
        dead = [k for k, (_, ref, _) in self._live.items() if _expired(ref.cdata)]
        for k in dead:
            self.live_bytes -= self._live.pop(k)[2]

    def _sample(self, extra: int = 0) -> None:
        model = self.model_bytes()
        if self._cuda:
            nonmodel = torch.cuda.memory_allocated(self.device) - self.external_bytes - model + extra
        else:
            nonmodel = self.live_bytes + extra
            # live_bytes may still count storages that died since the last sweep, so it is an upper
            # bound; sweep (exact) only when that bound could set a new peak.
            if self.exact_windows or nonmodel > self.peak_nonmodel or nonmodel + model > self.peak_total:
                self._sweep()
                nonmodel = self.live_bytes + extra
        self.window_peak = max(self.window_peak, nonmodel)
        self.peak_nonmodel = max(self.peak_nonmodel, nonmodel)
        self.peak_model = max(self.peak_model, model)
        self.peak_total = max(self.peak_total, nonmodel + model)
        if self.limit is not None and nonmodel + model > self.limit:
            raise OverBudget(nonmodel + model, self.limit)

    def current(self) -> int:
        """Live non-model bytes now."""
        self._sweep()
        if self._cuda:
            return torch.cuda.memory_allocated(self.device) - self.external_bytes - self.model_bytes()
        return self.live_bytes

    def sample_with(self, extra: int) -> None:
        """Record a sample of the live non-model bytes plus ``extra`` bytes this tracker cannot see
        (what a compiled region allocates inside, measured once)."""
        self._sample(extra)

    def note(self, nonmodel: int, model: int) -> None:
        """Record a sample measured by other means (e.g. a profiler, after the fact)."""
        self.window_peak = max(self.window_peak, nonmodel)
        self.peak_nonmodel = max(self.peak_nonmodel, nonmodel)
        self.peak_model = max(self.peak_model, model)
        self.peak_total = max(self.peak_total, nonmodel + model)

    def start_window(self) -> None:
        self.window_peak = self.current()

    def sample_now(self) -> None:
        """Record a sample outside any operator (after a move changed the model bytes)."""
        self._sample()

    def reset_peaks(self) -> None:
        self._sweep()
        if self._cuda and not self._external_set:     # the first reset starts the measurement
            allocated = torch.cuda.memory_allocated(self.device)
            self.external_bytes = max(0, allocated - self.model_bytes() - self.live_bytes)
            self._external_set = True
        self.peak_nonmodel = self.peak_total = self.peak_model = 0
        self._sample()

    @contextmanager
    def paused(self):
        """Operators run inside are not sampled (the owner's own chunk copies, host-side work).
        While this tracker is the innermost dispatch mode it is taken off the mode stack, so they
        do not pay for a Python dispatch either."""
        self._paused += 1
        try:
            if _get_current_dispatch_mode() is self:
                with _pop_mode_temporarily():
                    yield
            else:
                yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        self.num_ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._sample()
        return out


def warm_device_libraries(device: torch.device, dtype: torch.dtype) -> None:
    """CUDA: make the workspaces cuBLAS and cuBLASLt keep for the process (allocated through the
    caching allocator at the first real matmul of a dtype, then held) before anything is measured,
    so every tracker counts them as ``external_bytes`` from its first sample: a workspace created
    inside the first measured run would read as non-model bytes at every later node and raise
    the curve above what the following steps hold. No-op elsewhere."""
    if device.type != "cuda":
        return
    for dt in dict.fromkeys((dtype, torch.float32)):
        a = torch.ones(64, 64, device=device, dtype=dt)
        b = torch.ones(2, 64, 64, device=device, dtype=dt)
        torch.mm(a, a), torch.addmm(a, a, a), torch.bmm(b, b), torch.mm(a, a.t())
    torch.cuda.synchronize(device)
