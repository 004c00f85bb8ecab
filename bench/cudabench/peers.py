"""What a user with one GPU would run instead of pscompile (docs/gpu.md), each returning
``dict(steps=[...])`` as ``rows.run_plain`` does:

- **FSDP2**: ``fully_shard`` of every block and the root on a one-rank mesh with ``CPUOffloadPolicy``
  and ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)``, ``torch.optim.AdamW`` over
  the host parameters (NCCL on CUDA; gloo and unpinned memory on a dry run);
- **DeepSpeed ZeRO-3** with parameters and optimizer on the host, where ``import deepspeed`` works
  (else ``Unavailable``).

A peer has no budget of its own: ``device_cap`` limits the CUDA allocator. A row's one-rank process
group is made in-process (``HashStore``, no port) and destroyed after it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import pscompile
from harness.host import vm_hwm_bytes

from .rows import Unavailable, model, reset_peak, timed

PEAK_BF16_FLOPS = {             # dense bf16 tensor-core peaks (vendors' data sheets), matched in this order
    "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "A100": 312e12,
    "L40S": 362e12, "A10": 125e12,
}


def peak_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak, from its name; None when it is not in ``PEAK_BF16_FLOPS``."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


def step_flops(params: int, tokens: int) -> float:
    """A training step's FLOPs by the usual estimate: 6 x parameters x tokens (forward 2, backward 4)."""
    return 6.0 * params * tokens


@contextlib.contextmanager
def host_peak(out: dict):
    """``out["host_peak_bytes"]``: the process's peak resident memory while the block ran (Linux:
    the peak is reset through ``/proc/self/clear_refs`` first, then read from ``VmHWM``), and
    ``out["host_before_bytes"]``, its resident memory when the block began; None elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    out["host_before_bytes"] = vm_hwm_bytes() if reset else None      # just reset: the resident bytes now
    try:
        yield out
    finally:
        out["host_peak_bytes"] = vm_hwm_bytes() if reset else None


@contextlib.contextmanager
def device_cap(device: str, cap: int | None):
    """On CUDA, the caching allocator refuses to hold more than ``cap`` bytes (a peer's budget);
    the CPU has no such limit (the caller records that the cap was not enforced)."""
    if device != "cuda" or cap is None:
        yield
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def one_rank(device: str):
    """A one-rank default process group for a peer's row (NCCL on CUDA, gloo on the CPU)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized: a peer's row makes its own")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": torch.device("cuda", 0)} if device == "cuda" else {}))
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_model(size, s: dict, device: str, dtype: torch.dtype):
    """The GPT of ``size``, each block and then the root sharded by ``fully_shard`` on a one-rank mesh
    with its parameters offloaded to the host; call inside ``one_rank``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    gpt = model(size, s)
    kw = dict(mesh=init_device_mesh(device, (1,)), offload_policy=CPUOffloadPolicy(pin_memory=device == "cuda"),
              mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    for block in gpt.h:
        fully_shard(block, **kw)
    fully_shard(gpt, **kw)
    return gpt


def run_fsdp2(size, data, s: dict, device: str, dtype: torch.dtype, cap: int | None,
              hp: pscompile.AdamW) -> dict:
    """Trains ``data`` with FSDP2 + CPU offload under ``cap``: per step its loss and time."""
    with one_rank(device), device_cap(device, cap):
        reset_peak(device)
        gpt = fsdp2_model(size, s, device, dtype)
        opt = torch.optim.AdamW(gpt.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                weight_decay=hp.weight_decay)

        def step(batch) -> float:
            x, y = (t.to(device, non_blocking=True) for t in batch)
            loss = gpt(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return dict(steps=timed(step, data, device))


def deepspeed_module(wheels: Path | None = None):
    """``deepspeed``; if it is not installed and ``wheels`` is a folder, every wheel there is installed
    first, with no network and no dependency resolution (a lent GPU has no network; docs/gpu.md
    says how to fill the folder); else ``Unavailable`` with the reason."""
    try:
        import deepspeed
        return deepspeed
    except Exception as e:      # noqa: BLE001 -- any failure to import is the row's reason to skip
        missing = f"import deepspeed failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if wheels is None or not Path(wheels).is_dir():
        raise Unavailable(f"{missing}; pip install deepspeed, or --wheels DIR with its wheels (docs/gpu.md)")
    found = sorted(str(w) for w in Path(wheels).glob("*.whl"))
    if not found:
        raise Unavailable(f"{missing}; no wheel there to install it from ({wheels})")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *found],
                          capture_output=True, text=True)
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["pip gave no reason"])[-1][:300]
        raise Unavailable(f"{missing}; installing it from {wheels} failed: {why}")
    importlib.invalidate_caches()
    try:
        import deepspeed
    except Exception as e:      # noqa: BLE001
        raise Unavailable(f"deepspeed installed from {wheels} but its import failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from e
    return deepspeed


def deepspeed_config(s: dict, dtype: torch.dtype, hp: pscompile.AdamW, device: str) -> dict:
    """ZeRO-3 with parameters and optimizer states on the host, AdamW with ``hp``'s settings."""
    pin = device == "cuda"
    return {
        "train_micro_batch_size_per_gpu": s["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": dtype == torch.bfloat16}, "fp16": {"enabled": dtype == torch.float16},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": pin},
                              "offload_optimizer": {"device": "cpu", "pin_memory": pin}},
        "optimizer": {"type": "AdamW", "params": {"lr": hp.lr, "betas": list(hp.betas), "eps": hp.eps,
                                                  "weight_decay": hp.weight_decay}},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


def run_deepspeed(size, data, s: dict, device: str, dtype: torch.dtype, cap: int | None,
                  hp: pscompile.AdamW, wheels: Path | None = None) -> dict:
    """Trains ``data`` with DeepSpeed ZeRO-3 offload under ``cap``, in a process of its own: ZeRO-3
    patches torch for the rest of the process it runs in (its ``F.linear`` and module hooks stay),
    and the rows after it measured a model that was not pscompile's. ``Unavailable`` if it cannot
    start (``wheels``: ``deepspeed_module``'s). The row's host peak is the child's."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_deepspeed_child, size, data, s, device, dtype, cap, hp, wheels).result()


def _deepspeed_child(size, data, s, device, dtype, cap, hp, wheels) -> dict:
    deepspeed = deepspeed_module(wheels)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if device == "cpu":
        torch.set_num_threads(1)
    with host_peak({}) as host, one_rank(device), device_cap(device, cap):
        reset_peak(device)
        try:
            engine, *_ = deepspeed.initialize(model=model(size, s), config=deepspeed_config(s, dtype, hp, device))
        except Exception as e:      # noqa: BLE001 -- e.g. its host Adam cannot be built here
            raise Unavailable(f"deepspeed.initialize failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160]})") from None

        def step(batch) -> float:
            x, y = (t.to(engine.device) for t in batch)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return float(loss.detach())

        rows = timed(step, data, device)
    return dict(steps=rows, **host)
