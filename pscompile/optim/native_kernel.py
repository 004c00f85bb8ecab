"""The host AdamW kernel written in C++ (``host_adamw.cpp``), built with the system's compiler and
called through ctypes.

Why beside the Inductor kernel (``host_kernel.py``): measured on this project's AVX-512 EPYC, one
thread, bf16 gradients, the Inductor-generated loop ran at 1095-1185 Mparam/s with its arrays in
cache and this one at 2233 (the bf16 cast, 512-bit vectors, the unroll by two); streaming, at
0.61-0.73 of the memory-bandwidth bound against 0.84-1.02 (docs/host-optimizer.md). The
source includes no torch header, so a build takes about a second, once per machine: the library
is kept in Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``) under a name that hashes the
source, the compiler and its flags, written to a temporary name and renamed, so a crash or a
second process never loads half a file. ctypes lets go of the GIL for the call, so a background
update (lock-free updating, the update in the backward) runs beside the compute thread's Python.

It needs x86-64 with AVX2, FMA and F16C, a C++ compiler with OpenMP (``$CXX``, else ``g++`` or
``c++``: the one Inductor needs anyway); AVX512-BF16, where the CPU has it, makes the bf16 cast one
instruction, and AVX-512 doubles the vector width (1.3x the streaming throughput of the 8-lane loop
on bf16 here). ``unavailable_reason()`` says what is missing; ``Config.optimizer_kernel="auto"``
then uses the Inductor kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_adamw.cpp")
KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_OUT = -1
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 8, ctypes.c_int, ctypes.c_int64,
             *[ctypes.c_float] * 4, ctypes.c_int]


class NativeUnavailable(RuntimeError):
    """The C++ kernel cannot be built or loaded here (the message says why)."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    """``$CXX`` (None where it names no program), else g++ or c++."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("c++")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 (AVX2), and this machine is {platform.machine()}"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))} (or /proc/cpuinfo is unreadable)"
    if _compiler() is None:
        return f"no C++ compiler was found (CXX={os.environ.get('CXX', '')!r}, else g++ or c++ on PATH)"
    return None


def flags(cpu: set[str]) -> list[str]:
    """The compiler flags for a CPU with these /proc/cpuinfo flags."""
    out = ["-O3", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fopenmp",
           "-mavx2", "-mfma", "-mf16c"]
    if "avx512f" in cpu:
        out.append("-mavx512f")
        if "avx512_bf16" in cpu:
            out.append("-mavx512bf16")
    return out


def _library_path(compiler: str, opts: list[str], cache: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, *opts]).encode()).hexdigest()[:20]
    return cache / "pscompile" / f"host_adamw-{key}.so"


def _build(compiler: str, opts: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([compiler, *opts, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} failed to build {SOURCE.name}: {done.stderr.strip()[-600:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class NativeKernel:
    """The loaded kernel: ``path`` is the library, ``lanes`` its vector width in fp32 elements (8:
    AVX2, 16: AVX-512), ``hardware_bf16`` whether the bf16 cast uses AVX512-BF16."""

    path: Path
    lanes: int
    hardware_bf16: bool
    fn: ctypes._CFuncPtr

    def update(self, grad: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor,
               states_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, out: torch.Tensor | None,
               betas: tuple[float, float], eps: float, threads: int) -> None:
        """One range's update (``host_kernel.HostKernels.update`` says what each buffer is)."""
        _check(grad, master, m, v, c, states_out, out)
        so = states_out or (None, None, None)
        b1, b2 = betas
        rc = self.fn(grad.data_ptr(), KIND[grad.dtype], master.data_ptr(), m.data_ptr(), v.data_ptr(), c.data_ptr(),
                     *[None if t is None else t.data_ptr() for t in (*so, out)],
                     NO_OUT if out is None else KIND[out.dtype], master.numel(),
                     1.0 - b1, b2, 1.0 - b2, eps, threads)
        if rc != 0:
            raise RuntimeError(f"{self.path.name} refused its arguments (code {rc})")


def _check(grad, master, m, v, c, states_out, out) -> None:
    n = master.numel()
    fp32 = [master, m, v, c, *(states_out or ())]
    if any(t.dtype != torch.float32 for t in fp32) or grad.dtype not in KIND:
        raise TypeError("the native AdamW kernel takes fp32 masters, moments and coefficients and an fp32, bf16 "
                        f"or fp16 gradient; got grad {grad.dtype}, master {master.dtype}")
    if out is not None and out.dtype not in KIND:
        raise TypeError(f"the native AdamW kernel writes the new params in fp32, bf16 or fp16, not {out.dtype}")
    tensors = [grad, *fp32, *((out,) if out is not None else ())]
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("the native AdamW kernel takes contiguous host tensors")
    if any(t.numel() != n for t in tensors if t is not c) or c.numel() != 4:
        raise ValueError(f"the native AdamW kernel's buffers must all have {n} elements (and 4 coefficients)")


def load(cache: Path | None = None, cpu: set[str] | None = None) -> NativeKernel:
    """The kernel, built first if this machine has no build of this source yet (``cache``: the
    folder to keep it in, None: Inductor's cache folder; ``cpu``: the CPU flags to build for, a
    subset of this machine's, None: all of them -- the tests build the AVX2 loop on an AVX-512 CPU)."""
    reason = unavailable_reason()
    if reason is not None:
        raise NativeUnavailable(reason)
    if cache is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        cache = Path(cache_dir())
    compiler = _compiler()
    opts = flags(_cpu_flags() if cpu is None else cpu & _cpu_flags())
    path = _library_path(compiler, opts, cache)
    if not path.exists():
        _build(compiler, opts, path)
    fn = ctypes.CDLL(str(path)).pscompile_host_adamw
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return NativeKernel(path, 16 if "-mavx512f" in opts else 8, "-mavx512bf16" in opts, fn)
