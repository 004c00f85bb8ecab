"""What a checkpoint file streams, and loading it back chunk by chunk: a mixin of ``ChunkEngine``.

The file (``checkpoint/file_format.py``) holds each chunk's optimizer state as it lives in the chunk store
(under ZeRO: this rank's shard of each group), named ``master.{c}``, ``exp_avg.{c}``,
``exp_avg_sq.{c}``, and in its header the state dict's scalars (step, parameter groups, loss scale,
the mode's measurements), the chunk layout and, under ZeRO, the rank's place. A file of this
engine's own layout (and rank) loads straight into the chunks; any other (another chunk size, or
another world size: a checkpoint resharded) is read tensor by tensor into the one-process state
dict and loaded with ``load_state_dict``, which takes it at any world size. A run planned with a
checkpoint's measurements that stops over the budget runs again without them (``_proven``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch

from pscompile.checkpoint.file_format import CheckpointReader, TensorSource
from pscompile.dist import checkpoint as shard_ckpt
from pscompile.dist.store import own_pieces
from pscompile.kinds import Collectives
from pscompile.memory.disk_states import LISTS
from pscompile.memory.tracker import OverBudget


class CheckpointState:
    """Mixin of ``ChunkEngine``: the checkpoint file's tensors and header, and loading them."""

    def _proven(self, run: Callable[[], Any]) -> Any:
        """``run()``; once more if it stopped over the budget (undone) because it was planned with
        a checkpoint's measurements, which ``_distrust_restored`` then drops (compiled mode)."""
        try:
            return run()
        except OverBudget as e:
            if not self._distrust_restored(e):
                raise
            return run()

    def _distrust_restored(self, error: OverBudget) -> bool:     # (hooks mode plans with none)
        return False

    def _state_used(self) -> list[int]:
        """Per chunk (ZeRO: per group shard): how many of its leading elements hold trainable
        parameters; the rest is padding (or frozen: no states), which a checkpoint neither writes nor reads."""
        used = [0] * len(self.store.master)
        per_chunk = self.world if hasattr(self.store, "owner") else 0
        for e in (e for e in self.layout.entries if e.kind.has_states):
            for g, so, _, n in own_pieces(e, self.store.home_numel, self.rank, per_chunk_world=per_chunk):
                used[g] = max(used[g], so + n)
        return used

    def checkpoint_tensors(self) -> list[TensorSource]:
        """Every chunk's optimizer-state buffers (the part that holds parameters), each fetched
        when it is written (a host buffer as it is; a device one through a host copy of one
        chunk). Lock-free: after every queued update."""
        self._apply_queued_updates()
        self._refuse_if_stopped()
        return [(f"{key}.{c}", torch.float32, n, partial(self._state_on_host, c, i, n))
                for c, n in enumerate(self._state_used()) if n for i, key in enumerate(LISTS)]

    def _state_on_host(self, c: int, i: int, n: int) -> torch.Tensor:
        t = self.store._states(c)[i][:n]
        if t.device.type == "cpu":
            return t
        staged = torch.empty(n, dtype=t.dtype)
        self.copies.move(staged, t, "d2h")
        return staged

    def checkpoint_header(self) -> dict:
        """The header's engine part: the scalars of the state dict, the layout, the rank's place."""
        return {"state": self._scalar_state(), "layout": shard_ckpt.layout_record(self.layout),
                "shard": self._shard_place()}

    def _shard_place(self) -> dict | None:
        """Under ZeRO: this rank's place (rank, world size, collectives); None for one process."""
        if self.comm is None:
            return None
        return {"rank": self.rank, "world_size": self.world,
                "collectives": str(Collectives.PER_CHUNK if hasattr(self.store, "owner") else Collectives.GROUP)}

    def fits_directly(self, header: dict) -> bool:
        """The file was written by an engine of this layout and this rank's place: it loads
        chunk by chunk (else ``full_state_from`` reads it into a state dict)."""
        ours = [(f"{key}.{c}", n) for c, n in enumerate(self._state_used()) if n for key in LISTS]
        theirs = [(n, k) for n, _, k in header.get("tensors", []) if not n.startswith(("rng.", "frozen."))]
        return header.get("layout") == shard_ckpt.layout_record(self.layout) and \
            header.get("shard") == self._shard_place() and ours == theirs

    def load_checkpoint_tensors(self, reader: CheckpointReader) -> None:
        """Load a verified file of this engine's layout (``fits_directly``), chunk by chunk, then
        the scalars. Its scalars were checked (``state_problems``) before."""
        state = reader.header["state"]
        hps = self._saved_groups(state)
        if self.updater is not None:        # what the queued updates would change is loaded over
            self.updater.discard()
        for c, n in enumerate(self._state_used()):
            if not n:
                continue
            bufs = self.store._states(c, write=True)
            for i, key in enumerate(LISTS):
                dst = bufs[i]
                if dst.device.type == "cpu" and dst.is_contiguous():
                    reader.read_into(f"{key}.{c}", dst[:n])
                    dst[n:].zero_()
                else:
                    staged = torch.zeros(dst.numel(), dtype=dst.dtype)
                    reader.read_into(f"{key}.{c}", staged[:n])
                    self.copies.submit(dst, staged, "h2d").wait_host()
        if self.store.disk is not None:
            self.store.disk.flush()
        self._undo_all()       # param chunks = master cast to the compute dtype
        self._count_outside_steps()
        self._load_scalars(state, hps)


def full_state_from(readers: Sequence[CheckpointReader]) -> dict:
    """The one-process state dict (``{"master": {fqn: tensor}, ..., "step", ...}``) that the files
    of one checkpoint hold (one file, or every rank's of a ZeRO checkpoint in rank order), read
    tensor by tensor (the whole state in memory once: the path of a resharded or re-laid-out load)."""
    header = readers[0].header
    layout = shard_ckpt._layout_of(header["layout"])
    shard = header.get("shard")
    world = shard["world_size"] if shard else 1
    per_chunk = world if shard and shard["collectives"] == str(Collectives.PER_CHUNK) else 0
    size = layout.chunk_size if per_chunk or world == 1 else layout.chunk_size // world
    out: dict = {key: {} for key in LISTS}
    for e in (e for e in layout.entries if e.kind.has_states):     # (a frozen parameter has no state)
        for key in LISTS:
            flat = torch.empty(e.numel, dtype=torch.float32)
            for r in range(world):
                for g, so, to, n in own_pieces(e, size, r, per_chunk_world=per_chunk):
                    readers[r].read_into(f"{key}.{g}", flat[to:to + n], start=so)
            out[key][e.fqn] = flat.view(e.shape)
    return {**header["state"], **out}
