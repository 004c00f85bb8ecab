"""Which copy engine (``memory/copies.py``) a device gets: CUDA streams on a GPU; on the CPU the copy
threads, or the race checker when ``Config(strict_copies=True)`` or ``PSCOMPILE_STRICT_COPIES=1``
asks for it."""

from __future__ import annotations

import os

import torch

from pscompile.memory.copies import INLINE_COPY_BYTES, CopyEngine, ThreadCopies
from pscompile.memory.cuda_copies import CudaCopies
from pscompile.memory.strict_copies import StrictCopies
from pscompile.memory.tiers import Link

STRICT_ENV = "PSCOMPILE_STRICT_COPIES"


def strict_requested(flag: bool) -> bool:
    """``Config.strict_copies``, or the environment variable ``PSCOMPILE_STRICT_COPIES=1``."""
    return flag or os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def make_copy_engine(link: Link, device: torch.device, *, strict: bool = False,
                     inline_bytes: int = INLINE_COPY_BYTES, pinned: bool = True) -> CopyEngine:
    """The copy engine for ``device``. The environment variable is for CPU runs: a CUDA device keeps
    its streams (``Config`` refuses ``strict_copies=True`` there); ``inline_bytes`` (CPU threads): the
    copies small enough to run inline; ``pinned`` (CUDA): its host buffers are page-locked
    (``Config.pinned_host``)."""
    if device.type == "cuda":
        return CudaCopies(link, device, pinned=pinned)
    if strict_requested(strict):
        return StrictCopies(link)
    return ThreadCopies(link, inline_bytes=inline_bytes)
