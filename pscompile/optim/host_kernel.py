"""The host AdamW kernels: one pass over memory per chunk range.

``torch._fused_adamw_`` takes one dtype for all its lists, so a 16-bit gradient with fp32 masters
costs three passes on the host (upcast, update, cast back), and the blocks that keep those passes in
cache make thousands of small OpenMP regions per step, which collapse when the host is busy. Here
the whole update of a range -- upcast and unscale the gradient, decay, both moments, the step, and
the new master's cast into the param chunk -- is one vectorized loop with one parallel region per
call (the chunk, or a range of it). Two builds of it:

- **the C++ kernel** (``native_kernel.py``, ``host_adamw.cpp``): written by hand, built once per
  machine in about a second; on bf16, twice the Inductor loop's throughput with its arrays in
  cache and 1.09-1.40x streaming (the cast, 512-bit vectors, the unroll), and called through
  ctypes, which lets go of the GIL. The default where it builds.
- **the Inductor kernel** (this file): the same math as one elementwise function that Inductor
  turns into a C++ loop: inside torch, for any CPU Inductor supports. One kernel is compiled per
  (variant, dtypes, chunk size, threads): chunks are all one size, and a kernel compiled for a
  fixed size runs its loop without a tail test per vector (a dynamic-size one measured 1.4x
  slower). That is a few seconds cold, under one warm from Inductor's cache.

``Config.optimizer_kernel="auto"`` uses a kernel for chunks of at least ``MIN_KERNEL_NUMEL``
elements and ``torch._fused_adamw_`` below that; ``Config.optimizer_threads`` is its thread count.

An Inductor kernel that runs on a thread beside the compute (lock-free updating, updates in the
backward) is compiled with Inductor's C++ wrapper, which lets go of the GIL while it runs: the
default Python binding holds it, which measured as stopping the compute thread's Python (the
executor) for the whole update. It compiles in about 13 s cold against 4 s, so the main thread's
kernels keep the default.

On x86 the kernel is generated for 256-bit vectors: with 512-bit vectors Inductor loads and stores
16-bit tensors half a vector at a time through a bounce buffer, which measured 2x slower here
(docs/host-optimizer.md); AMD's Zen 4 runs 512-bit arithmetic as two 256-bit halves anyway.

The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction) in fp32; it multiplies
by the reciprocal of the bias correction's square root where the fused kernel divides, so results
agree with it to an ulp or so, not bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from pscompile.config import AdamW
from pscompile.optim.native_kernel import NativeKernel, NativeUnavailable
from pscompile.optim.native_kernel import load as load_native

KernelName = Literal["auto", "native", "inductor", "eager"]

# "auto" compiles the kernel for chunks at least this large (4 MiB of fp32): below it the compile
# (seconds) costs more than the passes it saves in a short run, and tests stay fast
MIN_KERNEL_NUMEL = 1 << 20

Variant = Literal["plain", "into", "to", "out", "out_to"]


def coefficients(hp: AdamW, step: int, grad_factor: float) -> torch.Tensor:
    """The kernel's per-step scalars for one parameter group at ``step`` (computed in double, as
    ``torch._fused_adamw_`` does, then stored as fp32): the gradient's factor, the decay, the step
    size and the bias correction's inverse square root. The betas and eps are compiled in."""
    b1, b2 = hp.betas
    bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
    return torch.tensor([grad_factor, 1.0 - hp.lr * hp.weight_decay, hp.lr / bc1, 1.0 / math.sqrt(bc2)],
                        dtype=torch.float32)


def _adamw(grad, master, m, v, c, b1: float, b2: float, eps: float):
    """The new (master, exp_avg, exp_avg_sq) of one chunk, all fp32. The scalars that change from
    step to step come in the tensor ``c``, whose elements the loop reloads (the compiler cannot
    prove they do not alias the outputs), so the constant ones are compiled in: fewer loads per
    vector (measured about 5% of the bound on bf16)."""
    g = grad.float() * c[0]
    m2 = m + (g - m) * (1.0 - b1)
    v2 = v * b2 + g * g * (1.0 - b2)
    p2 = master * c[1] - c[2] * m2 / (v2.sqrt() * c[3] + eps)
    return p2, m2, v2


def _write(master, m, v, p2, m2, v2) -> None:
    master.copy_(p2)
    m.copy_(m2)
    v.copy_(v2)


def _function(variant: Variant, out_dtype: torch.dtype | None, b1: float, b2: float, eps: float) -> Callable:
    """The update as an in-place function of its buffers: ``plain`` (grad, master, m, v, c),
    ``into`` (the grad buffer gets the new master's cast) or ``to`` (an extra ``out`` buffer does);
    ``out`` and ``out_to`` write the new master and moments into three more buffers instead (the
    same bytes move: an early update, ``runtime/early_update.py``)."""
    if variant == "plain":
        def fn(grad, master, m, v, c):
            _write(master, m, v, *_adamw(grad, master, m, v, c, b1, b2, eps))
    elif variant == "out":                      # out of place: the inputs are left as they were
        def fn(grad, master, m, v, c, master_out, m_out, v_out):
            _write(master_out, m_out, v_out, *_adamw(grad, master, m, v, c, b1, b2, eps))
    elif variant == "out_to":
        def fn(grad, master, m, v, c, master_out, m_out, v_out, out):
            p2, m2, v2 = _adamw(grad, master, m, v, c, b1, b2, eps)
            _write(master_out, m_out, v_out, p2, m2, v2)
            out.copy_(p2.to(out_dtype))
    elif variant == "into":
        def fn(grad, master, m, v, c):
            p2, m2, v2 = _adamw(grad, master, m, v, c, b1, b2, eps)
            _write(master, m, v, p2, m2, v2)
            grad.copy_(p2.to(out_dtype))
    else:
        def fn(grad, master, m, v, c, out):
            p2, m2, v2 = _adamw(grad, master, m, v, c, b1, b2, eps)
            _write(master, m, v, p2, m2, v2)
            out.copy_(p2.to(out_dtype))
    return fn


def _simdlen() -> int | None:
    """256-bit vectors on x86 (the module docstring); Inductor's default elsewhere."""
    return 256 if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else None


class HostKernels:
    """The host update kernels of one engine: the C++ one (``native_kernel.py``) or the ones
    Inductor compiles, by (variant, dtypes). ``threads``: the OpenMP thread count (None: torch's).
    A kernel updates a whole chunk buffer (an Inductor one has its size compiled in).

    ``choice``: "native" (the C++ kernel; an error here names what is missing), "inductor", or
    "auto" (the C++ kernel where it builds, else Inductor's; ``native_unavailable`` says why not).
    ``used`` holds a key per kernel that ran: (backend, variant, out dtype, grad dtype)."""

    def __init__(self, choice: KernelName = "auto", threads: int | None = None):
        self.choice = choice
        self.threads = threads
        self._compiled: dict[tuple, Callable] = {}
        self.used: set[tuple] = set()
        self.native_unavailable: str | None = None
        self._native: NativeKernel | None = None
        if choice == "native":
            try:
                self._native = load_native()
            except NativeUnavailable as e:
                raise ValueError(f"optimizer_kernel='native' cannot run here: {e}; use 'auto' (which falls back "
                                 "to the Inductor kernel) or 'inductor'") from e

    def _native_kernel(self) -> NativeKernel | None:
        """The C++ kernel when the choice allows it and it loads (tried once, on first use)."""
        if self._native is None and self.choice == "auto" and self.native_unavailable is None:
            try:
                self._native = load_native()
            except NativeUnavailable as e:
                self.native_unavailable = str(e)
        return self._native

    def wanted(self, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None, grad_factor: float) -> bool:
        """Whether a kernel updates this chunk: a host chunk ("native" or "inductor", or "auto" and
        at least ``MIN_KERNEL_NUMEL`` elements). The Inductor kernel runs only where it saves a pass
        -- a 16-bit gradient, a cast into a param chunk, or a factor to multiply the gradient by: an
        fp32 gradient into a master that is the param chunk is one pass of ``torch._fused_adamw_``
        already, which measured 0-12% faster than the generated loop. The C++ kernel measured
        0.96-1.42x ``torch._fused_adamw_`` there (bench/host_adamw.py), so it runs there too. An
        update in the backward decides the same way (the same bits either way)."""
        if master.device.type != "cpu" or self.choice == "eager":
            return False
        if self.choice == "auto" and master.numel() < MIN_KERNEL_NUMEL:
            return False
        if grad.dtype == torch.float32 and out is None and grad_factor == 1.0:
            return self._native_kernel() is not None
        return True

    def update(self, grad: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               hp: AdamW, c: torch.Tensor, out: torch.Tensor | None,
               states_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               background: bool = False) -> None:
        """One chunk's update (``c``: ``coefficients``): in place, or into ``states_out`` (new
        master and moments; the inputs stay as they were); ``out`` (None, ``grad`` itself, or
        another buffer) gets the new master in its dtype. ``background``: called on a thread
        beside the compute (the kernel lets go of the GIL)."""
        if states_out is not None:
            variant = "out" if out is None else "out_to"
        else:
            variant = "plain" if out is None else "into" if out is grad else "to"
        native = self._native_kernel()
        self.used.add(("native" if native else "inductor", variant, None if out is None else out.dtype, grad.dtype))
        if native is not None:
            native.update(grad, master, m, v, c, states_out, out, hp.betas, hp.eps,
                          self.threads or torch.get_num_threads())
            return
        key = (variant, None if out is None else out.dtype, grad.dtype, grad.numel(), *hp.betas, hp.eps, background)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compile(key)
        # (the functions' arguments: the buffers, then the out-of-place ones, then a separate ``out``)
        args = (grad, master, m, v, c, *(states_out or ()), *((out,) if variant in ("to", "out_to") else ()))
        if _get_current_dispatch_mode() is None:
            fn(*args)
            return
        # host work under a device tracker's dispatch mode (compiled mode's measuring steps): the
        # tracker has nothing to see in an in-place host kernel, and torch.compile runs under none
        with _disable_current_modes():
            fn(*args)

    def _compile(self, key: tuple) -> Callable:
        # a GraphModule per kernel: its own code object, so Dynamo's per-function recompile limit
        # never makes several kernels in one process share (and overflow) one cache
        gm = torch.fx.symbolic_trace(_function(key[0], key[1], *key[4:7]))
        options: dict = {}
        if self.threads is not None:
            options["cpp.threads"] = self.threads
        if (simd := _simdlen()) is not None:
            options["cpp.simdlen"] = simd
        if key[7]:
            options["cpp_wrapper"] = True            # (lets go of the GIL: the module docstring)
        fn = torch.compile(gm, dynamic=False, fullgraph=True, options=options)
        self._compiled[key] = fn
        return fn
