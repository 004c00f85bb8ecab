"""Device-aware optimizer-state placement (PatrickStar section 5.3), one rule for both modes.

The update of a chunk runs where its optimizer states (fp32 master, exp_avg, exp_avg_sq) live.
States that fit in the device's margin live there for the whole run: the margin is the budget
minus every parameter chunk (all may be resident at once) minus the larger of the largest
non-model peak and the temporaries of one chunk's update. Chunks 0..k-1 get the device places
(the first chunks in first-use order); the rest update on the host. An unlimited budget keeps
every chunk's states on the device. Frozen chunks have no states: only trainable chunks count, and
"the first k" are the first k trainable ones (``first_state_chunks``).
"""

from __future__ import annotations

from pscompile.memory.layout import ChunkLayout
from pscompile.memory.model_bytes import STATE_BYTES, state_chunks

# Bytes of device temporaries one chunk update needs, per element: the fp32 upcast of the
# gradient plus the fp32 temporary of the norm.
UPDATE_TEMP_BYTES_PER_ELEMENT = 8


def device_state_chunks(*, budget: int | None, peak_nonmodel: int, num_chunks: int, param_chunks: int,
                        chunk_size: int, param_chunk_bytes: int, state_chunk_bytes: int) -> int:
    """How many chunks (the first ``num_chunks`` that have optimizer states) keep their states on
    the device; ``param_chunks``: every parameter chunk, frozen ones too (all may be resident at
    once: a frozen weight paged over many chunks is read whole)."""
    if budget is None:
        return num_chunks
    temp = UPDATE_TEMP_BYTES_PER_ELEMENT * chunk_size
    margin = budget - max(peak_nonmodel, temp) - param_chunks * param_chunk_bytes
    return max(0, min(num_chunks, margin // state_chunk_bytes))


def first_state_chunks(layout: ChunkLayout, count: int) -> frozenset[int]:
    """The chunks whose optimizer states the first ``count`` device places take: the first
    ``count`` trainable chunks."""
    return frozenset(state_chunks(layout)[:count])


def host_shortfall_chunks(*, num_chunks: int, chunk_bytes: int, host_budget: int) -> int:
    """How many chunks (the first ones) must live on the device because ``host_budget`` cannot
    hold them (``chunk_bytes``: one chunk's compute-dtype copy, fp32 master and Adam states)."""
    return max(0, num_chunks - host_budget // chunk_bytes)


def host_state_chunks(*, num_chunks: int, chunk_size: int, param_bytes: int, staging_chunks: int,
                      host_budget: int) -> tuple[int, int]:
    """With a disk tier: how many chunks (the first ones) keep their optimizer states on the host,
    and the host bytes left over, when the host holds every compute-dtype chunk (``param_bytes``
    per element), the staging buffers of ``staging_chunks`` disk chunks and those states. The
    rest live on disk. A negative leftover means not even the fixed part fits."""
    state = STATE_BYTES * chunk_size
    fixed = num_chunks * chunk_size * param_bytes + staging_chunks * state
    on_host = max(0, min(num_chunks, (host_budget - fixed) // state))
    return on_host, host_budget - fixed - on_host * state


def update_overlaps_next_step(*, world: int, lock_free: bool, loss_scaled: bool, disk_states: bool) -> bool:
    """Whether a training step's optimizer update overlaps the next step (compiled mode): each
    chunk is updated as its writeback lands and the next step's first chunks are fetched as soon as
    they are updated (``plan_lookahead``). For one rank whose chunks the host updates in place:
    not lock-free, no loss scaling (its inf check needs every gradient first), no optimizer states
    on disk. The engine runs it and the planner plans the steady state by this one rule."""
    return world == 1 and not lock_free and not loss_scaled and not disk_states

