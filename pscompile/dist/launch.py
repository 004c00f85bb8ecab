"""Joining the process group a launcher (``torchrun``) describes in the environment."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_from_env(device: str, *, timeout_s: float = 600.0) -> tuple[int, int, bool]:
    """``(rank, world_size, joined)``: when ``WORLD_SIZE`` > 1 (torchrun sets it, with ``RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT``) join the default group -- gloo for ``device="cpu"``,
    NCCL for CUDA, where each rank takes the GPU ``LOCAL_RANK`` -- and return ``joined=True``
    (the caller destroys the group at the end). One process: ``(0, 1, False)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), True
